"""One DHT peer of ``benchmarks/dht.py``, run as its own process.

Usage (by the benchmark, never by hand)::

    python benchmarks/_dht_peer.py --fd FD --impl swarmgrad|hivemind [--lifetime S]

FD is this process's end of a ``multiprocessing.Pipe`` inherited from the coordinator.
The peer imports only the DHT library it runs (``swarmgrad.dht``, which does not import
torch, or ``hivemind``), says hello, then serves commands, each a tuple
``(op, request_id, *args)`` answered by ``(request_id, ok, result)``:

* ``("start", id, initial_peers)``: start the DHT on 127.0.0.1 from those multiaddrs;
  result ``(visible_maddrs, peer_id, seconds)``;
* ``("store", id, key, subkey, value, expiration_s)``: store until now + expiration_s;
  result ``(stored, seconds)``;
* ``("get", id, key)``: ``get(key, latest=True)``; result ``({subkey: value} | None,
  seconds)``; latencies are measured here, free of the pipe's own delay;
* ``("shutdown", id)``: leave the swarm and exit.

Stores and gets run concurrently (the DHTs' ``return_future=True``): a peer that two
benchmark tasks pick at once serves both, as a shared ``DHT`` object would. The peer
exits when the pipe closes (the coordinator died) or after ``--lifetime`` seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

HOST_MADDRS = ["/ip4/127.0.0.1/tcp/0"]


def _load(impl: str):
    """(DHT class, get_dht_time) of the implementation, importing nothing else."""
    if impl == "swarmgrad":
        from swarmgrad.dht import DHT
        from swarmgrad.utils.timeutils import get_dht_time
    elif impl == "hivemind":
        from hivemind import DHT
        from hivemind.utils.timed_storage import get_dht_time
    else:
        raise SystemExit(f"unknown --impl {impl!r}")
    return DHT, get_dht_time


def _plain(result) -> dict | None:
    """{subkey: value} of a dictionary record (None if absent or not a dictionary)."""
    if result is None or not isinstance(result.value, dict):
        return None
    return {str(subkey): item.value for subkey, item in result.value.items()}


class _Server:
    def __init__(self, conn: Connection, impl: str):
        self.conn = conn
        self.dht_class, self.get_dht_time = _load(impl)
        self.dht = None
        self.send_lock = threading.Lock()
        # hivemind's MPFuture drops a result whose future nobody references any more
        self.in_flight: set = set()

    def reply(self, request_id: int, ok: bool, result) -> None:
        with self.send_lock:
            try:
                self.conn.send((request_id, ok, result))
            except (OSError, EOFError):
                pass  # the coordinator is gone; the main loop sees EOF and exits

    def start(self, request_id: int, initial_peers: list[str]) -> None:
        started = time.perf_counter()
        try:
            self.dht = self.dht_class(
                initial_peers=initial_peers, start=True, host_maddrs=HOST_MADDRS
            )
        except Exception as e:
            self.reply(request_id, False, f"{type(e).__name__}: {e}")
            return
        maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        self.reply(request_id, True, (maddrs, str(self.dht.peer_id), time.perf_counter() - started))

    def submit(self, request_id: int, op: str, args: tuple) -> None:
        """Start a store or get on the DHT; the reply is sent when it completes."""
        started = time.perf_counter()
        try:
            if op == "store":
                key, subkey, value, expiration_s = args
                future = self.dht.store(
                    key,
                    value,
                    self.get_dht_time() + expiration_s,
                    subkey=subkey,
                    return_future=True,
                )
                convert = bool
            else:
                (key,) = args
                future = self.dht.get(key, latest=True, return_future=True)
                convert = _plain
        except Exception as e:
            self.reply(request_id, False, f"{type(e).__name__}: {e}")
            return

        def done(f) -> None:
            seconds = time.perf_counter() - started
            self.in_flight.discard(f)
            try:
                result = convert(f.result())
            except BaseException as e:  # reported to the coordinator, whatever it is
                self.reply(request_id, False, f"{type(e).__name__}: {e}")
                return
            self.reply(request_id, True, (result, seconds))

        self.in_flight.add(future)
        future.add_done_callback(done)

    def serve(self, lifetime: float) -> None:
        deadline = time.monotonic() + lifetime
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0 or not self.conn.poll(remaining):
                    return
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            op, request_id, *args = message
            if op == "start":
                self.start(request_id, *args)
            elif op in ("store", "get"):
                if self.dht is None:
                    self.reply(request_id, False, "the DHT is not started")
                else:
                    self.submit(request_id, op, tuple(args))
            elif op == "shutdown":
                self.close()
                self.reply(request_id, True, None)
                return
            else:
                self.reply(request_id, False, f"unknown command {op!r}")

    def close(self) -> None:
        dht, self.dht = self.dht, None
        if dht is not None:
            try:
                dht.shutdown()
            except Exception as e:
                print(f"peer {os.getpid()}: shutdown failed: {e!r}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--impl", choices=("swarmgrad", "hivemind"), required=True)
    parser.add_argument("--lifetime", type=float, default=900.0)
    args = parser.parse_args()
    conn = Connection(args.fd)
    started = time.perf_counter()
    server = _Server(conn, args.impl)
    try:
        conn.send(("hello", os.getpid(), time.perf_counter() - started))
        server.serve(args.lifetime)
    finally:
        server.close()
        conn.close()


if __name__ == "__main__":
    main()
