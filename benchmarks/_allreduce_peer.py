"""Worker processes of the all-reduce benchmarks (one peer per process).

Each worker runs one swarmgrad :class:`~swarmgrad.net.peer.Peer` on the process loop and
talks to the parent over a ``multiprocessing`` pipe. The group is fixed: members learn
each other's addresses at start-up and every round builds its :class:`GroupInfo`
directly, so matchmaking is not part of what is measured.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any


def _setup_process() -> None:
    import torch

    torch.set_num_threads(1)


def _group(round_tag: str, peer_ids: list[Any]):
    from swarmgrad.averaging.group_info import GroupInfo

    group_id = hashlib.sha256(round_tag.encode()).digest()[:16]
    return GroupInfo(group_id, tuple(peer_ids), tuple(b"" for _ in peer_ids))


def _start_peer(conn, host: str = "127.0.0.1") -> tuple[Any, list[Any]]:
    """Create our peer, publish its address, learn everyone's; returns (peer, peer_ids)."""
    from swarmgrad.averaging.allreduce import AllReduceRouter
    from swarmgrad.net.multiaddr import Multiaddr
    from swarmgrad.net.peer import Peer
    from swarmgrad.utils.loop_thread import run_coroutine

    async def create() -> Peer:
        peer = await Peer.create(host_maddrs=[f"/ip4/{host}/tcp/0"])
        AllReduceRouter.for_peer(peer)  # serve all-reduce streams from the start
        return peer

    peer = run_coroutine(create())
    conn.send(str(peer.get_visible_maddrs()[0]))
    maddrs = [Multiaddr.parse(m) for m in conn.recv()]

    async def learn() -> None:
        for maddr in maddrs:
            if maddr.peer_id != peer.peer_id:
                peer.add_addresses(maddr.peer_id, [maddr])

    run_coroutine(learn())
    return peer, [m.peer_id for m in maddrs]


def perf_worker(rank: int, world: int, conn, gloo_port: int, options: dict[str, Any]) -> None:
    """Alternate gloo all_reduce and our all-reduce rounds on the same tensor size."""
    _setup_process()
    import torch
    import torch.distributed as dist

    from swarmgrad.averaging.allreduce import AllReduceRunner
    from swarmgrad.utils.loop_thread import run_coroutine, shutdown_loop

    try:
        peer, peer_ids = _start_peer(conn)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{gloo_port}",
            rank=rank,
            world_size=world,
        )
        numel = options["numel"]
        cpu_times: dict[str, list[float]] = {"ours": [], "gloo": []}
        original = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        tensor = original.clone()

        def ours(tag: str) -> float:
            runner = AllReduceRunner(
                peer,
                _group(tag, peer_ids),
                [tensor],
                part_size_bytes=options["part_size_bytes"],
                timeout=120.0,
                compression=options.get("compression", "none"),
            )
            started, cpu = time.perf_counter(), time.process_time()
            result = run_coroutine(runner.run())
            elapsed = time.perf_counter() - started
            cpu_times["ours"].append(time.process_time() - cpu)
            if not result.fully_averaged:
                raise RuntimeError(f"rank {rank}: round {tag} was not fully averaged: {result}")
            return elapsed

        def gloo() -> float:
            started, cpu = time.perf_counter(), time.process_time()
            dist.all_reduce(tensor)
            cpu_times["gloo"].append(time.process_time() - cpu)
            return time.perf_counter() - started

        # correctness: ours must equal gloo's sum / world
        dist.barrier()
        gloo()
        expected = tensor / world
        tensor.copy_(original)
        dist.barrier()
        ours("check")
        max_error = float((tensor - expected).abs().max())

        times: dict[str, list[float]] = {"ours": [], "gloo": []}
        for index in range(options["warmup"] + options["rounds"]):
            tensor.copy_(original)
            dist.barrier()
            gloo_time = 0.0 if options.get("no_gloo") else gloo()
            tensor.copy_(original)
            dist.barrier()
            ours_time = ours(f"round-{index}")
            if index >= options["warmup"]:
                times["gloo"].append(gloo_time)
                times["ours"].append(ours_time)
        dist.barrier()
        skip = 1 + options["warmup"]  # the check round and the warm-up rounds
        cpu = {name: values[skip:] for name, values in cpu_times.items()}
        conn.send({"rank": rank, "times": times, "cpu": cpu, "max_error": max_error})
        dist.destroy_process_group()
        run_coroutine(peer.shutdown())
    except BaseException as e:
        conn.send({"rank": rank, "error": repr(e)})
        raise
    finally:
        shutdown_loop()
        conn.close()


def fault_worker(rank: int, conn, options: dict[str, Any]) -> None:
    """Run the rounds the parent orders; report time and whether the values are right.

    Member ``i`` of a round holds ``pattern + values[i]`` (``pattern`` is the same random
    vector everywhere), so the average over any set of members S is ``pattern + mean``
    of their values: a survivor checks that each element is one of the averages the
    parent allows (over everyone, over the survivors) or its own value (the span of an
    owner that died). Orders: ``{"round": ...}``, ``{"add": maddr}``, or None to stop.
    """
    _setup_process()
    import logging

    import torch

    from swarmgrad.averaging.allreduce import AllReduceRunner
    from swarmgrad.net.multiaddr import Multiaddr

    # each survivor logs a warning per lost span/sender; the parent prints the verdict
    logging.getLogger("swarmgrad").setLevel(logging.ERROR)
    from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
    from swarmgrad.utils.loop_thread import run_coroutine, shutdown_loop

    timeouts = AdaptiveTimeouts(min_timeout=options.get("min_timeout", 5.0))
    try:
        peer, _ = _start_peer(conn, options.get("host", "127.0.0.1"))
        pattern = torch.randn(options["numel"], generator=torch.Generator().manual_seed(0))
        tensor = torch.empty_like(pattern)
        while True:
            order = conn.recv()
            if order is None:
                break
            if "add" in order:
                maddr = Multiaddr.parse(order["add"])

                async def learn(maddr=maddr) -> None:
                    peer.add_addresses(maddr.peer_id, [maddr])

                run_coroutine(learn())
                continue
            from swarmgrad.net.identity import PeerID

            peer_ids = [PeerID.from_base58(m) for m in order["members"]]
            own = order["values"][peer_ids.index(peer.peer_id)]
            torch.add(pattern, own, out=tensor)
            runner = AllReduceRunner(
                peer,
                _group(order["tag"], peer_ids),
                [tensor],
                part_size_bytes=options["part_size_bytes"],
                timeout=options["deadline"],
                timeouts=timeouts,
            )
            time.sleep(max(0.0, order["start_at"] - time.time()))
            started = time.perf_counter()
            result = run_coroutine(runner.run())
            elapsed = time.perf_counter() - started
            diff = tensor - pattern
            matches = [(diff - float(v)).abs() <= 1e-4 for v in order["allowed"]]
            full = bool(matches[0].all())
            ok = matches[0]
            for match in [*matches[1:], (diff - float(own)).abs() <= 1e-4]:
                ok |= match
            conn.send(
                {
                    "rank": rank,
                    "elapsed": elapsed,
                    "correct": bool(ok.all()),
                    "full_average": full,
                    "fully_averaged": result.fully_averaged,
                    "deadline_exceeded": result.deadline_exceeded,
                    "local_spans": len(result.local_spans),
                    "excluded": [str(p) for p in result.excluded_senders],
                    "failed_reducers": [str(p) for p in result.failed_reducers],
                    "parts": _classify_parts(runner.container, diff, order["allowed"], own),
                }
            )
        run_coroutine(peer.shutdown())
    except BaseException as e:
        conn.send({"rank": rank, "error": repr(e)})
        raise
    finally:
        shutdown_loop()
        conn.close()


class LineConn:
    """A pipe-like connection over this process's stdin and stdout, one JSON object per
    line (stdout lines that are not ours start with anything but ``@``). For workers
    started with ``ip netns exec``, where multiprocessing's pipes are not at hand."""

    def send(self, obj: Any) -> None:
        import json
        import sys

        sys.stdout.write("@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    def recv(self) -> Any:
        import json
        import sys

        line = sys.stdin.readline()
        if not line:
            raise EOFError("the parent closed our stdin")
        return json.loads(line)

    def close(self) -> None:
        pass


def links_worker(rank: int, world: int, conn, options: dict[str, Any]) -> None:
    """One peer of ``allreduce_links.py``: runs the rounds the parent orders.

    Orders: ``{"op": "gloo"}`` (``all_reduce``, gloo backend), ``{"op": "ours", "tag":
    ..., "codec": ..., "fractions": [...] or None}``, ``{"op": "stop"}``; each starts
    from a gloo barrier and answers with the elapsed time, this process's CPU time, and
    the largest difference to the average over the same rounds of the others (gloo's,
    taken in the first gloo round). ``options``: ``host`` (the address to listen on),
    ``master`` (rank 0's address for gloo), ``port``, ``numel``.
    """
    _setup_process()
    import torch
    import torch.distributed as dist

    from swarmgrad.averaging.allreduce import AllReduceRunner
    from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
    from swarmgrad.compression import (
        Float16Compression,
        NoCompression,
        Uniform8BitQuantization,
    )
    from swarmgrad.utils.loop_thread import run_coroutine, shutdown_loop

    codecs = {
        "none": NoCompression,
        "float16": Float16Compression,
        "uniform_8bit": Uniform8BitQuantization,
    }
    try:
        peer, peer_ids = _start_peer(conn, options["host"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{options['master']}:{options['port']}",
            rank=rank,
            world_size=world,
        )
        original = torch.randn(options["numel"], generator=torch.Generator().manual_seed(rank))
        tensor = original.clone()
        expected = None
        # connections up (ours and gloo's) before anything is timed
        run_coroutine(AllReduceRunner(peer, _group("warm-up", peer_ids), [torch.ones(1024)]).run())
        dist.all_reduce(torch.ones(1024))
        while True:
            order = conn.recv()
            if order["op"] == "stop":
                break
            tensor.copy_(original)
            dist.barrier()
            started, cpu = time.perf_counter(), time.process_time()
            report: dict[str, Any] = {"rank": rank}
            if order["op"] == "gloo":
                dist.all_reduce(tensor)
                tensor /= world
            else:
                runner = AllReduceRunner(
                    peer,
                    _group(order["tag"], peer_ids),
                    [tensor],
                    peer_fractions=order.get("fractions"),
                    part_size_bytes=options.get("part_size_bytes", 2 * 1024 * 1024),
                    timeouts=AdaptiveTimeouts(min_timeout=order.get("min_timeout", 5.0)),
                    compression=codecs[order["codec"]](),
                    timeout=options.get("timeout", 300.0),
                )
                result = run_coroutine(runner.run())
                report["fully_averaged"] = result.fully_averaged
                report["excluded"] = len(result.excluded_senders) + len(result.failed_reducers)
            report["elapsed"] = time.perf_counter() - started
            report["cpu"] = time.process_time() - cpu
            dist.barrier()  # the check below must not take CPU from members still averaging
            if expected is None and order["op"] == "gloo":
                expected = tensor.clone()
            if expected is not None:
                report["max_error"] = float((tensor - expected).abs().max())
            conn.send(report)
        dist.destroy_process_group()
        run_coroutine(peer.shutdown())
    except BaseException as e:
        conn.send({"rank": rank, "error": repr(e)})
        raise
    finally:
        shutdown_loop()


def _classify_parts(container, diff, allowed: list[float], own: float) -> list[list[str]]:
    """Per span, per part: which value the whole part holds ("all" for ``allowed[0]``,
    "allowed1"... for the others, "own"), or "mixed" when its elements disagree (a part
    that is partly averaged: what must never happen)."""
    import torch

    candidates = [("all", allowed[0])]
    candidates += [(f"allowed{i}", v) for i, v in enumerate(allowed[1:], 1)] + [("own", own)]
    spans = []
    for span in container.parts:
        kinds = []
        for spec in span:
            # one tensor here, so piece offsets are offsets into ``diff``
            part = torch.cat([diff[p.start : p.start + p.length] for p in spec.pieces])
            kind = "mixed"
            for name, value in candidates:
                if bool(((part - float(value)).abs() <= 1e-4).all()):
                    kind = name
                    break
            kinds.append(kind)
        spans.append(kinds)
    return spans


def peer_id_string(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[1]


__all__ = ["LineConn", "fault_worker", "links_worker", "peer_id_string", "perf_worker"]

if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "links":
        config = json.loads(sys.argv[2])
        links_worker(config["rank"], config["world"], LineConn(), config)
    elif len(sys.argv) == 3 and sys.argv[1] == "fault":
        config = json.loads(sys.argv[2])
        fault_worker(config["rank"], LineConn(), config)
    else:
        raise SystemExit(f"{os.path.basename(__file__)} is imported by the all-reduce benchmarks")
