"""``Server``: hosts experts on this process's peer, batches their requests on one device
thread, keeps them declared in the DHT and checkpoints them.

Quick start (hivemind's names)::

    server = Server.create(expert_cls="ffn", hidden_dim=512, num_experts=8,
                           expert_pattern="expert.[0:32].[0:32]",
                           initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."],
                           start=True)
    ...
    server.shutdown()

Unlike hivemind, nothing is forked: the server shares the process's event loop and peer
with its DHT (``dht.peer``), registers the ``moe.*`` RPC handlers on that peer, and runs
the experts' torch code on one background thread (:class:`Runtime`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmgrad.compression.serialized import CompressionType
from swarmgrad.moe.dht_records import get_experts_info_on_node
from swarmgrad.moe.expert_uid import UID_DELIMITER, ExpertUID, check_uid
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server.activation_cache import ActivationCache
from swarmgrad.moe.server.checkpoints import (
    DEFAULT_KEEP,
    CheckpointSaver,
    load_experts,
    store_experts,
)
from swarmgrad.moe.server.connection_handler import ConnectionHandler
from swarmgrad.moe.server.dht_handler import (
    ExpertDeclarer,
    default_expiration,
    generate_free_uids,
)
from swarmgrad.moe.server.expert_pattern import parse_expert_pattern
from swarmgrad.moe.server.layers import load_custom_module, name_to_block, name_to_input
from swarmgrad.moe.server.module_backend import ModuleBackend, derive_outputs_schema
from swarmgrad.moe.server.runtime import Runtime
from swarmgrad.moe.server.schedulers import SCHEDULER_NAMES, make_scheduler
from swarmgrad.net.identity import PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.utils.checks import positive_int
from swarmgrad.utils.errors import ValidationError

__all__ = ["PeerInfo", "Server", "background_server"]

logger = logging.getLogger(__name__)

_SAMPLE_BATCH = 4
DEFAULT_ACTIVATION_CACHE_BYTES = 512 * 1024 * 1024
_DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)


@dataclass(frozen=True)
class PeerInfo:
    """What :func:`background_server` yields: the server peer's id and the multiaddrs
    others dial (pass ``addrs`` as a DHT's ``initial_peers``)."""

    peer_id: PeerID
    addrs: tuple[Multiaddr, ...]


class Server:
    """Serves ``module_backends`` ({uid: :class:`ModuleBackend`}) through ``dht``'s peer.

    :param dht: a running :class:`~swarmgrad.dht.DHT` (the synchronous methods use its
        loop); for code already on the event loop, any object with ``peer`` and ``node``
        attributes works with :meth:`astart` / :meth:`ashutdown`.
    :param num_connection_handlers: accepted for hivemind compatibility; the peer's event
        loop serves every call.
    :param update_period: seconds between re-declarations of the experts in the DHT.
    :param expiration: lifetime of a declaration (default ``max(2 * update_period, 60)``).
    :param checkpoint_dir: restore the newest checkpoint of each expert now, save one every
        ``checkpoint_interval`` seconds (default ``update_period``) and at shutdown, keep
        the ``keep_checkpoints`` newest.
    :param stats_report_interval: log per-expert batch statistics this often (seconds).
    :param activation_cache_bytes: memory for forward graphs kept until their backward
        (saves recomputing the forward pass; see :mod:`.activation_cache`), shared by the
        experts that have no cache of their own; 0 disables it.
    :param start: start serving at once (``run_in_background(await_ready=True)``).
    """

    def __init__(
        self,
        dht: Any,
        module_backends: Mapping[ExpertUID, ModuleBackend],
        num_connection_handlers: int | None = 1,
        update_period: float = 30,
        expiration: float | None = None,
        start: bool = False,
        checkpoint_dir: str | Path | None = None,
        *,
        checkpoint_interval: float | None = None,
        keep_checkpoints: int = DEFAULT_KEEP,
        stats_report_interval: float | None = None,
        activation_cache_bytes: int = DEFAULT_ACTIVATION_CACHE_BYTES,
        **kwargs: Any,
    ):
        if kwargs:
            raise ValidationError(f"Server got unexpected arguments: {sorted(kwargs)}")
        if not module_backends:
            raise ValidationError("a server needs at least one expert (module_backends is empty)")
        for uid, backend in module_backends.items():
            check_uid(uid)
            if backend.name != uid:
                raise ValidationError(f"module_backends[{uid!r}] is named {backend.name!r}")
        self.dht = dht
        self.module_backends = dict(module_backends)
        self.num_connection_handlers = num_connection_handlers
        self.update_period = update_period
        self.expiration = default_expiration(update_period) if expiration is None else expiration
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_checkpoints = keep_checkpoints
        self.runtime = Runtime(
            [pool for b in self.module_backends.values() for pool in b.get_pools()],
            stats_report_interval=stats_report_interval,
        )
        self.connection_handler = ConnectionHandler(self.module_backends)
        self.activation_cache = None
        if activation_cache_bytes > 0:
            self.activation_cache = ActivationCache(activation_cache_bytes)
            for backend in self.module_backends.values():
                if backend.activation_cache is None:
                    backend.activation_cache = self.activation_cache
        self.declarer: ExpertDeclarer | None = None
        self.checkpoint_saver: CheckpointSaver | None = None
        if self.checkpoint_dir is not None:
            load_experts(self.module_backends, self.checkpoint_dir)
            self.checkpoint_saver = CheckpointSaver(
                self.module_backends,
                self.checkpoint_dir,
                checkpoint_interval or update_period,
                keep_checkpoints,
            )
        self.ready = threading.Event()
        self._stopped = threading.Event()
        self._owns_dht = False
        self._state = "new"  # -> "started" -> "stopped"
        self._state_lock = threading.Lock()
        if start:
            self.run_in_background(await_ready=True)

    def __repr__(self) -> str:
        return f"Server({len(self.module_backends)} experts, {self._state})"

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        num_experts: int | None = None,
        expert_uids: Sequence[ExpertUID] | None = None,
        expert_pattern: str | None = None,
        expert_cls: str = "ffn",
        hidden_dim: int = 1024,
        optim_cls: Callable[..., torch.optim.Optimizer] | None = torch.optim.Adam,
        scheduler: str | None = None,
        num_warmup_steps: int | None = None,
        num_training_steps: int | None = None,
        clip_grad_norm: float | None = None,
        num_handlers: int | None = None,
        min_batch_size: int = 1,
        max_batch_size: int = 4096,
        batch_timeout: float = 0.05,
        device: str | torch.device | None = None,
        initial_peers: Sequence[str] = (),
        checkpoint_dir: str | Path | None = None,
        checkpoint_interval: float | None = None,
        keep_checkpoints: int = DEFAULT_KEEP,
        compression: CompressionType | str = CompressionType.NONE,
        stats_report_interval: float | None = None,
        activation_cache_bytes: int = DEFAULT_ACTIVATION_CACHE_BYTES,
        custom_module_path: str | Path | None = None,
        update_period: float = 30.0,
        expiration: float | None = None,
        start: bool = False,
        host_maddrs: Iterable[str] = _DEFAULT_HOST_MADDRS,
        announce_maddrs: Iterable[str] = (),
        identity_path: str | None = None,
        dht: Any = None,
        **kwargs: Any,
    ) -> Server:
        """Build a server hosting ``num_experts`` fresh experts of class ``expert_cls``.

        Uids come from ``expert_uids``, or ``num_experts`` of them are sampled from
        ``expert_pattern`` (preferring uids no other server declared). Each expert gets its
        own ``optim_cls(parameters)`` optimizer and ``scheduler`` (``"linear"``: warmup
        over ``num_warmup_steps`` steps then linear decay to 0 at ``num_training_steps``;
        ``"none"``). ``compression`` is the codec of the experts' outputs and input
        gradients. Without ``dht`` a DHT peer is started (``initial_peers``,
        ``host_maddrs``, ``announce_maddrs``, ``identity_path`` and other keyword
        arguments go to it) and the server shuts it down with itself.
        """
        if custom_module_path is not None:
            load_custom_module(custom_module_path)
        if expert_cls not in name_to_block:
            raise ValidationError(
                f"unknown expert class {expert_cls!r}; known: {sorted(name_to_block)} "
                "(add more with register_expert_class or custom_module_path)"
            )
        pattern = _check_uid_source(num_experts, expert_uids, expert_pattern)
        positive_int("hidden_dim", hidden_dim)
        _check_scheduler(scheduler, num_warmup_steps, num_training_steps)
        compression = CompressionType(compression)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dht is not None and kwargs:
            raise ValidationError(
                f"unexpected arguments {sorted(kwargs)} (they configure a new DHT, but one "
                "was given)"
            )

        owns_dht = dht is None
        if owns_dht:
            from swarmgrad.dht import DHT

            dht = DHT(
                initial_peers=initial_peers,
                host_maddrs=host_maddrs,
                announce_maddrs=announce_maddrs,
                identity_path=identity_path,
                start=True,
                **kwargs,
            )
            logger.info("DHT peer running on %s", [str(m) for m in dht.get_visible_maddrs()])
        try:
            if expert_uids is None and pattern is _SEQUENTIAL:
                expert_uids = dht.run_coroutine(
                    lambda _dht, node: _first_free_uids(node, num_experts)
                )
                logger.info("no expert_pattern: serving %s", ", ".join(expert_uids))
            elif expert_uids is None:
                logger.info("choosing %d expert uids from pattern %r", num_experts, expert_pattern)
                expert_uids = dht.run_coroutine(
                    lambda _dht, node: generate_free_uids(node, num_experts, pattern)
                )
            backends = _make_backends(
                list(expert_uids),
                expert_cls=expert_cls,
                hidden_dim=hidden_dim,
                optim_cls=optim_cls,
                scheduler=scheduler,
                num_warmup_steps=num_warmup_steps,
                num_training_steps=num_training_steps,
                clip_grad_norm=clip_grad_norm,
                min_batch_size=min_batch_size,
                max_batch_size=max_batch_size,
                batch_timeout=batch_timeout,
                device=device,
                compression=compression,
            )
            server = cls(
                dht,
                backends,
                num_connection_handlers=num_handlers,
                update_period=update_period,
                expiration=expiration,
                checkpoint_dir=checkpoint_dir,
                checkpoint_interval=checkpoint_interval,
                keep_checkpoints=keep_checkpoints,
                stats_report_interval=stats_report_interval,
                activation_cache_bytes=activation_cache_bytes,
            )
            server._owns_dht = owns_dht
            if start:
                server.run_in_background(await_ready=True)
        except BaseException:
            if owns_dht:
                dht.shutdown()
            raise
        return server

    # ------------------------------------------------------------------ synchronous life cycle

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start serving: the device thread, the RPC handlers, the DHT declarations and
        checkpoints. With ``await_ready`` return once the experts were declared (or the
        attempt failed and was logged); :attr:`ready` is set then in any case."""
        self._begin()
        try:
            future = self.dht.run_coroutine(
                lambda _dht, _node: self._start_network(), return_future=True
            )
            if await_ready:
                future.result(timeout if timeout is not None else 60.0)
            else:
                future.add_done_callback(_log_start_failure)
        except BaseException:
            self.shutdown()
            raise

    def run(self) -> None:
        """hivemind's thread body: start serving (unless started) and block until
        :meth:`shutdown` is called from another thread. ``start=True`` (or
        :meth:`run_in_background`) serves without blocking."""
        if self._state == "new":
            self.run_in_background(await_ready=True)
        while self._state == "started":
            self._stopped.wait(1.0)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Withdraw the experts from the DHT, stop the handlers and the device thread
        (queued requests get an error), write final checkpoints, and stop the DHT if
        :meth:`create` started it. Idempotent."""
        if not self._end():
            return
        try:
            if getattr(self.dht, "node", None) is not None:
                self.dht.run_coroutine(lambda _dht, _node: self._stop_network(timeout))
        except Exception as e:
            logger.warning("could not stop the server's network side cleanly: %r", e)
        finally:
            self._stop_threads(timeout)
            if self._owns_dht:
                self.dht.shutdown()

    def __enter__(self) -> Server:
        if self._state == "new":
            self.run_in_background(await_ready=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ asynchronous life cycle

    async def astart(self) -> None:
        """:meth:`run_in_background` for code running on the peer's event loop."""
        self._begin()
        try:
            await self._start_network()
        except BaseException:
            await self.ashutdown()
            raise

    async def ashutdown(self, timeout: float = 30.0) -> None:
        """:meth:`shutdown` for code on the event loop (blocking steps run in a thread)."""
        if not self._end():
            return
        try:
            await self._stop_network(timeout)
        finally:
            await asyncio.to_thread(self._stop_threads, timeout)
            if self._owns_dht:
                await asyncio.to_thread(self.dht.shutdown)

    # ------------------------------------------------------------------ parts

    def _begin(self) -> None:
        with self._state_lock:
            if self._state != "new":
                raise ValidationError(f"this server cannot start: it is already {self._state}")
            self._state = "started"
            self.runtime.start()  # under the lock: a concurrent shutdown sees it running
            if self.checkpoint_saver is not None:
                self.checkpoint_saver.start()

    def _end(self) -> bool:
        with self._state_lock:
            previous, self._state = self._state, "stopped"
        self.ready.clear()
        self._stopped.set()
        if previous == "new" and self._owns_dht:
            self.dht.shutdown()
        return previous == "started"

    async def _start_network(self) -> None:
        if self._state != "started":  # shut down before this coroutine got to run
            return
        peer, node = self.dht.peer, self.dht.node
        self.connection_handler.attach(peer)
        self.declarer = ExpertDeclarer(
            node, list(self.module_backends), self.update_period, self.expiration
        )
        await self.declarer.start(declare_now=True)
        if self._state != "started":  # shut down during the first declaration
            await self._stop_network(timeout=10.0)
            return
        maddrs = [str(m) for m in peer.get_visible_maddrs()]
        logger.info("serving %d experts on %s", len(self.module_backends), maddrs)
        self.ready.set()

    async def _stop_network(self, timeout: float) -> None:
        self.connection_handler.detach()
        declarer, self.declarer = self.declarer, None
        if declarer is not None:
            await declarer.stop(withdraw=True, timeout=min(timeout, 10.0))

    def _stop_threads(self, timeout: float) -> None:
        self.runtime.shutdown(timeout)
        if self.checkpoint_saver is not None:
            self.checkpoint_saver.stop(timeout)
            store_experts(self.module_backends, self.checkpoint_dir, self.keep_checkpoints)


# ---------------------------------------------------------------------- helpers


_SEQUENTIAL = object()  # _check_uid_source's answer for "expert.0, expert.1, ..."


async def _first_free_uids(node: Any, num_experts: int) -> list[ExpertUID]:
    """``expert.0``, ``expert.1``, ...: the first ``num_experts`` uids no server declared
    (hivemind's choice without an ``expert_pattern``), looked up ten at a time over at most
    ten times as many uids; taken ones fill up what is missing after that, with a warning."""
    from swarmgrad.utils.errors import SwarmgradError

    chosen: list[ExpertUID] = []
    limit = 10 * num_experts
    for start in range(0, limit, 10):
        candidates = [f"expert{UID_DELIMITER}{i}" for i in range(start, min(limit, start + 10))]
        try:
            infos = await get_experts_info_on_node(node, candidates)
        except (SwarmgradError, OSError) as e:
            logger.warning("could not check which experts already exist: %r", e)
            infos = [None] * len(candidates)
        chosen += [uid for uid, info in zip(candidates, infos, strict=True) if info is None]
        if len(chosen) >= num_experts:
            return chosen[:num_experts]
    logger.warning("only %d of expert.0 .. expert.%d are free", len(chosen), limit - 1)
    taken = [f"expert{UID_DELIMITER}{i}" for i in range(limit)]
    return (chosen + [uid for uid in taken if uid not in chosen])[:num_experts]


def _check_uid_source(
    num_experts: int | None, expert_uids: Sequence[str] | None, expert_pattern: str | None
):
    if expert_uids is not None:
        expert_uids = list(expert_uids)
        if not expert_uids:
            raise ValidationError("expert_uids is empty")
        for uid in expert_uids:
            check_uid(uid)
        if len(set(expert_uids)) != len(expert_uids):
            raise ValidationError(f"expert_uids has duplicates: {expert_uids}")
        if num_experts is not None and num_experts != len(expert_uids):
            raise ValidationError(
                f"num_experts={num_experts} but {len(expert_uids)} expert_uids were given"
            )
        if expert_pattern is not None:
            raise ValidationError("give either expert_uids or expert_pattern, not both")
        return None
    if num_experts is not None and expert_pattern is None:
        # as hivemind: without a pattern the uids are expert.0, expert.1, ... (the first
        # ones no server declared yet)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValidationError(f"num_experts must be a positive int, got {num_experts!r}")
        return _SEQUENTIAL

    if num_experts is None or expert_pattern is None:
        raise ValidationError(
            "give expert_uids, or num_experts together with expert_pattern "
            "(for example num_experts=8, expert_pattern='expert.[0:32].[0:32]')"
        )
    positive_int("num_experts", num_experts)
    pattern = parse_expert_pattern(expert_pattern)
    if num_experts > pattern.grid_size:
        raise ValidationError(
            f"expert pattern {expert_pattern!r} has only {pattern.grid_size} uids, fewer than "
            f"num_experts={num_experts}"
        )
    return pattern


def _check_scheduler(
    scheduler: str | None, num_warmup_steps: int | None, num_training_steps: int | None
) -> None:
    name = "none" if scheduler is None else str(scheduler).lower()
    if name not in SCHEDULER_NAMES:
        raise ValidationError(f"unknown scheduler {scheduler!r}; expected one of {SCHEDULER_NAMES}")
    if name == "linear" and (num_training_steps is None or num_training_steps < 1):
        raise ValidationError("the linear scheduler needs num_training_steps >= 1")
    if num_warmup_steps is not None and num_warmup_steps < 0:
        raise ValidationError(f"num_warmup_steps must be >= 0, got {num_warmup_steps}")


def _log_start_failure(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("the expert server failed to start: %r", future.exception())


def _make_backends(
    uids: Sequence[ExpertUID],
    *,
    expert_cls: str,
    hidden_dim: int,
    optim_cls: Callable[..., torch.optim.Optimizer] | None,
    scheduler: str | None,
    num_warmup_steps: int | None,
    num_training_steps: int | None,
    clip_grad_norm: float | None,
    min_batch_size: int,
    max_batch_size: int,
    batch_timeout: float,
    device: torch.device,
    compression: CompressionType,
) -> dict[ExpertUID, ModuleBackend]:
    sample = name_to_input[expert_cls](_SAMPLE_BATCH, hidden_dim)
    sample = sample if isinstance(sample, tuple) else (sample,)
    args_schema = tuple(BatchTensorDescriptor.from_tensor(x, compression) for x in sample)
    backends: dict[ExpertUID, ModuleBackend] = {}
    outputs_schema = None
    for uid in uids:
        module = name_to_block[expert_cls](hidden_dim).to(device)
        if outputs_schema is None:
            outputs_schema = derive_outputs_schema(uid, module, args_schema, compression)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = _make_optimizer(optim_cls, params) if params else None
        backends[uid] = ModuleBackend(
            uid,
            module,
            optimizer=optimizer,
            scheduler=make_scheduler(scheduler, optimizer, num_warmup_steps, num_training_steps)
            if optimizer is not None
            else None,
            args_schema=args_schema,
            outputs_schema=outputs_schema,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            clip_grad_norm=clip_grad_norm,
            timeout=batch_timeout,
        )
    return backends


def _make_optimizer(
    optim_cls: Callable[..., torch.optim.Optimizer] | None, params: list
) -> torch.optim.Optimizer | None:
    """``optim_cls(params)``, with its failure reported as a bad ``optim_cls`` argument
    rather than a bare TypeError from deep inside Server.create."""
    if optim_cls is None:
        return None
    try:
        return optim_cls(params)
    except Exception as e:
        name = getattr(optim_cls, "__qualname__", repr(optim_cls))
        raise ValidationError(
            f"optim_cls={name} failed to build an optimizer for an expert's parameters: "
            f"{type(e).__name__}: {e}"
        ) from e


@contextlib.contextmanager
def background_server(*args: Any, shutdown_timeout: float = 5, **kwargs: Any) -> Iterator:
    """``with background_server(expert_cls="ffn", num_experts=4, ...) as info:``

    Runs :meth:`Server.create` (``start=True``) in this process (hivemind forks a
    process; swarmgrad needs not) and yields a :class:`PeerInfo` with the server's PeerID
    and multiaddrs, to be used as ``initial_peers`` of a client's DHT or to call the
    experts directly. The server (and the DHT it started) shut down on exit, its waits
    bounded by ``shutdown_timeout`` (hivemind's default). Without ``expert_pattern`` or
    ``expert_uids``, ``num_experts`` experts ``expert.0``, ``expert.1``, ... are served."""
    kwargs["start"] = True
    server = Server.create(*args, **kwargs)
    try:
        dht = server.dht
        yield PeerInfo(dht.peer_id, tuple(dht.get_visible_maddrs()))
    finally:
        server.shutdown(shutdown_timeout)
