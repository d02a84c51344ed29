"""Pair-wise gossip averaging (as in dpwa): each step pulls one peer's parameters and mixes
them into ours.

Peers declare themselves in the DHT under ``<prefix>.gossip`` (subkey = PeerID, value =
``{"v": 1, "maddrs": [...]}``, refreshed every ``declare_period``) and serve one RPC,
``<prefix>.gossip.pull``: the request names the puller's tensor schema
(``[[dtype, shape], ...]``); the answer is a copy of the server's tensors (optionally
compressed), its sample clock and its latest loss. A server whose tensors differ in
number, shape or dtype refuses with an error naming the first mismatching tensor.

A step, with probability ``fetch_probability``, picks a peer by flow-control score
(:class:`~swarmgrad.averaging.gossip.rules.PeerScoreboard`: fast, reliable peers are
asked more often, slow or failing ones rarely), pulls, checks what came back (schema,
NaN/Inf, clock and loss values), skips the mix when the Euclidean distance between the
two parameter vectors exceeds ``divergence_threshold``, and otherwise sets
``local = (1 - a) * local + a * remote`` with ``a`` from the mixing rule
(:func:`~swarmgrad.averaging.gossip.rules.mixing_factor`). A peer that fails is penalized
and, within the same step, another one is tried (up to ``max_attempts``).

:class:`AsyncGossipAverager` runs on the event loop (use it from async code that owns a
peer and a DHT node, e.g. on the simulated network); :class:`GossipAverager` is the
synchronous facade over a :class:`~swarmgrad.dht.DHT`. The averaged tensors are changed
in place under a lock, in a worker thread; hold :meth:`get_tensors` while changing them
from other threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmgrad.averaging.gossip.protocol import (
    GossipDeclaration,
    PullAnswer,
    PullRequest,
    declaration_key,
    decode_declaration,
    decode_pull_answer,
    decode_pull_request,
    pull_rpc_name,
)
from swarmgrad.averaging.gossip.rules import MixingRule, PeerScoreboard, mixing_factor
from swarmgrad.compression.serialized import CompressionType, dtype_name
from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.dht.dht import DHT
from swarmgrad.dht.node import DHTNode
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.net.identity import PeerID
from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import RPCContext, ServicerBase
from swarmgrad.utils.checks import positive_seconds
from swarmgrad.utils.errors import ProtocolViolation, SwarmgradError, ValidationError
from swarmgrad.utils.loop_thread import run_coroutine, run_coroutine_future

__all__ = ["AsyncGossipAverager", "GossipAverager", "GossipResult"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GossipResult:
    """What one step did: ``mixed`` is True when remote parameters were mixed in."""

    peer: PeerID | None = None
    factor: float | None = None
    distance: float | None = None
    skipped: str | None = None  # why nothing was mixed: "fetch_probability", "diverged", ...
    failures: tuple[str, ...] = ()  # peers tried before, and why each failed

    @property
    def mixed(self) -> bool:
        return self.peer is not None and self.skipped is None


def _schema(tensors: Sequence[torch.Tensor]) -> list[list[Any]]:
    return [[dtype_name(t.dtype), list(t.shape)] for t in tensors]


def _describe(entry: Sequence[Any]) -> str:
    return f"{entry[0]}{list(entry[1])}"


def schema_mismatch(ours: list[list[Any]], theirs: Any, who: str) -> str | None:
    """Why ``theirs`` (another peer's schema) differs from ``ours``, or None."""
    if not isinstance(theirs, list):
        return f"{who} sent no tensor schema"
    if len(theirs) != len(ours):
        return f"{who} averages {len(theirs)} tensors, this peer {len(ours)}"
    for i, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        if not isinstance(other, list | tuple) or len(other) != 2 or list(other) != mine:
            return f"tensor {i}: {who} has {_describe_safe(other)}, this peer {_describe(mine)}"
    return None


def _describe_safe(entry: Any) -> str:
    try:
        return _describe(entry)
    except Exception:
        return repr(entry)[:80]


class AsyncGossipAverager(ServicerBase):
    """Gossip averaging on the event loop (see the module docstring).

    ``averaged_tensors`` are floating-point tensors changed in place. Call :meth:`start`
    on the loop, then ``await step(...)``; ``await shutdown()`` withdraws and stops.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        peer: Peer,
        dht_node: DHTNode,
        *,
        prefix: str,
        mixing: str | MixingRule = MixingRule.CONSTANT,
        mixing_constant: float = 0.5,
        divergence_threshold: float | None = None,
        fetch_probability: float = 1.0,
        request_timeout: float = 5.0,
        client_mode: bool = False,
        declare_period: float = 30.0,
        compression: CompressionType | str = CompressionType.NONE,
        max_attempts: int = 3,
        rng: random.Random | None = None,
        scoreboard: PeerScoreboard | None = None,
    ):
        if isinstance(averaged_tensors, torch.Tensor):
            raise ValidationError("averaged_tensors must be a sequence of tensors, not one tensor")
        tensors = list(averaged_tensors)
        for i, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValidationError(
                    f"averaged tensor {i} must be a floating-point torch tensor, got "
                    f"{getattr(tensor, 'dtype', type(tensor).__name__)}"
                )
            if tensor.device.type != "cpu" or tensor.layout != torch.strided:
                raise ValidationError(f"averaged tensor {i} must be a dense CPU tensor")
        if not tensors:
            raise ValidationError("averaged_tensors is empty: there is nothing to average")
        # Type checks first: a str or None would otherwise fail below with a TypeError
        # that names no option, and NaN passes ``<= 0`` (then every pull fails).
        for name, value in (
            ("mixing_constant", mixing_constant),
            ("fetch_probability", fetch_probability),
            ("request_timeout", request_timeout),
            ("declare_period", declare_period),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValidationError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValidationError(f"{name} must be finite, got {value!r}")
        if type(max_attempts) is not int:
            raise ValidationError(f"max_attempts must be an int, got {max_attempts!r}")
        if not isinstance(prefix, str) or not prefix:
            raise ValidationError(f"the gossip prefix must be a non-empty str, got {prefix!r}")
        if not 0 <= mixing_constant <= 1:
            raise ValidationError(f"mixing_constant must be in [0, 1], got {mixing_constant}")
        if not 0 <= fetch_probability <= 1:
            raise ValidationError(f"fetch_probability must be in [0, 1], got {fetch_probability}")
        if divergence_threshold is not None and not divergence_threshold > 0:
            raise ValidationError(
                f"divergence_threshold must be positive or None, got {divergence_threshold}"
            )
        if request_timeout <= 0 or declare_period <= 0 or max_attempts < 1:
            raise ValidationError("request_timeout, declare_period and max_attempts must be > 0")
        self.tensors = tensors
        self.peer, self.dht_node, self.prefix = peer, dht_node, prefix
        self.mixing = MixingRule.parse(mixing)
        self.mixing_constant = mixing_constant
        self.divergence_threshold = divergence_threshold
        self.fetch_probability = fetch_probability
        self.request_timeout = request_timeout
        self.client_mode = client_mode
        self.declare_period = declare_period
        self.compression = CompressionType(compression)
        self.max_attempts = max_attempts
        self.rng = rng or random.Random()
        self.scoreboard = scoreboard or PeerScoreboard(rng=self.rng)
        self.key = declaration_key(prefix)
        self.rpc_prefix = self.key  # rpc_pull serves "<prefix>.gossip.pull"
        self.rpc_name = pull_rpc_name(prefix)
        # the tensors' lock (users hold it too, so the loop thread never waits for it: only
        # worker threads take it), and a short-lived one for the sample clock and the loss
        self.lock = threading.Lock()
        self._clock_lock = threading.Lock()
        self.samples_seen = 0.0
        self.loss: float | None = None
        self.pulls_served = 0
        self._schema = _schema(tensors)
        self._peers: dict[PeerID, tuple[str, ...]] = {}
        self._peers_fetched_at: float | None = None
        self._declared_until: float | None = None
        self._task: asyncio.Task | None = None
        self._started = self._closed = False

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Serve pulls and declare this peer (unless in client mode); call on the loop."""
        if self._started:
            raise ValidationError("this gossip averager has already been started")
        self._started = True
        if not self.client_mode:
            self.peer.add_servicer(self)
            self._task = asyncio.get_running_loop().create_task(
                self._declare_loop(), name=f"declare {self.key}"
            )

    async def shutdown(self, withdraw_timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.client_mode and self._started:
            self.peer.remove_servicer(self)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._declared_until is not None:
            expiration = max(self._declared_until, self.dht_node.time_fn()) + 1.0
            with contextlib.suppress(Exception):
                async with asyncio.timeout(withdraw_timeout):
                    await self.dht_node.store(
                        self.key, None, expiration, subkey=self.peer.peer_id.to_base58()
                    )

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked against mixing and serving while in the block."""
        with self.lock:
            yield self.tensors

    # ------------------------------------------------------------------ declarations

    async def _declare_loop(self) -> None:
        while True:
            try:
                maddrs = tuple(str(m) for m in self.peer.get_visible_maddrs())
                expiration = self.dht_node.time_fn() + 2 * self.declare_period
                value = GossipDeclaration(maddrs).encode()
                await self.dht_node.store(
                    self.key, value, expiration, subkey=self.peer.peer_id.to_base58()
                )
                self._declared_until = expiration
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("could not declare gossip peer under %s: %r", self.key, e)
            await asyncio.sleep(self.declare_period)

    async def _refresh_peers(self, force: bool = False) -> None:
        now = asyncio.get_running_loop().time()
        fresh = (
            self._peers_fetched_at is not None
            and now - self._peers_fetched_at < self.declare_period / 2
        )
        if fresh and self._peers and not force:
            return
        found = await self.dht_node.get(self.key, latest=force or not self._peers)
        self._peers_fetched_at = now
        peers: dict[PeerID, tuple[str, ...]] = {}
        if found is not None and isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                value = entry.value if isinstance(entry, ValueWithExpiration) else entry
                parsed = decode_declaration(subkey, value)
                if parsed is not None and parsed[0] != self.peer.peer_id:
                    peers[parsed[0]] = parsed[1].maddrs
        for gone in set(self._peers) - set(peers):
            self.scoreboard.forget(gone)
        self._peers = peers

    @property
    def known_peers(self) -> list[PeerID]:
        return list(self._peers)

    # ------------------------------------------------------------------ serving

    async def rpc_pull(self, message: Any, context: RPCContext) -> dict[str, Any]:
        """A copy of our tensors, sample clock and loss, for a puller with our schema."""
        request = decode_pull_request(message)
        mismatch = schema_mismatch(self._schema, request.schema, str(context.remote_id))
        if mismatch is not None:
            logger.debug("refusing a gossip pull: %s", mismatch)
            raise ValidationError(f"{self.peer.peer_id} refuses the pull: {mismatch}")
        tensors, samples, loss = await asyncio.to_thread(self._snapshot)
        self.pulls_served += 1
        return PullAnswer(tensors_to_message(tensors, self.compression), samples, loss).encode()

    def _snapshot(self) -> tuple[list[torch.Tensor], float, float | None]:
        with self.lock:
            tensors = [t.detach().clone() for t in self.tensors]
        with self._clock_lock:
            return tensors, self.samples_seen, self.loss

    # ------------------------------------------------------------------ stepping

    async def step(
        self, samples_seen: float | None = None, loss: float | None = None
    ) -> GossipResult:
        """Count ``samples_seen`` new samples (default 1: the clock counts steps), record
        ``loss`` and, with probability ``fetch_probability``, pull one peer and mix."""
        if samples_seen is not None and not (
            _is_number(samples_seen) and math.isfinite(samples_seen) and samples_seen >= 0
        ):
            raise ValidationError(
                f"samples_seen must be a finite number >= 0, got {samples_seen!r}"
            )
        if loss is not None and not (_is_number(loss) and math.isfinite(loss)):
            raise ValidationError(f"loss must be a finite number, got {loss!r}")
        with self._clock_lock:
            self.samples_seen += 1.0 if samples_seen is None else float(samples_seen)
            if loss is not None:
                self.loss = float(loss)
        if self.rng.random() >= self.fetch_probability:
            return GossipResult(skipped="fetch_probability")
        await self._refresh_peers()
        failures: list[str] = []
        tried: set[PeerID] = set()
        for _ in range(self.max_attempts):
            candidates = [p for p in self._peers if p not in tried]
            if not candidates and not tried:
                await self._refresh_peers(force=True)
                candidates = list(self._peers)
            chosen = self.scoreboard.choose(candidates)
            if chosen is None:
                break
            tried.add(chosen)
            result = await self._pull_and_mix(chosen, failures)
            if result is not None:
                return result
        skipped = "no peer answered" if tried else "no peers"
        return GossipResult(skipped=skipped, failures=tuple(failures))

    async def _pull_and_mix(self, peer_id: PeerID, failures: list[str]) -> GossipResult | None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            self.peer.add_addresses(peer_id, self._peers.get(peer_id, ()))
            answer = await self.peer.call(
                peer_id,
                self.rpc_name,
                PullRequest(self._schema).encode(),
                timeout=self.request_timeout,
            )
            remote, samples, loss = self._check_answer(peer_id, answer)
        except Exception as e:  # whatever the peer did, it must not break our step
            if not isinstance(e, SwarmgradError | OSError | ValueError):
                logger.warning("unexpected error pulling from %s", peer_id, exc_info=True)
            elapsed = loop.time() - started
            self.scoreboard.record_failure(peer_id, max(elapsed, self.request_timeout / 2))
            failures.append(f"{peer_id}: {e}")
            logger.info("gossip pull from %s failed: %s", peer_id, e)
            return None
        self.scoreboard.record_success(peer_id, loop.time() - started)
        return await asyncio.to_thread(self._mix, peer_id, remote, samples, loss, tuple(failures))

    def _check_answer(
        self, peer_id: PeerID, answer: Any
    ) -> tuple[list[torch.Tensor], float, float | None]:
        pulled = decode_pull_answer(answer, peer_id)
        remote = tensors_from_message(pulled.tensors, f"tensors from {peer_id}")
        mismatch = schema_mismatch(self._schema, _schema(remote), str(peer_id))
        if mismatch is not None:
            raise ProtocolViolation(mismatch)
        for i, tensor in enumerate(remote):
            if not torch.isfinite(tensor).all():
                raise ProtocolViolation(f"tensor {i} from {peer_id} holds NaN or Inf values")
        return remote, pulled.samples, pulled.loss

    def _mix(
        self,
        peer_id: PeerID,
        remote: list[torch.Tensor],
        remote_samples: float,
        remote_loss: float | None,
        failures: tuple[str, ...],
    ) -> GossipResult:
        with self._clock_lock:
            factor = mixing_factor(
                self.mixing,
                mixing_constant=self.mixing_constant,
                local_samples=self.samples_seen,
                remote_samples=remote_samples,
                local_loss=self.loss,
                remote_loss=remote_loss,
            )
        distance = None
        with self.lock:
            if self.divergence_threshold is not None:
                distance = math.sqrt(
                    sum(
                        float(torch.sum((a.double() - b.double()) ** 2))
                        for a, b in zip(self.tensors, remote, strict=True)
                    )
                )
                if distance > self.divergence_threshold:
                    logger.info(
                        "not mixing with %s: parameter distance %.4g exceeds %.4g",
                        peer_id,
                        distance,
                        self.divergence_threshold,
                    )
                    return GossipResult(peer_id, factor, distance, "diverged", failures)
            with torch.no_grad():
                for local, other in zip(self.tensors, remote, strict=True):
                    local.lerp_(other.to(local.device), factor)
        with self._clock_lock:
            self.samples_seen = (1 - factor) * self.samples_seen + factor * remote_samples
        return GossipResult(peer_id, factor, distance, None, failures)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


class GossipAverager:
    """Synchronous gossip averaging over a :class:`~swarmgrad.dht.DHT` (hivemind-style).

    ``GossipAverager(tensors, dht, prefix="run42", start=True)``; then ``step()`` after
    each local training step, and ``shutdown()`` at the end. ``client_mode`` defaults to
    the DHT's: a client-mode peer pulls from others but is not pulled from. Other keyword
    arguments are those of :class:`AsyncGossipAverager`.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: DHT,
        *,
        prefix: str,
        start: bool = False,
        mixing: str | MixingRule = MixingRule.CONSTANT,
        mixing_constant: float = 0.5,
        divergence_threshold: float | None = None,
        fetch_probability: float = 1.0,
        request_timeout: float = 5.0,
        client_mode: bool | None = None,
        shutdown_timeout: float = 10.0,
        **kwargs: Any,
    ):
        # else shutdown() would give up at once and leave the averager half stopped
        self.shutdown_timeout = positive_seconds("shutdown_timeout", shutdown_timeout)
        self.dht = dht
        self._options = dict(
            prefix=prefix,
            mixing=mixing,
            mixing_constant=mixing_constant,
            divergence_threshold=divergence_threshold,
            fetch_probability=fetch_probability,
            request_timeout=request_timeout,
            client_mode=dht.client_mode if client_mode is None else client_mode,
            **kwargs,
        )
        # list() of one tensor would silently split it into its rows: let the core refuse
        self._tensors = (
            averaged_tensors
            if isinstance(averaged_tensors, torch.Tensor)
            else list(averaged_tensors)
        )
        self._core: AsyncGossipAverager | None = None
        if start:
            self.run_in_background()

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start serving and declaring (the DHT must be running)."""
        if self._core is not None:
            raise ValidationError("this GossipAverager is already running")
        peer, node = self.dht.peer, self.dht.node
        if peer is None or node is None:
            raise ValidationError("the DHT is not running: start it before the averager")

        async def create() -> AsyncGossipAverager:
            core = AsyncGossipAverager(self._tensors, peer, node, **self._options)
            core.start()
            return core

        self._core = run_coroutine(create(), timeout=timeout)

    def _running(self) -> AsyncGossipAverager:
        if self._core is None or self._core._closed:
            raise ValidationError("the GossipAverager is not running: call run_in_background()")
        return self._core

    def step(
        self,
        samples_seen: float | None = None,
        loss: float | None = None,
        *,
        wait: bool = True,
        timeout: float | None = None,
    ) -> GossipResult | concurrent.futures.Future:
        """One gossip step (see :meth:`AsyncGossipAverager.step`); with ``wait=False`` a
        future of the result."""
        core = self._running()
        if not wait:
            return run_coroutine_future(core.step(samples_seen, loss))
        return run_coroutine(core.step(samples_seen, loss), timeout=timeout)

    def get_tensors(self) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """``with averager.get_tensors() as tensors:`` read or change them safely."""
        if self._core is None:
            return contextlib.nullcontext(self._tensors)
        return self._core.get_tensors()

    @property
    def samples_seen(self) -> float:
        return self._running().samples_seen

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    def is_alive(self) -> bool:
        return self._core is not None and not self._core._closed

    def shutdown(self) -> None:
        core, self._core = self._core, None
        if core is not None:
            run_coroutine(core.shutdown(), timeout=self.shutdown_timeout)

    def __enter__(self) -> GossipAverager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
