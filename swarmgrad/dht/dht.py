"""The ``DHT`` facade: hivemind's user-facing DHT, for synchronous code.

``DHT`` starts this process's peer and a :class:`~swarmgrad.dht.node.DHTNode` on it, on the
process's background event loop (:mod:`swarmgrad.utils.loop_thread`), and offers blocking
or future-returning ``get``/``store``. Unlike hivemind it forks no process and runs no
sidecar daemon: the expert server, averagers and optimizer of the same process reuse
``dht.peer`` and ``dht.node`` directly.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from swarmgrad.dht.node import DHTNode
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.dht.validation import RecordValidatorBase
from swarmgrad.net.libp2p_options import check_known, take_libp2p_options
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import DeadlineExceeded, PeerUnreachable, ValidationError
from swarmgrad.utils.loop_thread import run_coroutine, run_coroutine_future

logger = logging.getLogger(__name__)

_PEER_OPTIONS = {
    "max_message_size",
    "max_concurrent_calls_per_peer",
    "handshake_timeout",
    "dial_timeout",
    "keepalive_interval",
    "idle_timeout",
    "allow_relay",
    "authority",
    "access_token",
    "identity",
}


def _node_options() -> set[str]:
    """The keywords DHTNode (and its create) take, which DHT passes on."""
    params = inspect.signature(DHTNode.__init__).parameters
    names = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    return (names | {"bootstrap_timeout"}) - {"client_mode", "record_validator"}


# hivemind's DHTNode.create keywords that DHT(...) forwards: mapped, accepted or refused
_NODE_IGNORED = {
    "num_workers": "lookups run as coroutines on one event loop; there is no worker pool",
    "chunk_size": "keys of a bulk request are not chunked",
    "strict": "malformed answers from other peers are always dropped and logged",
    "node_id": "a node's DHT id derives from its PeerID (identity_path fixes both)",
    "ensure_bootstrap_success": "joining fails with PeerUnreachable when no initial peer answers",
}


def _take_hivemind_node_options(kwargs: dict[str, Any]) -> None:
    for name in ("parallel_rpc", "bootstrap_timeout", "cache_size"):
        if name in kwargs and kwargs[name] is None:  # hivemind's None: the default
            del kwargs[name]
    if "refresh_timeout" in kwargs:
        value = kwargs.pop("refresh_timeout")
        if value is not None:
            kwargs.setdefault("refresh_period", value)  # the same knob, named differently
    if kwargs.get("authorizer") is not None:
        raise ValidationError(
            "DHT(authorizer=...) is hivemind's token check, which swarmgrad does not run; "
            "an admission-controlled swarm takes authority= and access_token= "
            "(docs/security.md)"
        )
    kwargs.pop("authorizer", None)
    for name, reason in _NODE_IGNORED.items():
        if name in kwargs:
            logger.debug("DHT: %s=%r is not used: %s", name, kwargs.pop(name), reason)


def _peer_of(p2p: Any) -> Peer:
    """The swarmgrad peer under ``p2p=``: a Peer, or a ``swarmgrad.p2p.P2P`` around one."""
    if isinstance(p2p, Peer):
        return p2p
    peer = getattr(p2p, "peer", None)
    if isinstance(peer, Peer):
        return peer
    raise TypeError(f"p2p must be a swarmgrad Peer or P2P, got {type(p2p).__name__}")


class DHT:
    """A peer of the swarm's DHT.

    ``DHT(initial_peers=[...], start=True)`` joins the swarm through any of the initial
    peers' multiaddrs (an error names them all if none answers). ``client_mode=True`` opens
    no listener and stores nothing for others; such a peer stays reachable through its
    initial peers acting as relays. Other keyword arguments go to
    :class:`~swarmgrad.dht.node.DHTNode` (bucket_size, num_replicas, wait_timeout,
    cache_size, ...) or to the peer (max_message_size, dial_timeout, allow_relay, ...).

    hivemind's keywords are accepted too: ``p2p=`` (a peer to run on, kept open at
    shutdown), and every keyword hivemind forwards to libp2p or to its ``DHTNode``:
    honoured where swarmgrad has the meaning, otherwise accepted with one warning per
    keyword and process (:mod:`swarmgrad.net.libp2p_options`, ``docs/hivemind.md``); an
    unknown keyword is a ``TypeError`` naming it.

    ``authority=`` (the authority's public key ``12D3KooW...``, a file holding it, or an
    :class:`~swarmgrad.net.admission.Admission`) makes this a peer of an admission-
    controlled swarm; ``access_token=`` is its token (a file re-read to renew, a callable,
    or a token). See ``docs/security.md``.
    """

    def __init__(
        self,
        initial_peers: Sequence[str | Multiaddr] | None = None,
        *,
        start: bool = False,
        p2p: Any = None,
        client_mode: bool = False,
        host_maddrs: Iterable[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Iterable[str] | None = None,
        identity_path: str | None = None,
        record_validators: Iterable[RecordValidatorBase] = (),
        use_relay: bool = True,
        startup_timeout: float = 60.0,
        shutdown_timeout: float = 3,
        daemon: bool = True,  # accepted for hivemind compatibility; nothing is forked
        num_workers: int = 4,  # accepted for hivemind compatibility
        await_ready: bool = True,
        **kwargs: Any,
    ):
        kwargs = dict(kwargs, use_relay=use_relay)
        relay_options = take_libp2p_options(kwargs, owner="DHT")
        _take_hivemind_node_options(kwargs)
        check_known(kwargs, _PEER_OPTIONS | _node_options(), owner="DHT")
        self.initial_peers = [str(m) for m in initial_peers or ()]
        self._client_mode = client_mode
        self.host_maddrs = list(host_maddrs)
        self.announce_maddrs = list(announce_maddrs or ())
        self.identity_path = identity_path
        self.use_relay = relay_options["use_relay"]
        self._relays = relay_options.get("relays")
        self.startup_timeout, self.shutdown_timeout = startup_timeout, shutdown_timeout
        self._validators = list(record_validators)
        self._peer_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _PEER_OPTIONS}
        self._node_kwargs = kwargs
        self._p2p = p2p
        self._p2p_replica: Any = None
        self.peer: Peer | None = None
        self.node: DHTNode | None = None
        self._ready: concurrent.futures.Future | None = None
        self._stopped = threading.Event()
        if start:
            self.run_in_background(await_ready=await_ready)

    # ------------------------------------------------------------------ life cycle

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None):
        """Start the peer and join the swarm; with await_ready, wait until joined."""
        if self.peer is not None:
            raise ValidationError("this DHT is already running")
        future = run_coroutine_future(self._start())
        self._ready = future
        self._stopped.clear()
        if await_ready:
            future.result(timeout if timeout is not None else self.startup_timeout)
        return future

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until the peer has joined the swarm (after ``start=True,
        await_ready=False`` or ``run_in_background(await_ready=False)``); raises what
        the start raised, ``TimeoutError`` after ``timeout`` seconds."""
        if self._ready is None:
            raise ValidationError("the DHT was not started: call run_in_background() first")
        self._ready.result(timeout)

    def run(self) -> None:
        """Start (unless running) and block until :meth:`shutdown` is called from another
        thread: hivemind's DHT process body. Prefer ``start=True``, which returns."""
        if self.peer is None and self._ready is None:
            self.run_in_background(await_ready=True)
        self._stopped.wait()

    async def replicate_p2p(self) -> Any:
        """A ``swarmgrad.p2p.P2P`` handle on this DHT's peer (the same handle on every
        call), for custom protocols written the hivemind way; it may be used from the
        program's own event loop. The peer is shared, not copied: it lives as long as the
        DHT."""
        from swarmgrad.p2p import P2P  # the compat layer above dht, imported when asked

        peer = self._running()
        if self._p2p_replica is None or self._p2p_replica.peer is not peer:
            self._p2p_replica = P2P.from_peer(peer)
        return self._p2p_replica

    async def _start(self) -> None:
        from swarmgrad.dht.validation import CompositeValidator

        if self._p2p is not None:
            await self._start_on(_peer_of(self._p2p), CompositeValidator)
            return
        peer_kwargs = dict(
            identity_path=self.identity_path,
            host_maddrs=self.host_maddrs,
            announce_maddrs=self.announce_maddrs,
            client_mode=self._client_mode,
            **self._peer_kwargs,
        )
        if self._client_mode and self.use_relay and (self._relays or self.initial_peers):
            try:
                peer = await Peer.create(
                    relays=self._relays or self.initial_peers,
                    relay_wait_timeout=10.0,
                    **peer_kwargs,
                )
            except PeerUnreachable as e:
                logger.warning("no relay for this client-mode peer, others cannot call it: %s", e)
                peer = await Peer.create(**peer_kwargs)
        else:
            peer = await Peer.create(**peer_kwargs)
        try:
            await self._start_on(peer, CompositeValidator)
        except BaseException:
            await peer.shutdown()
            raise
        self._owns_peer = True

    async def _start_on(self, peer: Peer, composite: Any) -> None:
        self._owns_peer = False
        node = await DHTNode.create(
            peer,
            self.initial_peers,
            client_mode=self._client_mode,
            record_validator=composite(self._validators),
            **self._node_kwargs,
        )
        self.peer, self.node = peer, node

    def shutdown(self) -> None:
        """Leave the swarm: stop the node and close every connection (idempotent)."""
        peer, node = self.peer, self.node
        self.peer = self.node = None
        self._ready = None
        self._stopped.set()
        if peer is None:
            return
        owns_peer = getattr(self, "_owns_peer", True)

        async def stop() -> None:
            if node is not None:
                await node.shutdown()
            if owns_peer:  # a peer passed in as p2p= belongs to its creator
                await peer.shutdown()

        try:
            run_coroutine(stop(), timeout=self.shutdown_timeout)
        except DeadlineExceeded:  # as hivemind: warn, and stop it the hard way (cancelled)
            logger.warning(
                "the DHT did not shut down within shutdown_timeout=%s s; its tasks were cancelled",
                self.shutdown_timeout,
            )

    def is_alive(self) -> bool:
        return self.node is not None

    def __enter__(self) -> DHT:
        if self.peer is None:
            self.run_in_background()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ identity

    @property
    def peer_id(self):
        return self._running().peer_id

    @property
    def client_mode(self) -> bool:
        return self._client_mode

    def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        """Addresses other peers can use to reach this one (relayed ones in client mode)."""
        return self._running().get_visible_maddrs()

    def _running(self) -> Peer:
        if self.peer is None or self.node is None:
            raise ValidationError("the DHT is not running: call run_in_background() first")
        return self.peer

    # ------------------------------------------------------------------ get / store

    def get(
        self,
        key: Any,
        latest: bool = False,
        return_future: bool = False,
        quorum: int | None = None,
    ) -> ValueWithExpiration | concurrent.futures.Future | None:
        """``ValueWithExpiration(value, expiration_time)`` or None (see DHTNode.get, also
        for ``quorum``)."""
        self._running()
        node = self.node
        return self._result(node.get(key, latest=latest, quorum=quorum), return_future)

    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: bool = False,
    ) -> bool | concurrent.futures.Future:
        """Store value under key (and subkey) until expiration_time (get_dht_time() + s)."""
        self._running()
        node = self.node
        return self._result(node.store(key, value, expiration_time, subkey=subkey), return_future)

    def run_coroutine(
        self, coro: Callable[[DHT, DHTNode], Any], return_future: bool = False
    ) -> Any:
        """Run ``await coro(dht, node)`` on the peer's event loop (custom protocols)."""
        self._running()
        return self._result(coro(self, self.node), return_future)

    def add_validators(self, record_validators: Iterable[RecordValidatorBase]) -> None:
        """Add record validators to a running (or not yet started) DHT."""
        validators = list(record_validators)
        if self.node is None:
            self._validators.extend(validators)
        else:
            self.node.protocol_validator.extend(validators)

    @staticmethod
    def _result(coro: Any, return_future: bool) -> Any:
        if return_future:
            return run_coroutine_future(coro)
        return run_coroutine(coro)
