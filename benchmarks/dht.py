"""DHT benchmark: a swarm of peer processes on loopback, concurrent stores and gets, churn.

Modeled on hivemind's ``benchmarks/benchmark_dht.py`` so the figures compare:

1. N peers (default 64), each its own process (``benchmarks/_dht_peer.py``) with real
   sockets on 127.0.0.1. The interpreters are launched together (imports, not counted);
   then the DHTs start one after another, each bootstrapped from up to 3 random peers
   already running (the first from none): ``startup_s`` is that sequential start.
2. Rounds: ``--num-tasks`` (4) concurrent tasks x ``--num-rounds`` (8) rounds. In each
   round ``--store-peers`` (8) random peers store one subkey each (their own peer id)
   under a fresh key, expiring in an hour; then ``--get-peers`` (8) other random peers
   ``get(key, latest=True)``; a get succeeds if it sees every subkey that was stored.
   Reported: store / get success rates, mean store and get round wall times (hivemind's
   "mean store time" and "mean get time") and the per-get latency (mean, p99, measured
   inside the peer, free of the benchmark's pipe).
3. Churn: then ``--failure-rate`` (0.1) of the peers are SIGKILLed (whole process groups,
   no goodbye) and the rounds run again on fresh keys among the survivors.

Memory: unique set size (USS, psutil's ``memory_full_info().uss``, or the same sum from
/proc/PID/smaps_rollup where psutil is missing) and RSS of each peer's process tree after
the first rounds; the median over peers is reported. A hivemind peer is a tree: the
process that imports hivemind, the DHT process it forks, its p2pd daemon and the
torch_shm_manager that importing torch starts.

The coordinator talks to the peers over ``multiprocessing`` pipes; every wait is bounded,
and every peer process group is killed in ``finally``. Peers also exit on their own when
the pipe closes or after ``--lifetime``. A watchdog kills the swarm if the machine's
available memory falls under 2 GiB (64 of our peers took ~19 GiB on 2026-11-21: a 4 MiB
receive buffer per secure connection).

Reference: with ``HIVEMIND_PYTHON`` naming an interpreter that can ``import hivemind``
(hivemind 1.1.12 in /tmp/hmvenv on the build VM), this script re-runs itself there with
``--impl hivemind`` (that path imports nothing from swarmgrad) for the same shape and
prints the ratios. Without it, the figures hivemind 1.1.12 was measured at on this box are
used, labelled as such.

``--sim``: the same DHT code on the simulated network (virtual clock), 4096 peers, 200
keys stored and fetched; reports success and the hops per lookup against log2(N) / 2.
Not part of the default run: about 20 minutes and 13 GB here, since every join refreshes
each bucket and the nodes keep those connections (the whole build lasts less virtual
time than the idle timeout); ``--sim-no-join-refresh`` takes about 4 minutes and 3 GB.

Output: a table, then, last, one JSON line (``peers``, ``store_success``, ``get_success``,
``store_mean_s``, ``get_mean_s``, ``get_p99_s``, ``uss_mb_per_peer``, ``startup_s``,
``rss_mb_per_peer``, ``hivemind_get_mean_s``, ``get_ratio_vs_hivemind``, ``churn_*``).
Top-level figures are those without churn; ``churn_*`` those after the kill.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait

try:
    import psutil
except ImportError:  # the hivemind venv has no psutil: read /proc ourselves
    psutil = None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEER_SCRIPT = os.path.join(HERE, "_dht_peer.py")
EXPIRATION_S = 3600.0
HIVEMIND_TIMEOUT_S = 600.0
MIN_AVAILABLE_BYTES = 2 * 2**30  # the watchdog kills the swarm below this

# hivemind 1.1.12 measured on this box with its own benchmark_dht.py: 64 peers, 4 tasks x
# 8 rounds, 8 store + 8 get peers per round, 10% of the peers failed.
HIVEMIND_DOCUMENTED = {
    "source": "documented: hivemind 1.1.12 measured on this box, 10% failure rate",
    "failure_rate": 0.1,
    "startup_s": 38.0,
    "store_success": 1.0,
    "get_success": 1.0,
    "store_mean_s": 1.10,
    "get_mean_s": 1.15,
    "uss_mb_per_peer": 80.0,
}


# ============================================================================ the swarm


class PeerGone(Exception):
    """The peer process exited (or was killed) before answering."""


@dataclass
class PeerHandle:
    index: int
    process: subprocess.Popen
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    hello: threading.Event = field(default_factory=threading.Event)
    open: bool = True  # the pipe is open (the dispatcher closes it on EOF)
    killed: bool = False
    maddrs: list[str] = field(default_factory=list)
    peer_id: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid


class Swarm:
    """Peer processes and the pipes to them; requests return concurrent futures.

    One dispatcher thread reads every pipe and resolves the futures; a pipe that closes
    fails its peer's pending requests with PeerGone.
    """

    def __init__(self, impl: str, python: str, log_file, lifetime: float):
        self.impl, self.python, self.log_file, self.lifetime = impl, python, log_file, lifetime
        self.peers: list[PeerHandle] = []
        self._pending: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._dispatcher = threading.Thread(target=self._dispatch, name="dht-bench", daemon=True)
        self._watchdog = threading.Thread(target=self._watch_memory, name="dht-mem", daemon=True)
        self.aborted: str | None = None  # why the watchdog killed the swarm

    # ---------------------------------------------------------------- processes

    def spawn(self, num_peers: int, timeout: float) -> float:
        """Launch the peer interpreters together; wait until each has imported its DHT."""
        env = dict(os.environ)
        if self.impl == "swarmgrad":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
        started = time.perf_counter()
        for index in range(num_peers):
            ours, theirs = Pipe(duplex=True)
            command = [self.python, PEER_SCRIPT, "--fd", str(theirs.fileno())]
            command += ["--impl", self.impl, "--lifetime", str(self.lifetime)]
            try:
                process = subprocess.Popen(
                    command,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,  # its own process group: killpg reaches p2pd too
                    stdin=subprocess.DEVNULL,
                    stdout=self.log_file,
                    stderr=self.log_file,
                    env=env,
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self.peers.append(PeerHandle(index, process, ours))
        self._dispatcher.start()
        self._watchdog.start()
        deadline = time.monotonic() + timeout
        for peer in self.peers:
            if not peer.hello.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"peer {peer.index} (pid {peer.pid}) did not start in time")
        return time.perf_counter() - started

    def kill(self, peer: PeerHandle) -> None:
        """SIGKILL the peer's whole process group: no goodbye to anyone."""
        peer.killed = True
        _killpg(peer.pid)

    def close(self, timeout: float = 20.0) -> None:
        """Ask live peers to leave, then kill every process group and reap everything."""
        try:
            goodbyes = [
                self.request(peer, "shutdown")
                for peer in self.peers
                if peer.open and not peer.killed and peer.hello.is_set()
            ]
            concurrent.futures.wait(goodbyes, timeout=timeout)
            deadline = time.monotonic() + 5.0
            while (
                self._dispatcher.is_alive()
                and any(p.open for p in self.peers)
                and time.monotonic() < deadline
            ):
                time.sleep(0.05)  # pipes close when the peers exit
        finally:
            self._stopping.set()
            for thread in (self._dispatcher, self._watchdog):
                if thread.is_alive():
                    thread.join(timeout=5.0)
            # the peers are unreaped until wait(): their pids (and process group ids) can
            # not be reused yet, so killpg only reaches our own leftovers
            for peer in self.peers:
                _killpg(peer.pid)
            for peer in self.peers:
                try:
                    peer.process.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    print(f"peer pid {peer.pid} did not die", file=sys.stderr)
                peer.conn.close()

    # ---------------------------------------------------------------- requests

    def request(self, peer: PeerHandle, op: str, *args) -> concurrent.futures.Future:
        """Send ``(op, id, *args)``; the future resolves to the peer's ``(ok, result)``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        request_id = next(self._ids)
        with self._pending_lock:
            if not peer.open:
                future.set_exception(PeerGone(f"peer {peer.index} is gone"))
                return future
            self._pending[request_id] = (peer.index, future)
        try:
            with peer.send_lock:
                peer.conn.send((op, request_id, *args))
        except (OSError, EOFError, ValueError) as e:
            self._resolve(request_id, exception=PeerGone(f"peer {peer.index}: {e}"))
        return future

    def forget(self, futures) -> None:
        """Stop waiting for these requests (late replies are dropped)."""
        ids = {id(f) for f in futures}
        with self._pending_lock:
            for request_id in [r for r, (_, f) in self._pending.items() if id(f) in ids]:
                del self._pending[request_id]

    def _resolve(self, request_id: int, result=None, exception=None) -> None:
        with self._pending_lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        if exception is not None:
            entry[1].set_exception(exception)
        else:
            entry[1].set_result(result)

    def _dispatch(self) -> None:
        while not self._stopping.is_set():
            by_conn = {p.conn: p for p in self.peers if p.open}
            if not by_conn:
                self._stopping.wait(0.05)
                continue
            for conn in wait(list(by_conn), timeout=0.2):
                peer = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._peer_gone(peer)
                    continue
                if message[0] == "hello":
                    peer.hello.set()
                    continue
                request_id, ok, result = message
                self._resolve(request_id, (ok, result))

    def _watch_memory(self) -> None:
        """Kill the swarm before it exhausts the machine's memory (a shared box)."""
        while not self._stopping.wait(0.5):
            available = _available_memory()
            if available is not None and available < MIN_AVAILABLE_BYTES:
                self.aborted = (
                    f"only {available / 2**30:.1f} GiB of memory left with "
                    f"{sum(not p.killed for p in self.peers)} peers running: swarm killed"
                )
                print(self.aborted, file=sys.stderr, flush=True)
                for peer in self.peers:
                    self.kill(peer)
                return

    def check(self) -> None:
        if self.aborted:
            raise RuntimeError(self.aborted)

    def _peer_gone(self, peer: PeerHandle) -> None:
        with self._pending_lock:
            peer.open = False
            gone = [r for r, (index, _) in self._pending.items() if index == peer.index]
        for request_id in gone:
            self._resolve(request_id, exception=PeerGone(f"peer {peer.index} exited"))


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ============================================================================ memory


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    pids, queue = [], [pid]
    while queue:
        current = queue.pop()
        pids.append(current)
        queue.extend(_children(current))
    return pids


def _uss_rss(pid: int) -> tuple[int, int]:
    """(USS, RSS) in bytes; (0, 0) if the process is gone."""
    if psutil is not None:
        try:
            info = psutil.Process(pid).memory_full_info()
            return info.uss, info.rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return 0, 0
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    fields[name] = int(parts[0]) * 1024
    except OSError:
        return 0, 0
    uss = sum(fields.get(k, 0) for k in ("Private_Clean", "Private_Dirty", "Private_Hugetlb"))
    return uss, fields.get("Rss", 0)


def cpu_seconds(peers: list[PeerHandle]) -> float:
    """User + system CPU time used so far by the peers' process trees."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for peer in peers:
        for pid in _tree(peer.pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, ValueError, IndexError):
                pass
    return total / ticks


def _name(pid: int) -> str:
    """The program's name (argv[0] without its directory; /proc comm is cut at 15)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
        if argv0:
            return os.path.basename(argv0)
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def measure_memory(peers: list[PeerHandle]) -> dict:
    """Median over peers of the USS / RSS summed over each peer's process tree, in MB,
    and the median USS of each kind of process in it ("peer" is the root; for hivemind
    the others are its forked DHT process, p2pd and torch_shm_manager)."""
    uss, rss, processes = [], [], []
    by_name: dict[str, list[float]] = {}
    for peer in peers:
        pids = _tree(peer.pid)
        figures = [_uss_rss(pid) for pid in pids]
        uss.append(sum(u for u, _ in figures) / 1e6)
        rss.append(sum(r for _, r in figures) / 1e6)
        processes.append(len(pids))
        names = ["peer"] + [_name(pid) for pid in pids[1:]]
        for name in dict.fromkeys(names):
            total = sum(u for n, (u, _) in zip(names, figures, strict=True) if n == name)
            by_name.setdefault(name, []).append(total / 1e6)
    return {
        "uss_mb_per_peer": round(statistics.median(uss), 1),
        "rss_mb_per_peer": round(statistics.median(rss), 1),
        "uss_mb_per_peer_max": round(max(uss), 1),
        "uss_mb_by_process": {n: round(statistics.median(v), 1) for n, v in by_name.items()},
        "processes_per_peer": statistics.median(processes),
    }


# ============================================================================ rounds


@dataclass(frozen=True)
class RoundResult:
    stores: int
    stores_ok: int
    gets: int
    gets_ok: int
    store_s: float
    get_s: float
    get_latencies: tuple[float, ...]
    errors: tuple[str, ...]


def _finish(swarm: Swarm, futures: list, timeout: float) -> list[tuple[bool, object]]:
    """Wait for the requests (bounded); (ok, result or error) for each, in order."""
    concurrent.futures.wait(futures, timeout=timeout)
    swarm.forget([f for f in futures if not f.done()])
    outcomes = []
    for future in futures:
        if not future.done():
            outcomes.append((False, f"no answer in {timeout:.0f} s"))
        elif future.exception() is not None:
            outcomes.append((False, str(future.exception())))
        else:
            outcomes.append(future.result())
    return outcomes


def run_round(
    swarm: Swarm, alive: list[PeerHandle], rng: random.Random, args: argparse.Namespace
) -> RoundResult:
    chosen = rng.sample(alive, args.store_peers + args.get_peers)
    storers, getters = chosen[: args.store_peers], chosen[args.store_peers :]
    key = f"bench-{uuid.UUID(int=rng.getrandbits(128)).hex}"
    values = {peer.peer_id: rng.getrandbits(62) for peer in storers}
    errors: list[str] = []

    started = time.perf_counter()
    stores = [
        swarm.request(peer, "store", key, peer.peer_id, values[peer.peer_id], EXPIRATION_S)
        for peer in storers
    ]
    outcomes = _finish(swarm, stores, args.request_timeout)
    stored = {}
    for peer, (ok, result) in zip(storers, outcomes, strict=True):
        if ok and result[0]:
            stored[peer.peer_id] = values[peer.peer_id]
        else:
            errors.append(f"store by peer {peer.index}: {result if not ok else 'not stored'}")
    store_s = time.perf_counter() - started

    started = time.perf_counter()
    gets = [swarm.request(peer, "get", key) for peer in getters]
    outcomes = _finish(swarm, gets, args.request_timeout)
    gets_ok, latencies = 0, []
    for peer, (ok, result) in zip(getters, outcomes, strict=True):
        if not ok:
            errors.append(f"get by peer {peer.index}: {result}")
            continue
        seen, seconds = result
        latencies.append(seconds)
        if seen is not None and all(seen.get(s) == v for s, v in stored.items()):
            gets_ok += 1
        else:
            missing = sorted(set(stored) - set(seen or {}))
            errors.append(f"get by peer {peer.index}: {len(missing)}/{len(stored)} subkeys missing")
    get_s = time.perf_counter() - started
    return RoundResult(
        stores=len(storers),
        stores_ok=len(stored),
        gets=len(getters),
        gets_ok=gets_ok,
        store_s=store_s,
        get_s=get_s,
        get_latencies=tuple(latencies),
        errors=tuple(errors),
    )


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def run_phase(swarm: Swarm, alive: list[PeerHandle], seed: int, args) -> dict:
    """num_tasks concurrent tasks of num_rounds rounds each; the phase's figures."""

    def task(task_index: int) -> list[RoundResult]:
        rng = random.Random(seed * 1000 + task_index)
        return [run_round(swarm, alive, rng, args) for _ in range(args.num_rounds)]

    cpu_before, wall = cpu_seconds(alive), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.num_tasks) as pool:
        rounds = [r for results in pool.map(task, range(args.num_tasks)) for r in results]
    cpu, wall = cpu_seconds(alive) - cpu_before, time.perf_counter() - wall
    latencies = [s for r in rounds for s in r.get_latencies]
    errors = [e for r in rounds for e in r.errors]
    return {
        "alive": len(alive),
        "stores": sum(r.stores for r in rounds),
        "gets": sum(r.gets for r in rounds),
        "store_success": sum(r.stores_ok for r in rounds) / sum(r.stores for r in rounds),
        "get_success": sum(r.gets_ok for r in rounds) / sum(r.gets for r in rounds),
        "store_mean_s": statistics.fmean(r.store_s for r in rounds),
        "get_mean_s": statistics.fmean(r.get_s for r in rounds),
        "get_latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "get_p99_s": _p99(latencies) if latencies else None,
        "get_max_s": max(latencies) if latencies else None,
        "wall_s": wall,
        "peer_cpu_s": cpu,  # all peers' processes together
        "errors": len(errors),
        "error_examples": errors[:5],
    }


def start_peers(swarm: Swarm, rng: random.Random, timeout: float) -> tuple[float, list[float]]:
    """Start the DHTs one after another, each from up to 3 random running peers."""
    running: list[PeerHandle] = []
    per_peer = []
    started = time.perf_counter()
    for peer in swarm.peers:
        initial = [m for p in rng.sample(running, min(3, len(running))) for m in p.maddrs]
        future = swarm.request(peer, "start", initial)
        ok, result = _finish(swarm, [future], timeout)[0]
        swarm.check()
        if not ok:
            raise RuntimeError(f"peer {peer.index} (pid {peer.pid}) failed to start: {result}")
        peer.maddrs, peer.peer_id, seconds = result
        per_peer.append(seconds)
        running.append(peer)
    return time.perf_counter() - started, per_peer


def run_swarm(args: argparse.Namespace, impl: str, python: str) -> dict:
    """Spawn, start, run the rounds without and with churn, measure memory; clean up."""
    rng = random.Random(args.seed)
    log = tempfile.NamedTemporaryFile(prefix=f"dht-bench-{impl}-", suffix=".log", delete=False)
    swarm = Swarm(impl, python, log, args.lifetime)
    report: dict = {"impl": impl, "peers": args.num_peers, "log": log.name}
    try:
        spawn_timeout = 60.0 + 3.0 * args.num_peers
        report["spawn_s"] = swarm.spawn(args.num_peers, spawn_timeout)
        cpu_before = cpu_seconds(swarm.peers)
        report["startup_s"], per_peer = start_peers(swarm, rng, args.startup_timeout)
        report["startup_peer_cpu_s"] = cpu_seconds(swarm.peers) - cpu_before
        report["startup_max_peer_s"] = max(per_peer)
        phases = [0.0] + ([args.failure_rate] if args.failure_rate > 0 else [])
        report["phases"] = []
        for number, rate in enumerate(phases):
            alive = [p for p in swarm.peers if not p.killed]
            to_kill = round(rate * args.num_peers) - (args.num_peers - len(alive))
            for peer in rng.sample(alive, max(0, to_kill)):
                swarm.kill(peer)
            alive = [p for p in swarm.peers if not p.killed]
            if len(alive) < args.store_peers + args.get_peers:
                raise ValueError(f"{len(alive)} peers left: too few for a round")
            phase = run_phase(swarm, alive, args.seed + number, args)
            swarm.check()
            phase["failure_rate"] = rate
            phase["killed"] = args.num_peers - len(alive)
            report["phases"].append(phase)
            if number == 0:
                report.update(measure_memory(alive))
    except Exception as e:
        raise RuntimeError(f"{e} (peer log: {log.name})") from e
    finally:
        swarm.close()
        log.close()
    errors = sum(phase["errors"] for phase in report["phases"])
    if errors == 0:
        os.unlink(log.name)
        report["log"] = None
    return report


# ============================================================================ hivemind


def run_hivemind(args: argparse.Namespace) -> dict | None:
    """The same shape with hivemind's DHT in HIVEMIND_PYTHON, or None."""
    python = os.environ.get("HIVEMIND_PYTHON")
    if not python:
        return None
    command = [python, os.path.abspath(__file__), "--impl", "hivemind"]
    for name in ("num_peers", "num_tasks", "num_rounds", "store_peers", "get_peers"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--failure-rate", str(args.failure_rate), "--seed", str(args.seed)]
    command += ["--request-timeout", str(args.request_timeout)]
    print(f"running hivemind in {python} ...", file=sys.stderr, flush=True)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, start_new_session=True
    )
    try:
        stdout, _ = process.communicate(timeout=HIVEMIND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print("hivemind reference timed out", file=sys.stderr)
        return None
    finally:
        if process.returncode is None:  # not reaped yet, so the group id is still ours
            _killpg(process.pid)  # its peers (own groups) exit when their pipes close
            process.wait(timeout=10.0)
    lines = stdout.strip().splitlines()
    if process.returncode != 0 or not lines:
        print(f"hivemind reference failed (exit {process.returncode})", file=sys.stderr)
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        print(f"hivemind reference printed no JSON: {lines[-1][:200]}", file=sys.stderr)
        return None


# ============================================================================ output


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def print_table(args, ours: dict, hivemind: dict | None, documented: dict | None) -> None:
    print(
        f"DHT: {args.num_peers} peer processes on 127.0.0.1, {args.num_tasks} tasks x "
        f"{args.num_rounds} rounds, {args.store_peers} store + {args.get_peers} get peers "
        f"per round, get(latest=True)"
    )
    header = (
        f"{'impl':<10} {'killed':>7} {'store ok':>9} {'get ok':>8} {'store round':>12} "
        f"{'get round':>10} {'get mean':>9} {'get p99':>9} {'errors':>7} {'cores':>6}"
    )
    print(header)
    print("-" * len(header))
    for report in [ours, hivemind]:
        if report is None:
            continue
        for phase in report["phases"]:
            print(
                f"{report['impl']:<10} {phase['killed']:>3}/{report['peers']:<3} "
                f"{phase['store_success']:>9.1%} {phase['get_success']:>8.1%} "
                f"{_ms(phase['store_mean_s']):>12} {_ms(phase['get_mean_s']):>10} "
                f"{_ms(phase['get_latency_mean_s']):>9} {_ms(phase['get_p99_s']):>9} "
                f"{phase['errors']:>7} {phase['peer_cpu_s'] / phase['wall_s']:>6.2f}"
            )
    if documented is not None:
        d = documented
        print(
            f"{'hivemind':<10} {'10%':>7} {d['store_success']:>9.1%} {d['get_success']:>8.1%} "
            f"{_ms(d['store_mean_s']):>12} {_ms(d['get_mean_s']):>10} {'-':>9} {'-':>9} "
            f"{'-':>7}   <- {d['source']}"
        )
    print()
    print(
        f"{'impl':<10} {'launch':>8} {'start-up':>9} {'slowest':>8} {'USS/peer':>9} "
        f"{'RSS/peer':>9} {'procs':>6}"
    )
    for report in [ours, hivemind]:
        if report is None:
            continue
        print(
            f"{report['impl']:<10} {report['spawn_s']:>6.1f} s {report['startup_s']:>7.1f} s "
            f"{report['startup_max_peer_s']:>6.2f} s {report['uss_mb_per_peer']:>6.1f} MB "
            f"{report['rss_mb_per_peer']:>6.1f} MB {report['processes_per_peer']:>6}"
        )
        if report["processes_per_peer"] > 1:
            parts = ", ".join(f"{n} {mb:.1f}" for n, mb in report["uss_mb_by_process"].items())
            print(f"{'':<10} USS MB by process: {parts}")
    if documented is not None:
        print(
            f"{'hivemind':<10} {'-':>8} {documented['startup_s']:>7.1f} s {'-':>8} "
            f"~{documented['uss_mb_per_peer']:>5.0f} MB {'-':>9} {'-':>6}   <- documented"
        )
    notes = [
        "killed 0: the first rounds, which also open most connections; then the kill and the",
        "  same rounds on fresh keys among the survivors",
        f"get round: {args.get_peers} concurrent gets, wall time; get mean / p99: one "
        "get(latest=True), timed inside its peer",
        f"cores: the peers' CPU seconds per second of the phase (the box has {os.cpu_count()})",
        "launch: the interpreters importing their DHT, all together (not counted); start-up:",
        "  the DHTs joining one after another; slowest: the longest single join",
    ]
    print("\n".join(notes))
    for report in [ours, hivemind]:
        if report and report.get("log"):
            print(f"{report['impl']} peer log (errors happened): {report['log']}")
    if args.failure_rate <= 0:
        print("churn skipped; run with --failure-rate 0.1 to kill 10% of the peers")


def print_verdict(summary: dict) -> None:
    """The ratios and the issue's targets, one line each."""
    source = summary["hivemind_source"]
    line = f"get round ours / hivemind: {summary['get_ratio_vs_hivemind']:.3f} without churn"
    if "churn_get_ratio_vs_hivemind" in summary:
        killed = f"{summary['churn_failure_rate']:.0%}"
        line += f", {summary['churn_get_ratio_vs_hivemind']:.3f} with {killed} killed"
    print(f"{line}  (hivemind: {source})")

    def check(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    calm_ok = summary["store_success"] == 1.0 and summary["get_success"] == 1.0
    targets = [
        f"100% store+get without churn: {check(calm_ok)}",
        f"get round <= 0.1 x hivemind: {check(summary['get_ratio_vs_hivemind'] <= 0.1)}",
        f"USS <= 40 MB: {check(summary['uss_mb_per_peer'] <= 40)} "
        f"({summary['uss_mb_per_peer']:.0f} MB)",
    ]
    if "churn_get_success" in summary:
        churn_ok = min(summary["churn_store_success"], summary["churn_get_success"]) >= 0.99
        targets.insert(1, f">= 99% with churn: {check(churn_ok)}")
    print("targets: " + "; ".join(targets))


def summarize(args, ours: dict, hivemind: dict | None) -> dict:
    calm = ours["phases"][0]
    summary = {
        "peers": args.num_peers,
        "store_success": calm["store_success"],
        "get_success": calm["get_success"],
        "store_mean_s": round(calm["store_mean_s"], 4),
        "get_mean_s": round(calm["get_mean_s"], 4),
        "get_latency_mean_s": round(calm["get_latency_mean_s"], 4),
        "get_p99_s": round(calm["get_p99_s"], 4),
        "uss_mb_per_peer": ours["uss_mb_per_peer"],
        "rss_mb_per_peer": ours["rss_mb_per_peer"],
        "startup_s": round(ours["startup_s"], 2),
        "spawn_s": round(ours["spawn_s"], 2),
    }
    churn = ours["phases"][1] if len(ours["phases"]) > 1 else None
    if churn is not None:
        summary.update(
            churn_failure_rate=churn["failure_rate"],
            churn_killed=churn["killed"],
            churn_store_success=churn["store_success"],
            churn_get_success=churn["get_success"],
            churn_store_mean_s=round(churn["store_mean_s"], 4),
            churn_get_mean_s=round(churn["get_mean_s"], 4),
            churn_get_p99_s=round(churn["get_p99_s"], 4),
        )
    if hivemind is not None:  # measured in this run: like for like, phase by phase
        theirs = hivemind["phases"][0]
        summary.update(
            hivemind_source="measured in this run",
            hivemind_store_success=theirs["store_success"],
            hivemind_get_success=theirs["get_success"],
            hivemind_store_mean_s=round(theirs["store_mean_s"], 4),
            hivemind_get_mean_s=round(theirs["get_mean_s"], 4),
            hivemind_get_p99_s=round(theirs["get_p99_s"], 4),
            hivemind_startup_s=round(hivemind["startup_s"], 2),
            hivemind_uss_mb_per_peer=hivemind["uss_mb_per_peer"],
            hivemind_uss_mb_by_process=hivemind["uss_mb_by_process"],
            hivemind_rss_mb_per_peer=hivemind["rss_mb_per_peer"],
            get_ratio_vs_hivemind=round(calm["get_mean_s"] / theirs["get_mean_s"], 4),
        )
        if churn is not None and len(hivemind["phases"]) > 1:
            theirs = hivemind["phases"][1]
            summary.update(
                hivemind_churn_store_success=theirs["store_success"],
                hivemind_churn_get_success=theirs["get_success"],
                hivemind_churn_get_mean_s=round(theirs["get_mean_s"], 4),
                churn_get_ratio_vs_hivemind=round(churn["get_mean_s"] / theirs["get_mean_s"], 4),
            )
    else:  # the documented figures were taken at 10% failure rate
        d = HIVEMIND_DOCUMENTED
        summary.update(
            hivemind_source=d["source"],
            hivemind_get_mean_s=d["get_mean_s"],
            hivemind_store_mean_s=d["store_mean_s"],
            hivemind_startup_s=d["startup_s"],
            hivemind_uss_mb_per_peer=d["uss_mb_per_peer"],
            get_ratio_vs_hivemind=round(calm["get_mean_s"] / d["get_mean_s"], 4),
        )
        if churn is not None:
            summary["churn_get_ratio_vs_hivemind"] = round(churn["get_mean_s"] / d["get_mean_s"], 4)
    return summary


# ============================================================================ --sim


def run_sim(args: argparse.Namespace) -> None:
    """4096 DHT nodes on the simulated network (virtual clock): store, get, hops."""
    import asyncio

    from swarmgrad.dht.node import DHTNode
    from swarmgrad.net.sim import run_simulation
    from swarmgrad.net.sim.backend import create_sim_peer

    epoch = 1.8e9  # virtual DHT time starts at a plausible wall-clock value
    num_peers, num_keys = args.sim_peers, args.sim_keys

    async def main(network):
        loop = asyncio.get_running_loop()
        rng = random.Random(args.seed)
        time_fn = lambda: epoch + loop.time()  # noqa: E731 - the virtual clock
        nodes: list[DHTNode] = []
        wall = time.perf_counter()
        virtual = loop.time()

        async def start_one():
            peer = await create_sim_peer(network, rng=rng, keepalive_interval=None)
            sample = rng.sample(nodes, min(3, len(nodes)))
            initial = [str(n.peer.get_visible_maddrs()[0]) for n in sample]
            return await DHTNode.create(
                peer, initial, time_fn=time_fn, refresh_on_join=not args.sim_no_join_refresh
            )

        nodes.append(await start_one())
        batch = 50
        for first in range(1, num_peers, batch):
            count = min(batch, num_peers - first)
            nodes.extend(await asyncio.gather(*(start_one() for _ in range(count))))
            if (first - 1) // batch % 10 == 9:
                progress = f"  {len(nodes)} nodes ({time.perf_counter() - wall:.0f} s wall)"
                print(progress, file=sys.stderr, flush=True)
        build = {"wall_s": time.perf_counter() - wall, "virtual_s": loop.time() - virtual}

        now = time_fn()
        keys = [f"sim-key-{i}" for i in range(num_keys)]
        writers = [rng.choice(nodes) for _ in keys]
        started = loop.time()
        stores = [
            w.store(k, i, now + EXPIRATION_S)
            for i, (w, k) in enumerate(zip(writers, keys, strict=True))
        ]
        stored = await asyncio.gather(*stores)
        store_virtual = loop.time() - started
        for node in nodes:
            node.lookup_hops.clear()
        readers = [rng.choice([n for n in nodes if n is not w]) for w in writers]
        started = loop.time()
        found = await asyncio.gather(*(r.get(k) for r, k in zip(readers, keys, strict=True)))
        get_virtual = loop.time() - started
        hops = sorted(h for n in nodes for h in n.lookup_hops)
        got = sum(1 for i, f in enumerate(found) if f is not None and f.value == i)
        for node in nodes:
            await node.shutdown()
            await node.peer.shutdown()
        return build, sum(stored), got, hops, store_virtual, get_virtual

    wall = time.perf_counter()
    build, stored, got, hops, store_virtual, get_virtual = run_simulation(
        main, seed=args.seed, latency=0.02
    )
    wall = time.perf_counter() - wall
    target = math.log2(num_peers) / 2
    median = statistics.median(hops) if hops else None
    p90 = hops[max(0, math.ceil(0.9 * len(hops)) - 1)] if hops else None
    refresh = "off" if args.sim_no_join_refresh else "on"
    print(f"simulated network: {num_peers} DHT nodes, 20 ms links, virtual clock")
    print(f"join refresh {refresh}")
    print(f"built in {build['wall_s']:.1f} s wall ({build['virtual_s']:.1f} s virtual)")
    print(f"stores: {stored}/{num_keys} ok ({store_virtual:.2f} s virtual, all at once)")
    print(f"gets:   {got}/{num_keys} found ({get_virtual:.2f} s virtual, all at once)")
    print(
        f"hops per get lookup: median {median}, p90 {p90}, max {hops[-1] if hops else None} "
        f"over {len(hops)} lookups; target median <= log2(N)/2 = {target:.1f}"
    )
    print(f"total {wall:.1f} s wall")
    print(
        json.dumps(
            {
                "sim_peers": num_peers,
                "sim_keys": num_keys,
                "sim_store_success": stored / num_keys,
                "sim_get_success": got / num_keys,
                "sim_hops_median": median,
                "sim_hops_p90": p90,
                "sim_hops_target": target,
                "sim_build_wall_s": round(build["wall_s"], 1),
                "sim_wall_s": round(wall, 1),
            }
        )
    )


# ============================================================================ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-peers", type=int, default=64)
    parser.add_argument("--num-tasks", type=int, default=4)
    parser.add_argument("--num-rounds", type=int, default=8)
    parser.add_argument("--store-peers", type=int, default=8)
    parser.add_argument("--get-peers", type=int, default=8)
    parser.add_argument(
        "--failure-rate",
        type=float,
        default=0.1,
        help="fraction of peers SIGKILLed before the second set of rounds (0: skip it)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--startup-timeout", type=float, default=60.0)
    parser.add_argument("--lifetime", type=float, default=900.0, help="peers exit after this")
    parser.add_argument(
        "--impl",
        choices=("swarmgrad", "hivemind"),
        default="swarmgrad",
        help="hivemind: run only the reference swarm (in HIVEMIND_PYTHON) and print its JSON",
    )
    parser.add_argument("--sim", action="store_true", help="4096 nodes on the simulated network")
    parser.add_argument("--sim-peers", type=int, default=4096)
    parser.add_argument("--sim-keys", type=int, default=200)
    parser.add_argument(
        "--sim-no-join-refresh",
        action="store_true",
        help="nodes join without refreshing every bucket (DHTNode(refresh_on_join=False)): "
        "about 5x faster and 4x less memory to build, one more hop per lookup",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.sim:
        run_sim(args)
        return 0
    impl = args.impl
    try:
        report = run_swarm(args, impl, sys.executable)
    except (RuntimeError, TimeoutError, ValueError, OSError) as e:
        print(f"{impl} swarm failed: {e}", file=sys.stderr)
        print(json.dumps({"impl": impl, "peers": args.num_peers, "error": str(e)}))
        return 1
    if impl == "hivemind":
        print(json.dumps(report))
        return 0
    hivemind = run_hivemind(args)
    print_table(args, report, hivemind, None if hivemind is not None else HIVEMIND_DOCUMENTED)
    summary = summarize(args, report, hivemind)
    print_verdict(summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
