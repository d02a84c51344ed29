"""State download benchmark: a joining peer downloads a state from donor processes.

Each donor is its own process (this script with ``--donor``) on loopback with real
sockets: it joins the benchmark's DHT, holds the same seeded state (``--megabytes`` of
float32, default 128, in 16 tensors) and shares it with :class:`StateSharing`. The main
process downloads it with ``load_state_from_peers`` from 1 and then from all donors
(``--donors``, default 3), verifying every chunk. Reference, in the same run: one plain
RPC that returns the same bytes as a single zero-copy blob from one donor (no snapshot,
no hashing, no chunking): the transport's own cost. Every figure is the median of
``--repeats`` runs (default 3); the first download from a donor also pays for its
snapshot (copy + SHA-256 of the state), later ones reuse it within its reuse period, so
the first run is reported apart.

On a 2-core machine the donors and the downloader share the cores, so more donors cannot
mean more CPU; the multi-donor figure shows the overhead of splitting a download, not the
speed-up over slow uplinks it exists for.

``--state-compression NAME`` (a codec name such as ``float16``; default ``none``) makes
the donors share the state encoded with that codec; the downloaded values are then
checked against the codec's own round trip, and the raw RPC still sends the exact state.
The bytes on the wire (the manifest's size, and the chunk bytes the downloader received)
are printed with the decoded size.

Output: a table, then one JSON line:
``{"state_compression": ..., "transferred_bytes": ..., "decoded_bytes": ...,
"results": [{"donors": 1, "ours_s": ..., "raw_rpc_s": ..., "ratio": ...}, ...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from swarmgrad.averaging.state.transfer import StateDownloader, StateSharing
from swarmgrad.compression import deserialize_torch_tensor, get_codec, serialize_torch_tensor
from swarmgrad.dht import DHT
from swarmgrad.net.rpc import Blob
from swarmgrad.utils.loop_thread import run_coroutine

PREFIX = "bench"
RAW = "bench.raw_state"


def make_state(megabytes: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    per_tensor = megabytes * 1024 * 1024 // 4 // 16
    return [torch.randn(per_tensor, generator=generator) for _ in range(16)]


def run_donor(args: argparse.Namespace) -> None:
    tensors = make_state(args.megabytes)
    flat = torch.cat(tensors)
    dht = DHT(initial_peers=[args.initial_peer], start=True)

    async def raw(request, context):
        return {"state": Blob(flat.numpy().view("uint8"))}

    async def setup(_dht, node):
        sharing = StateSharing(
            node.peer,
            node,
            prefix=PREFIX,
            get_state=lambda: ({"step": 1}, tensors),
            priority=1,
            chunk_size_bytes=int(args.chunk_mib * 1024 * 1024),
            state_compression=args.state_compression,
        )
        sharing.start()
        node.peer.add_handler(RAW, raw)
        return sharing

    dht.run_coroutine(setup)
    print("READY", dht.peer_id.to_base58(), flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=128)
    parser.add_argument("--donors", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="donors' chunk size")
    parser.add_argument("--in-flight", type=int, default=3, help="chunks in flight per donor")
    parser.add_argument(
        "--state-compression",
        default="none",
        help="codec the donors apply to the state (none, float16, bfloat16, uniform_8bit, ...)",
    )
    parser.add_argument("--donor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.donor:
        return run_donor(args)

    dht = DHT(start=True)
    address = str(dht.get_visible_maddrs()[0])
    donors = [
        subprocess.Popen(
            [sys.executable, __file__, "--donor", "--initial-peer", address,
             "--megabytes", str(args.megabytes), "--chunk-mib", str(args.chunk_mib),
             "--state-compression", args.state_compression],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for _ in range(args.donors)
    ]  # fmt: skip
    try:
        donor_ids = []
        for proc in donors:
            line = proc.stdout.readline()
            if not line.startswith("READY"):
                raise SystemExit(f"a donor failed to start: {line!r}")
            donor_ids.append(line.split()[1])
        codec = get_codec(args.state_compression)  # an unknown name fails here, clearly
        expected = [
            deserialize_torch_tensor(serialize_torch_tensor(t, codec))
            for t in make_state(args.megabytes)
        ]
        time.sleep(1.0)  # let the declarations settle
        transfer = {}

        def download(max_donors: int) -> float:
            async def go(_dht, node):
                downloader = StateDownloader(
                    node.peer,
                    node,
                    prefix=PREFIX,
                    max_donors=max_donors,
                    chunks_in_flight_per_donor=args.in_flight,
                )
                started = time.perf_counter()
                result = await downloader.run(timeout=300)
                elapsed = time.perf_counter() - started
                assert result is not None, "the download failed"
                assert all(torch.equal(a, b) for a, b in zip(result[1], expected, strict=True))
                transfer.update(
                    transferred_bytes=downloader.manifest.total_bytes,
                    received_bytes=downloader.bytes_received,
                    decoded_bytes=downloader.manifest.decoded_bytes,
                )
                return elapsed, len(downloader.chunks_from)

            elapsed, used = dht.run_coroutine(go)
            assert 1 <= used <= max_donors, f"chunks came from {used} donors, max {max_donors}"
            return elapsed

        def raw_rpc() -> float:
            from swarmgrad.net.identity import PeerID

            async def go(_dht, node):
                started = time.perf_counter()
                answer = await node.peer.call(
                    PeerID.from_base58(donor_ids[0]), RAW, None, timeout=300
                )
                elapsed = time.perf_counter() - started
                assert len(answer["state"]) == args.megabytes * 1024 * 1024
                return elapsed

            return dht.run_coroutine(go)

        first = download(1)
        rows = []
        for count in sorted({1, args.donors}):
            # alternate the two, so that a change in the machine's load hits both alike
            pairs = [(download(count), raw_rpc()) for _ in range(args.repeats)]
            ours = statistics.median(p[0] for p in pairs)
            raw = statistics.median(p[1] for p in pairs)
            rows.append(
                {"donors": count, "ours_s": round(ours, 3), "raw_rpc_s": round(raw, 3),
                 "ratio": round(ours / raw, 2)}
            )  # fmt: skip
        print(
            f"state: {args.megabytes} MB in 16 float32 tensors, chunks of {args.chunk_mib} MiB, "
            f"{args.in_flight} in flight per donor, loopback, "
            f"state_compression={args.state_compression}"
        )
        print(
            f"bytes on the wire: {transfer['transferred_bytes']} (last download received "
            f"{transfer['received_bytes']} chunk bytes), decoded: {transfer['decoded_bytes']}"
        )
        print(f"first download (donor takes its snapshot): {first:.3f} s")
        print(f"{'donors':>6} {'ours (s)':>9} {'raw RPC (s)':>12} {'ratio':>6}")
        for row in rows:
            ours, raw, ratio = row["ours_s"], row["raw_rpc_s"], row["ratio"]
            print(f"{row['donors']:>6} {ours:>9.3f} {raw:>12.3f} {ratio:>6.2f}")
        summary = {"state_compression": args.state_compression, **transfer}
        print(json.dumps({**summary, "first_download_s": round(first, 3), "results": rows}))
    finally:
        for proc in donors:
            if proc.stdin:
                proc.stdin.close()
        for proc in donors:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        dht.shutdown()
        run_coroutine(asyncio.sleep(0))


if __name__ == "__main__":
    main()
