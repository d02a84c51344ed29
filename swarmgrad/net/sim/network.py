"""A simulated network in memory that speaks the asyncio transport interface.

:class:`SimNetwork` connects hosts named by plain strings. A connection is a pair of
:class:`SimTransport` objects that implement ``asyncio.Transport`` and drive ordinary
``asyncio.Protocol`` / ``asyncio.BufferedProtocol`` objects, so the protocol code that
runs over TCP (framing, multiplexing, RPC, the DHT...) runs here unmodified. Time is the
event loop's clock: on a :class:`~swarmgrad.net.sim.VirtualClockEventLoop` a simulation
of thousands of peers runs in seconds and the same seed gives the same run; on a normal
loop everything works too, in real time.

Link model
    Every directed link ``src -> dst`` has a latency (seconds), a bandwidth (bytes per
    second, ``None`` for unlimited) and a drop probability. Values come from the network
    defaults, then from per-host settings (:meth:`SimNetwork.set_host`: a setting applies
    to every link of the host, and when both ends have one the worse value wins: the
    larger latency, the smaller bandwidth, the larger drop probability), then from
    per-pair settings (:meth:`SimNetwork.set_link`), which win over both.

    Bytes leave the sender's write buffer in chunks of up to ``chunk_size`` bytes. On a
    link with a bandwidth, chunks are serialized one after another at that rate, in one
    queue per directed link that all connections on the link share round-robin; each
    chunk arrives one latency after its last byte was sent. Order within a connection is
    always preserved. Each connection has a TCP-like receive window (``receive_window``
    bytes): bytes sent but not yet consumed by the receiving protocol count against it,
    and consumed bytes free it again one reverse-link latency later. A receiver that
    pauses reading therefore stops the sender, whose write buffer then grows and calls
    ``pause_writing()``: backpressure is end to end. Even with unlimited bandwidth a
    connection moves at most ``receive_window`` bytes per round trip, as TCP does.

    ``drop_probability`` is loss on a reliable byte stream: every chunk sent has that
    probability of resetting the connection instead, when it would have arrived (both
    sides get ``connection_lost(ConnectionResetError)``). Handshake, end-of-file and
    reset signals are never lost.

Connection timing (one-way latencies ``L(a->b)``)
    ``connect(a, b, f)`` sends a SYN that reaches ``b`` after ``L(a->b)``. If ``b``
    listens, its protocol is created and gets ``connection_made`` then; the client's
    protocol is created and gets ``connection_made``, and ``connect`` returns, when the
    answer arrives, one round trip ``L(a->b) + L(b->a)`` after the call. Anything the
    server writes in ``connection_made`` arrives right after. If nothing listens on
    ``b`` (never listened, listener closed, crashed) the connect fails after the same
    round trip with :class:`~swarmgrad.utils.errors.PeerUnreachable` ("refused"). If the
    SYN cannot get through (partition) nothing answers: the connect fails with
    ``PeerUnreachable`` after ``connect_timeout`` seconds, unless the caller's own timeout
    cancels it first.

Closing
    ``close()`` stops reading at once, sends what is still buffered, then an end of
    file; the closing side gets ``connection_lost(None)`` when its buffer is empty and
    the peer gets ``eof_received()`` after the data, then (unless ``eof_received``
    returns true) closes too. ``abort()`` drops the buffer: the local protocol gets
    ``connection_lost(None)`` at once and a reset reaches the peer one latency later
    (``connection_lost(ConnectionResetError)``). Data that reaches an endpoint that has
    already closed is answered with a reset, as TCP does.

Faults
    :meth:`~SimNetwork.partition` / :meth:`~SimNetwork.heal`, :meth:`~SimNetwork.crash`
    / :meth:`~SimNetwork.restart` and :meth:`~SimNetwork.disconnect` reset the
    connections concerned at once, on both sides.

Code
    The link model is in :mod:`~swarmgrad.net.sim.links`, the transports and listeners
    in :mod:`~swarmgrad.net.sim.transport`; this module holds :class:`SimNetwork`: hosts,
    settings, connecting and the faults (re-exporting the classes users import from it).

Determinism
    All randomness comes from ``SimNetwork.random``, a ``random.Random(seed)``; nothing
    iterates over a set or depends on object addresses. With ``trace=True`` the network
    records ``(time, event)`` pairs in ``SimNetwork.trace``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
from collections.abc import Iterable
from typing import Any

from swarmgrad.net.sim.links import (
    UNSET,
    Host,
    Link,
    LinkSettings,
    Signal,
    Unset,
    check_address,
    check_bandwidth,
    check_drop_probability,
    check_latency,
)
from swarmgrad.net.sim.transport import ConnectAttempt, ProtocolFactory, SimListener, SimTransport
from swarmgrad.utils.checks import positive_int, positive_seconds
from swarmgrad.utils.errors import PeerUnreachable, ValidationError

__all__ = ["LinkSettings", "SimListener", "SimNetwork", "SimTransport"]

logger = logging.getLogger(__name__)


class SimNetwork:
    """A network of simulated hosts in memory. See the module documentation.

    ``latency`` (seconds), ``bandwidth`` (bytes per second or ``None`` for unlimited) and
    ``drop_probability`` are the defaults for every directed link. ``connect_timeout``
    is how long a connect waits for an answer that never comes (partition).
    ``receive_window`` (bytes) bounds what a connection has in flight plus unread at the
    receiver; ``chunk_size`` is the unit of transmission. ``trace=True`` records events
    in :attr:`trace`.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        latency: float = 0.05,
        bandwidth: float | None = None,
        drop_probability: float = 0.0,
        connect_timeout: float = 10.0,
        receive_window: int = 4 * 1024 * 1024,
        chunk_size: int = 64 * 1024,
        trace: bool = False,
    ) -> None:
        self.seed = seed
        self.random = random.Random(seed)
        self._latency = check_latency(latency)
        self._bandwidth = check_bandwidth(bandwidth)
        self._drop_probability = check_drop_probability(drop_probability)
        self._connect_timeout = positive_seconds("connect_timeout", connect_timeout)
        self._receive_window = positive_int("receive_window", receive_window)
        self._chunk_size = positive_int("chunk_size", chunk_size)
        self.trace: list[tuple[float, str]] | None = [] if trace else None

        self._hosts: dict[str, Host] = {}
        self._links: dict[tuple[str, str], Link] = {}
        self._pair_settings: dict[tuple[str, str], dict[str, Any]] = {}
        self._settings_version = 0
        self._partitions: list[tuple[frozenset[str], frozenset[str]]] = []
        self._transports: dict[SimTransport, None] = {}  # live ones, in creation order
        self._attempts: dict[ConnectAttempt, None] = {}
        self._next_connection_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def latency(self) -> float:
        return self._latency

    @property
    def bandwidth(self) -> float | None:
        return self._bandwidth

    @property
    def drop_probability(self) -> float:
        return self._drop_probability

    @property
    def connect_timeout(self) -> float:
        return self._connect_timeout

    @property
    def receive_window(self) -> int:
        return self._receive_window

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    # ------------------------------------------------------------------ settings

    def set_host(
        self,
        address: str,
        *,
        latency: float | Unset = UNSET,
        bandwidth: float | Unset | None = UNSET,
        drop_probability: float | Unset = UNSET,
    ) -> None:
        """Settings for every link from or to ``address`` (the worse of two hosts' values
        wins; per-pair settings win over both). Arguments not given stay as they are."""
        host = self._host(address)
        if latency is not UNSET:
            host.latency = check_latency(latency)
        if bandwidth is not UNSET:
            host.bandwidth = check_bandwidth(bandwidth)
        if drop_probability is not UNSET:
            host.drop_probability = check_drop_probability(drop_probability)
        self._settings_version += 1

    def set_link(
        self,
        a: str,
        b: str,
        *,
        latency: float | Unset = UNSET,
        bandwidth: float | Unset | None = UNSET,
        drop_probability: float | Unset = UNSET,
        symmetric: bool = True,
    ) -> None:
        """Settings for the link ``a -> b`` (and ``b -> a`` when ``symmetric``), over the
        host and network defaults. Arguments not given stay as they are. New values apply
        to chunks sent from now on."""
        changes: dict[str, Any] = {}
        if latency is not UNSET:
            changes["latency"] = check_latency(latency)
        if bandwidth is not UNSET:
            changes["bandwidth"] = check_bandwidth(bandwidth)
        if drop_probability is not UNSET:
            changes["drop_probability"] = check_drop_probability(drop_probability)
        pairs = [(check_address(a), check_address(b))]
        if symmetric and a != b:
            pairs.append((b, a))
        for pair in pairs:
            self._pair_settings.setdefault(pair, {}).update(changes)
        self._settings_version += 1

    def link_settings(self, src: str, dst: str) -> LinkSettings:
        """The settings the directed link ``src -> dst`` uses now."""
        pair = self._pair_settings.get((src, dst), {})
        ends = [self._hosts.get(src), self._hosts.get(dst)]

        def host_values(name: str, default: Any) -> list[Any]:
            values = [getattr(host, name) if host is not None else UNSET for host in ends]
            return [default if value is UNSET else value for value in values]

        if "latency" in pair:
            latency = pair["latency"]
        else:
            latency = max(host_values("latency", self._latency))
        if "bandwidth" in pair:
            bandwidth = pair["bandwidth"]
        else:
            finite = [v for v in host_values("bandwidth", self._bandwidth) if v is not None]
            bandwidth = min(finite) if finite else None
        if "drop_probability" in pair:
            drop_probability = pair["drop_probability"]
        else:
            drop_probability = max(host_values("drop_probability", self._drop_probability))
        return LinkSettings(latency, bandwidth, drop_probability)

    # ------------------------------------------------------------- connections

    def listen(self, address: str, protocol_factory: ProtocolFactory) -> SimListener:
        """Accept connections to ``address``, making a protocol for each with
        ``protocol_factory()``. Listening on a crashed host restarts it."""
        host = self._host(address)
        if host.listener is not None:
            raise OSError(errno.EADDRINUSE, f"{address!r} is already listening")
        if not host.up:
            self.restart(address)
        listener = SimListener(self, address, protocol_factory)
        host.listener = listener
        self._record("%s listens", address)
        return listener

    async def connect(
        self, src: str, dst: str, protocol_factory: ProtocolFactory
    ) -> tuple[SimTransport, asyncio.BaseProtocol]:
        """Open a connection from host ``src`` to host ``dst``; returns the client's
        ``(transport, protocol)`` one round trip later. Raises
        :class:`~swarmgrad.utils.errors.PeerUnreachable` when refused (after a round
        trip), unanswered (after ``connect_timeout``) or reset during the handshake."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        source = self._host(src)
        check_address(dst)
        if not source.up:
            raise PeerUnreachable(
                f"cannot connect from {src!r} to {dst!r}: {src!r} crashed and was not restarted"
            )
        attempt = ConnectAttempt(self, loop, src, dst, protocol_factory)
        self._attempts[attempt] = None
        link = self._link(src, dst)
        now = loop.time()
        self._record("%s->%s connect", src, dst)
        attempt.timers.append(loop.call_at(now + link.latency, self._on_syn, attempt))
        attempt.timers.append(
            loop.call_at(now + self._connect_timeout, self._on_connect_timeout, attempt)
        )
        try:
            return await attempt.future
        except BaseException:
            attempt.abandon()
            raise

    def _on_syn(self, attempt: ConnectAttempt) -> None:
        """The SYN reaches the destination host."""
        if attempt.future.done():
            return
        src, dst, loop = attempt.src, attempt.dst, attempt.loop
        if self._blocked(src, dst):
            self._record("%s->%s syn lost (partition)", src, dst)
            return  # nobody answers: the connect timeout will fire
        back = self._link(dst, src)
        answer_at = loop.time() + back.latency
        host = self._hosts.get(dst)
        listener = host.listener if host is not None and host.up else None
        protocol: asyncio.BaseProtocol | None = None
        if listener is not None:
            try:
                protocol = listener.protocol_factory()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                loop.call_exception_handler(
                    {"message": f"protocol factory of listener {dst!r} failed", "exception": exc}
                )
        if protocol is None:
            error = PeerUnreachable(
                f"connection from {src!r} to {dst!r} refused: nothing listens on {dst!r}"
            )
            attempt.timers.append(loop.call_at(answer_at, attempt.fail, error, "refused"))
            return
        connection_id = self._next_connection_id
        self._next_connection_id += 1
        server = SimTransport(self, loop, connection_id, dst, src, back)
        client = SimTransport(self, loop, connection_id, src, dst, self._link(src, dst))
        server._peer, client._peer = client, server
        client._attempt, attempt.client = attempt, client
        for transport in (client, server):
            self._transports[transport] = None
            self._hosts[transport._local].transports[transport] = None
        self._record("#%s %s->%s accepted", connection_id, src, dst)
        server._send_item(Signal.SYN_ACK, answer_at)  # before anything the server writes
        server._make(protocol)

    def _on_connect_timeout(self, attempt: ConnectAttempt) -> None:
        error = PeerUnreachable(
            f"connection from {attempt.src!r} to {attempt.dst!r} timed out: no answer in "
            f"{self._connect_timeout} s"
        )
        attempt.fail(error, "timed out")

    # ------------------------------------------------------------------- faults

    def partition(self, group_a: Iterable[str], group_b: Iterable[str]) -> None:
        """Cut every link between a host of ``group_a`` and a host of ``group_b``, both
        ways: connections across are reset, new ones time out, until :meth:`heal`."""
        if isinstance(group_a, str) or isinstance(group_b, str):
            raise ValidationError("partition() takes two collections of addresses, not strs")
        a, b = frozenset(group_a), frozenset(group_b)
        if a & b:
            raise ValidationError(f"a host cannot be on both sides of a partition: {sorted(a & b)}")
        self._partitions.append((a, b))
        self._record("partition %s | %s", sorted(a), sorted(b))
        for transport in list(self._transports):
            local, remote = transport._local, transport._remote
            if not transport._lost and (
                (local in a and remote in b) or (local in b and remote in a)
            ):
                self._reset_connection(transport, "a network partition cut it")

    def heal(self) -> None:
        """Remove every partition; existing connections stay reset."""
        self._partitions.clear()
        self._record("heal")

    def disconnect(self, a: str, b: str) -> None:
        """Reset every connection between ``a`` and ``b`` now; new ones may be opened."""
        self._record("disconnect %s %s", a, b)
        for transport in list(self._transports):
            if not transport._lost and {transport._local, transport._remote} == {a, b}:
                self._reset_connection(transport, "simulated disconnect")

    def crash(self, address: str) -> None:
        """The host dies: its listener disappears, every connection of it is reset (both
        sides get ``connection_lost(ConnectionResetError)``), its pending connects fail,
        and it can neither connect nor be reached until it listens again or
        :meth:`restart` is called."""
        host = self._host(address)
        self._record("crash %s", address)
        host.up = False
        if host.listener is not None:
            host.listener.close()
        for transport in list(host.transports):
            self._reset_connection(transport, f"{address!r} crashed")
        for attempt in list(self._attempts):  # connects whose SYN is still on its way
            if attempt.src == address:
                attempt.fail(
                    PeerUnreachable(f"{address!r} crashed while connecting to {attempt.dst!r}")
                )

    def restart(self, address: str) -> None:
        """Bring a crashed host back (without a listener; see :meth:`listen`)."""
        host = self._host(address)
        if not host.up:
            host.up = True
            self._record("restart %s", address)

    def close(self) -> None:
        """Tear everything down: listeners close, pending connects fail, open connections
        end with ``connection_lost(ConnectionAbortedError)``."""
        for host in self._hosts.values():
            if host.listener is not None:
                host.listener.close()
        for attempt in list(self._attempts):
            attempt.fail(PeerUnreachable("the simulated network was closed"))
        for transport in list(self._transports):
            transport._force_close(
                ConnectionAbortedError(errno.ECONNABORTED, "the simulated network was closed"),
                reset_peer=False,
            )

    # ------------------------------------------------------------- inspection

    def is_up(self, address: str) -> bool:
        """False while the host is crashed."""
        host = self._hosts.get(address)
        return host is None or host.up

    def transports(self, address: str | None = None) -> list[SimTransport]:
        """Open transports (of one host, or all), in creation order."""
        if address is None:
            return list(self._transports)
        host = self._hosts.get(address)
        return list(host.transports) if host is not None else []

    # ---------------------------------------------------------------- internals

    def _host(self, address: str) -> Host:
        host = self._hosts.get(address)
        if host is None:
            host = self._hosts[check_address(address)] = Host(address)
        return host

    def _link(self, src: str, dst: str) -> Link:
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[src, dst] = Link(self, src, dst)
        else:
            link.refresh()
        return link

    def _blocked(self, a: str, b: str) -> bool:
        for group_a, group_b in self._partitions:
            if (a in group_a and b in group_b) or (a in group_b and b in group_a):
                return True
        return False

    def _reset_connection(self, transport: SimTransport, reason: str) -> None:
        self._record("#%s %s<->%s %s", transport._id, transport._local, transport._remote, reason)
        for end in (transport, transport._peer):
            end._force_close(end._reset_error(reason), reset_peer=False)

    def _forget(self, transport: SimTransport) -> None:
        self._transports.pop(transport, None)
        host = self._hosts.get(transport._local)
        if host is not None:
            host.transports.pop(transport, None)

    def _record(self, event: str, *args: Any) -> None:
        """Append ``(time, event % args)`` to the trace; formats nothing when off."""
        if self.trace is None:
            return
        loop = self._loop
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        self.trace.append((loop.time() if loop is not None else 0.0, event % args))
