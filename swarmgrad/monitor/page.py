"""The dashboard: one self-contained HTML page (inline CSS, JS and SVG; nothing fetched
from elsewhere, so it works offline). It polls ``/api/snapshot`` every two seconds and
draws the runs' peers, epochs, loss and throughput over time, averaging health, expert
servers, offenders and the records the monitor refused.

The page arrives with the current snapshot inlined (:func:`render_page`), so it shows
the swarm as soon as it is parsed, without waiting for a first request; it records when
that first render finished in ``<body data-rendered-ms>`` (milliseconds since navigation
began), which ``benchmarks/demo.py`` reads as the page's load time.

Everything that came from the swarm is inserted as text (``textContent``), never as
markup, so a peer cannot inject anything into the page through its records."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DASHBOARD_HTML", "render_page"]

_PLACEHOLDER = "__INITIAL_SNAPSHOT__"


def render_page(snapshot: dict[str, Any] | None) -> str:
    """The dashboard with ``snapshot`` inlined as JSON (None: the page fetches it)."""
    data = json.dumps(snapshot, allow_nan=False, default=str)
    # inside <script> only "</" could end the element early; escaping <, > and & keeps
    # the JSON valid and the markup inert
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return DASHBOARD_HTML.replace(_PLACEHOLDER, data, 1)


DASHBOARD_HTML = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarmgrad monitor</title>
<style>
  :root { --bg:#f6f7f9; --card:#fff; --ink:#1d2330; --muted:#6b7280; --line:#e5e7eb;
          --ok:#16a34a; --bad:#dc2626; --warn:#d97706; --accent:#2563eb; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;
         background:var(--bg); color:var(--ink); }
  header { display:flex; align-items:baseline; gap:16px; padding:12px 20px;
           background:#111827; color:#f9fafb; }
  header h1 { font-size:18px; margin:0; }
  header .status { color:#9ca3af; font-size:13px; }
  main { padding:16px 20px; display:grid; gap:16px;
         grid-template-columns:repeat(auto-fit,minmax(420px,1fr)); }
  section { background:var(--card); border:1px solid var(--line); border-radius:8px;
            padding:12px 14px; min-width:0; }
  section.wide { grid-column:1/-1; }
  h2 { font-size:14px; margin:0 0 8px; color:var(--muted); text-transform:uppercase;
       letter-spacing:.04em; }
  #runs button { margin:0 6px 6px 0; padding:4px 10px; border:1px solid var(--line);
                 background:#fff; border-radius:14px; cursor:pointer; }
  #runs button.selected { background:var(--accent); border-color:var(--accent); color:#fff; }
  .stats { display:flex; flex-wrap:wrap; gap:18px; }
  .stat b { display:block; font-size:22px; }
  .stat span { color:var(--muted); font-size:12px; }
  table { border-collapse:collapse; width:100%; font-size:13px; }
  th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line);
           white-space:nowrap; }
  th { color:var(--muted); font-weight:600; }
  td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; }
  td.id { font-family:ui-monospace,monospace; max-width:220px; overflow:hidden;
          text-overflow:ellipsis; }
  td.wrap { white-space:normal; min-width:14em; }
  .scroll { overflow-x:auto; }
  svg { width:100%; height:220px; display:block; }
  svg text { font-size:11px; fill:var(--muted); }
  .axis { stroke:#9ca3af; stroke-width:1; }
  .grid { stroke:var(--line); stroke-width:1; }
  .legend { font-size:12px; color:var(--muted); }
  .legend i { display:inline-block; width:10px; height:10px; margin:0 4px 0 10px;
              border-radius:2px; vertical-align:middle; }
  .empty { color:var(--muted); font-style:italic; }
  .bad { color:var(--bad); } .ok { color:var(--ok); } .warn { color:var(--warn); }
</style>
</head>
<body>
<header>
  <h1>swarmgrad monitor</h1>
  <span class="status" id="status">loading…</span>
</header>
<main>
  <section class="wide">
    <h2>Runs</h2>
    <div id="runs"><span class="empty">no run seen yet</span></div>
    <div class="stats" id="run-stats"></div>
  </section>
  <section>
    <h2>Loss</h2>
    <svg id="loss-chart" viewBox="0 0 600 220" preserveAspectRatio="none"></svg>
    <div class="legend" id="loss-legend"></div>
  </section>
  <section>
    <h2>Throughput (samples/s)</h2>
    <svg id="throughput-chart" viewBox="0 0 600 220" preserveAspectRatio="none"></svg>
  </section>
  <section>
    <h2>Epoch and peers</h2>
    <svg id="epoch-chart" viewBox="0 0 600 220" preserveAspectRatio="none"></svg>
    <div class="legend"><i style="background:#2563eb"></i>epoch<i
      style="background:#d97706"></i>peers</div>
  </section>
  <section>
    <h2>Averaging health</h2>
    <svg id="averaging-chart" viewBox="0 0 600 220" preserveAspectRatio="none"></svg>
    <div class="legend"><i style="background:#16a34a"></i>rounds ok<i
      style="background:#dc2626"></i>rounds failed (cumulative, all peers)</div>
  </section>
  <section class="wide">
    <h2>Peers</h2>
    <div class="scroll"><table id="peers">
      <thead><tr><th>peer</th><th>role</th><th class="num">epoch</th>
        <th class="num">loss</th><th class="num">samples/s</th>
        <th class="num">rounds ok</th><th class="num">failed</th>
        <th class="num">sent</th><th class="num">received</th>
        <th class="num">seen</th></tr></thead>
      <tbody></tbody>
    </table></div>
  </section>
  <section class="wide">
    <h2>Expert servers</h2>
    <div class="scroll"><table id="experts">
      <thead><tr><th>peer</th><th>run</th><th class="num">experts</th>
        <th class="num">batches</th><th>uids</th></tr></thead>
      <tbody></tbody>
    </table></div>
  </section>
  <section class="wide">
    <h2>Offenders</h2>
    <div class="scroll"><table id="offenders">
      <thead><tr><th>peer</th><th class="num">reporters</th>
        <th class="num">clipped</th><th class="num">bad sums</th>
        <th class="num">bans</th></tr></thead>
      <tbody></tbody>
    </table></div>
    <p class="legend">Peers whose contributions robust averaging clipped (rounds), whose
      reductions failed a check (bad sums), by how many peers, and how many ban them.</p>
    <p class="legend" id="rejected"></p>
  </section>
</main>
<script id="initial-snapshot" type="application/json">__INITIAL_SNAPSHOT__</script>
<script>
"use strict";
const COLORS = ["#2563eb","#16a34a","#d97706","#9333ea","#0891b2","#db2777","#65a30d",
                "#ea580c","#4f46e5","#0d9488"];
const SVGNS = "http://www.w3.org/2000/svg";
let selectedRun = null;

function el(tag, attrs, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4))
                                      : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "-";
  if (Math.abs(x) >= 1e4) return x.toExponential(2);
  return Number(x).toFixed(digits === undefined ? 2 : digits);
}
function bytes(n) {
  if (!n) return "0 B";
  const units = ["B","KB","MB","GB","TB"]; let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}
function shortId(id) { return id.length > 16 ? id.slice(0, 8) + "…" + id.slice(-6) : id; }

// series: [{name, color, points: [[x, y], ...], cls}]
function drawChart(svg, series, opts) {
  opts = opts || {};
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 600, H = 220, L = 52, R = 10, T = 10, B = 24;
  const pts = series.flatMap(s => s.points.filter(p => p[1] !== null && isFinite(p[1])));
  if (!pts.length) {
    svg.appendChild(el("svg:text", {x: W / 2, y: H / 2, "text-anchor": "middle",
                                    class: "empty-chart"}, "no data yet"));
    return;
  }
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (opts.zero) y0 = Math.min(0, y0);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 = y0 + (Math.abs(y0) || 1) * 0.1; y0 = y0 - (opts.zero ? 0 : (y1 - y0)); }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    svg.appendChild(el("svg:line", {x1: L, x2: W - R, y1: sy(y), y2: sy(y), class: "grid"}));
    const label = opts.integer ? (Number.isInteger(y) ? String(y) : "") : fmt(y, 2);
    svg.appendChild(el("svg:text", {x: L - 4, y: sy(y) + 4, "text-anchor": "end"}, label));
  }
  svg.appendChild(el("svg:line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
  svg.appendChild(el("svg:line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
  const span = x1 - x0;
  svg.appendChild(el("svg:text", {x: L, y: H - 6}, "-" + Math.round(span) + " s"));
  svg.appendChild(el("svg:text", {x: W - R, y: H - 6, "text-anchor": "end"}, "now"));
  for (const s of series) {
    const good = s.points.filter(p => p[1] !== null && isFinite(p[1]));
    if (!good.length) continue;
    const d = good.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " +
                                 sy(p[1]).toFixed(1)).join(" ");
    svg.appendChild(el("svg:path", {d: d, fill: "none", stroke: s.color,
      "stroke-width": s.width || 2, class: "series " + (s.cls || ""),
      "data-name": s.name, "data-points": good.length}));
    if (good.length === 1) {
      svg.appendChild(el("svg:circle", {cx: sx(good[0][0]), cy: sy(good[0][1]), r: 3,
                                        fill: s.color}));
    }
  }
}

function fillTable(table, rows, empty) {
  const body = table.tBodies[0];
  while (body.firstChild) body.removeChild(body.firstChild);
  if (!rows.length) {
    const tr = el("tr"); const td = el("td", {colspan: table.tHead.rows[0].cells.length,
                                              class: "empty"}, empty);
    tr.appendChild(td); body.appendChild(tr); return;
  }
  for (const row of rows) {
    const tr = el("tr", row.attrs || {});
    for (const cell of row.cells) {
      const attrs = {class: cell[1] || ""};
      if (cell[2]) attrs.title = cell[2];
      tr.appendChild(el("td", attrs, cell[0]));
    }
    body.appendChild(tr);
  }
}

function render(snap) {
  const runsBox = document.getElementById("runs");
  while (runsBox.firstChild) runsBox.removeChild(runsBox.firstChild);
  const runs = snap.runs || [];
  if (!runs.some(r => r.run_id === selectedRun)) {
    const busiest = runs.slice().sort((a, b) => b.num_peers - a.num_peers)[0];
    selectedRun = busiest ? busiest.run_id : null;
  }
  if (!runs.length) runsBox.appendChild(el("span", {class: "empty"}, "no run seen yet"));
  for (const r of runs) {
    const b = el("button", {class: r.run_id === selectedRun ? "selected" : "",
                            "data-run": r.run_id}, r.run_id + " (" + r.num_peers + ")");
    b.onclick = () => { selectedRun = r.run_id; render(snap); };
    runsBox.appendChild(b);
  }
  const run = runs.find(r => r.run_id === selectedRun);
  const stats = document.getElementById("run-stats");
  while (stats.firstChild) stats.removeChild(stats.firstChild);
  const t0 = snap.time;
  const rel = arr => arr.map(t => t - t0);
  if (run) {
    const items = [["epoch", run.epoch], ["peers", run.num_peers],
      ["clients", run.num_clients], ["loss", fmt(run.loss, 4)],
      ["samples/s", fmt(run.samples_per_second, 1)],
      ["rounds ok / failed", run.rounds_ok + " / " + run.rounds_failed],
      ["bytes sent", bytes(run.bytes_sent)]];
    for (const [name, value] of items) {
      const d = el("div", {class: "stat", "data-stat": name});
      d.appendChild(el("b", {}, value)); d.appendChild(el("span", {}, name));
      stats.appendChild(d);
    }
  }
  const h = run ? run.history : {time: [], loss: [], samples_per_second: [], epoch: [],
                                 num_peers: [], rounds_ok: [], rounds_failed: []};
  const times = rel(h.time);
  const zip = ys => times.map((t, i) => [t, ys[i]]);
  const lossSeries = [];
  const legend = document.getElementById("loss-legend");
  while (legend.firstChild) legend.removeChild(legend.firstChild);
  if (run) {
    Object.entries(run.loss_by_peer).forEach(([peer, pts], i) => {
      const color = COLORS[i % COLORS.length];
      lossSeries.push({name: peer, color: color, width: 1.2, cls: "peer-loss",
                       points: pts.map(p => [p[0] - t0, p[1]])});
      legend.appendChild(el("i", {style: "background:" + color}));
      legend.appendChild(document.createTextNode(shortId(peer)));
    });
    lossSeries.push({name: "mean", color: "#111827", width: 2.5, cls: "loss-line",
                     points: zip(h.loss)});
    legend.appendChild(el("i", {style: "background:#111827"}));
    legend.appendChild(document.createTextNode("mean"));
  }
  drawChart(document.getElementById("loss-chart"), lossSeries);
  drawChart(document.getElementById("throughput-chart"),
    [{name: "samples/s", color: "#2563eb", cls: "throughput-line",
      points: zip(h.samples_per_second)}], {zero: true});
  drawChart(document.getElementById("epoch-chart"),
    [{name: "epoch", color: "#2563eb", cls: "epoch-line", points: zip(h.epoch)},
     {name: "peers", color: "#d97706", cls: "peers-line", points: zip(h.num_peers)}],
    {zero: true, integer: true});
  drawChart(document.getElementById("averaging-chart"),
    [{name: "ok", color: "#16a34a", cls: "rounds-ok-line", points: zip(h.rounds_ok)},
     {name: "failed", color: "#dc2626", cls: "rounds-failed-line",
      points: zip(h.rounds_failed)}], {zero: true, integer: true});
  fillTable(document.getElementById("peers"), (run ? run.peers : []).map(p => ({
    attrs: {class: "peer", "data-peer": p.peer_id},
    cells: [[p.peer_id, "id"], [p.role + (p.client_mode && p.role !== "client" ? " (client)" : "")],
            [p.epoch, "num"], [fmt(p.loss, 4), "num"], [fmt(p.samples_per_second, 1), "num"],
            [p.rounds_ok, "num ok"], [p.rounds_failed, p.rounds_failed ? "num bad" : "num"],
            [bytes(p.bytes_sent), "num"], [bytes(p.bytes_received), "num"],
            [fmt(p.last_seen_s, 0) + " s", "num"]]})), "no peers");
  fillTable(document.getElementById("experts"), (snap.expert_servers || []).map(p => ({
    attrs: {class: "expert-server", "data-peer": p.peer_id},
    cells: [[shortId(p.peer_id), "id", p.peer_id], [p.run_id], [p.num_experts, "num"],
            [p.expert_batches, "num"], [p.experts.slice(0, 8).join(" ") +
                                        (p.experts.length > 8 ? " …" : ""), "wrap"]]})),
    "no expert server seen");
  fillTable(document.getElementById("offenders"), (run ? run.offenders : []).map(o => ({
    attrs: {class: "offender", "data-peer": o.peer_id},
    cells: [[shortId(o.peer_id), "id", o.peer_id], [o.reported_by, "num"],
            [o.clipped_rounds, "num warn"],
            [o.bad_reductions, o.bad_reductions ? "num bad" : "num"],
            [o.banned_by, o.banned_by ? "num bad" : "num"]]})), "none reported");
  const rej = snap.rejected || {};
  document.getElementById("rejected").textContent =
    "Records ignored by the monitor: " + (rej.malformed || 0) + " malformed, " +
    (rej.oversized || 0) + " oversized.";
  const status = document.getElementById("status");
  status.textContent = runs.length + " run(s), " + snap.polls + " polls" +
    (snap.last_poll_error ? " — last poll failed: " + snap.last_poll_error : "") +
    " — updated " + new Date().toLocaleTimeString();
  document.body.setAttribute("data-polls", snap.polls);
}

function renderFirst(snap) {
  render(snap);
  if (!document.body.hasAttribute("data-rendered-ms")) {
    document.body.setAttribute("data-rendered-ms", performance.now().toFixed(1));
  }
}

let failures = 0;
async function refresh() {
  try {
    const response = await fetch("api/snapshot", {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    renderFirst(await response.json());
    failures = 0;
  } catch (e) {
    failures++;
    document.getElementById("status").textContent =
      "cannot reach the monitor (" + e.message + "), retrying";
  }
  setTimeout(refresh, failures ? 5000 : 2000);
}
let initial = null;
try {
  initial = JSON.parse(document.getElementById("initial-snapshot").textContent);
} catch (e) { initial = null; }
if (initial) { renderFirst(initial); setTimeout(refresh, 2000); } else { refresh(); }
</script>
</body>
</html>
"""
