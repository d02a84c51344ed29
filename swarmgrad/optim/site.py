"""Sites: a group of processes under ``torch.distributed`` that is one peer of the swarm.

A *site* is a machine (or a cluster) with several accelerators, started with ``torchrun``.
Inside the site the ranks average their gradients at every step with torch's own
collectives (gloo on CPU, NCCL on GPUs); one rank, the *speaker*, runs the swarm peer
(a :class:`~swarmgrad.dht.DHT` and a :class:`~.optimizer.Optimizer` or
:class:`~.diloco.DiLoCoOptimizer`) and speaks for the whole site: it counts the site's
batch (the ranks' batches summed) toward the swarm's target. Whenever the speaker's
parameters change (a global epoch, a downloaded state, an outer step), they are broadcast
inside the site, so every rank holds the same model; at each new epoch the speaker's
optimizer state goes to the other ranks too, so that any of them can take its place.

::

    dist.init_process_group("gloo")          # under torchrun
    site = SiteOptimizer(
        params=model.named_parameters(), batch_size_per_step=32,
        dht_factory=lambda: swarmgrad.DHT(initial_peers=PEERS, start=True),
        swarm_optimizer=lambda dht, params: swarmgrad.Optimizer(
            dht=dht, run_id="run", target_batch_size=4096, params=params,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)))
    for x, y in shard_of_this_rank:
        loss_fn(model(x), y).backward()
        site.step()                          # site all-reduce; the speaker steps the swarm
        site.zero_grad()
    site.shutdown()

**Per step**, every rank: all-reduces its gradients weighted by its batch size (so the
ranks' batches may differ); the speaker calls the swarm optimizer's ``step`` with the
site's batch, the other ranks the ``local_optimizer`` if given (DiLoCo's inner optimizer:
then they follow the speaker's inner steps themselves instead of receiving parameters at
every step); then one small all-gather of (parameter checksum, epoch, error flag): a
rank whose checksum differs from the speaker's receives the parameters.

**Failures.** When a rank's process dies, its sockets close and the collectives of the
others raise. The survivors then elect a new site through the job's store (the
``torchrun`` agent's store, or the one :mod:`swarmgrad.optim.site_launch` hosts): each
registers, waits until every other member has registered or stopped beating its
heartbeat, and the first to close the election writes the member list (a compare-and-set,
so all read the same list). The lowest surviving rank is the speaker; if the old one died,
the new one starts a DHT peer, loads the optimizer state it was given at the last epoch
and joins the swarm (downloading the swarm's state if the swarm moved on). The batch of
the failed step is dropped. ``torchrun`` itself stops the other workers when one dies; with
``--max-restarts`` it starts the site again and the new speaker downloads the state from
the swarm. To keep the survivors running instead, start the ranks with
``python -m swarmgrad.optim.site_launch``.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from swarmgrad.dht.dht import DHT
from swarmgrad.optim.diloco import DiLoCoOptimizer
from swarmgrad.utils.checks import positive_int, positive_seconds
from swarmgrad.utils.errors import SwarmgradError, ValidationError

__all__ = ["SiteError", "SiteMismatch", "SiteOptimizer"]

logger = logging.getLogger(__name__)

SwarmOptimizerFactory = Callable[[DHT, list[torch.Tensor]], Any]


class SiteMismatch(ValidationError):
    """The ranks of a site disagree on the model (number, shape or dtype of tensors)."""


class SiteError(SwarmgradError):
    """A site cannot go on: its store is gone, this rank was left out of the survivors,
    or the speaker's swarm optimizer failed (its message is in this one)."""


class _RankLost(Exception):
    """A collective of the site failed: some rank is gone (internal)."""


class SiteOptimizer:
    """One site of the swarm: every rank of the site's process group constructs one
    (module docstring). Arguments: ``params`` (the model's parameters, or its
    ``named_parameters()`` for error messages with names), ``dht_factory`` (makes the
    speaker's started DHT; called on the speaker only, which shuts it down),
    ``swarm_optimizer`` (a factory ``(dht, params) -> Optimizer | DiLoCoOptimizer``,
    called on the speaker only; ``params`` are this rank's parameters),
    ``batch_size_per_step`` (this rank's samples per :meth:`step`, or pass ``batch_size``
    to it), ``local_optimizer`` (a factory over the parameters that the other ranks step
    with the averaged gradients, mirroring the speaker's inner optimizer: for DiLoCo; None:
    they receive the speaker's parameters whenever those changed), ``process_group``
    (default: the whole job), ``store`` (default: the job's store), ``timeout``
    (collective timeout of the groups formed after a failure), ``heartbeat_interval`` and
    ``heartbeat_timeout`` (a rank whose heartbeat stood still that long is counted dead by
    an election), ``election_timeout`` (an election never waits longer),
    ``replicate_state`` (send the optimizer state to every rank at each epoch, so that a
    new speaker continues with it; without it a new speaker relies on the swarm).
    """

    def __init__(
        self,
        *,
        params: Iterable[Any],
        dht_factory: Callable[[], DHT],
        swarm_optimizer: SwarmOptimizerFactory,
        batch_size_per_step: int | None = None,
        local_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        process_group: Any = None,
        store: Any = None,
        timeout: float = 600.0,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 5.0,
        election_timeout: float = 120.0,
        replicate_state: bool = True,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise ValidationError(
                "SiteOptimizer needs torch.distributed: call "
                "torch.distributed.init_process_group() first (e.g. under torchrun)"
            )
        if batch_size_per_step is not None:
            positive_int("batch_size_per_step", batch_size_per_step)
        for name, value in (
            ("timeout", timeout),
            ("heartbeat_interval", heartbeat_interval),
            ("heartbeat_timeout", heartbeat_timeout),
            ("election_timeout", election_timeout),
        ):
            positive_seconds(name, value)
        if heartbeat_timeout <= heartbeat_interval:
            raise ValidationError(
                f"heartbeat_timeout ({heartbeat_timeout}) must exceed heartbeat_interval "
                f"({heartbeat_interval}), or live ranks would be counted dead"
            )
        if not callable(dht_factory) or not callable(swarm_optimizer):
            raise ValidationError("dht_factory and swarm_optimizer must be callables")
        self.names, self.params = _split_params(params)
        self.batch_size_per_step = batch_size_per_step
        self.timeout, self.election_timeout = float(timeout), float(election_timeout)
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.replicate_state = replicate_state
        self._dht_factory, self._swarm_factory = dht_factory, swarm_optimizer
        self._local_opt = local_optimizer(self.params) if local_optimizer is not None else None

        self.rank = dist.get_rank()
        self._group = process_group if process_group is not None else dist.group.WORLD
        self.members: list[int] = sorted(dist.get_process_group_ranks(self._group))
        self._backend = dist.get_backend(self._group)
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if self._backend == "nccl"
            else torch.device("cpu")
        )
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"swarmgrad_site/{restart}/{self.members[0]}"
        self._generation = 0
        self.failovers = 0
        self.parameter_broadcasts = 0  # steps whose parameters came from the speaker
        self.mirror_resyncs = 0  # steps whose local_optimizer state came from the speaker
        self.swarm: Any = None  # the speaker's swarm optimizer
        self.dht: DHT | None = None
        self._standby: dict | None = None  # the speaker's optimizer state at its last epoch
        self._epoch = 0
        self._replicated_epoch: int | None = None
        self._closed = False

        self._check_same_model()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, name=f"site-heartbeat-{self.rank}", daemon=True
        )
        self._heartbeat.start()
        try:
            self._form_site(resync=False)
        except _RankLost as e:
            self._stop_heartbeat()
            raise SiteError(f"a rank of the site was lost while it started: {e}") from e
        except BaseException:
            self._stop_heartbeat()
            raise

    # ------------------------------------------------------------------ properties

    @property
    def speaker_rank(self) -> int:
        """The global rank that speaks for the site: the lowest of its members."""
        return self.members[0]

    @property
    def is_speaker(self) -> bool:
        return self.rank == self.speaker_rank

    @property
    def local_epoch(self) -> int:
        """The speaker's epoch, as of the last step (the same on every rank)."""
        return self.swarm.local_epoch if self.swarm is not None else self._epoch

    @property
    def world_size(self) -> int:
        return len(self.members)

    # ------------------------------------------------------------------ training

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()

    def step(self, batch_size: int | None = None) -> None:
        """Average this step's gradients over the site; the speaker steps the swarm
        optimizer with them; every rank ends with the speaker's parameters. If a rank of
        the site died, the survivors form a new site (this batch is dropped)."""
        if self._closed:
            raise SiteError("this SiteOptimizer was shut down")
        if batch_size is None:
            batch_size = self.batch_size_per_step
            if batch_size is None:
                raise ValidationError("pass batch_size to step() or batch_size_per_step")
        positive_int("batch_size", batch_size)
        try:
            self._step(batch_size)
        except _RankLost as e:
            self._failover(e)

    def _step(self, batch_size: int) -> None:
        samples = self._average_gradients(batch_size)
        error: BaseException | None = None
        if self.is_speaker:
            try:
                self.swarm.step(batch_size=samples)
            except Exception as e:  # told to the other ranks, then raised here
                error = e
        elif self._local_opt is not None:
            self._local_opt.step()

        header = torch.zeros(6, dtype=torch.float64, device=self._device)
        header[:2] = _checksum(self.params).to(self._device)
        header[2] = self.swarm.local_epoch if self.swarm is not None else 0
        header[3] = 1.0 if error is not None else 0.0
        mirrored = self._mirrored_optimizer()
        if mirrored is not None:
            header[4:] = _checksum(_state_tensors(mirrored)).to(self._device)
        headers = self._all_gather(header)
        speaker = headers[0]
        if speaker[3] != 0:
            message = self._broadcast_object(
                f"{type(error).__name__}: {error}" if error is not None else None
            )
            if error is not None:
                raise error
            raise SiteError(f"the speaker (rank {self.speaker_rank}) failed: {message}")
        self._epoch = int(speaker[2])
        if any(not torch.equal(h[:2], speaker[:2]) for h in headers[1:]):
            self._broadcast_params()
            self.parameter_broadcasts += 1
        if self._local_opt is not None and any(
            not torch.equal(h[4:], speaker[4:]) for h in headers[1:]
        ):
            # a rank's mirror of the inner optimizer drifted (the speaker skipped an inner
            # step to load the swarm's state, say): its state follows the speaker's
            inner = self._mirrored_optimizer()
            state = self._broadcast_object(inner.state_dict() if self.is_speaker else None)
            if not self.is_speaker:
                self._local_opt.load_state_dict(state)
            self.mirror_resyncs += 1
        if self.replicate_state and self._replicated_epoch != self._epoch:
            self._replicate_state()

    def _mirrored_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps the non-speakers mirror: the speaker's inner
        optimizer, their ``local_optimizer``; None without a mirror."""
        if self._local_opt is None:
            return None
        if self.is_speaker:
            return self.swarm.inner_optimizer
        return self._local_opt

    def _average_gradients(self, batch_size: int) -> int:
        """All-reduce the gradients weighted by each rank's batch; returns the site's
        batch (the sum)."""
        count = torch.tensor([float(batch_size)], dtype=torch.float64, device=self._device)
        grads = []
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        buckets = _buckets(grads)
        flats = [torch.cat([grads[i].detach().reshape(-1) for i in idx]) for idx in buckets]
        for flat in flats:
            flat.mul_(batch_size)
        self._all_reduce(count)
        for flat in flats:
            self._all_reduce(flat)
        total = float(count.item())
        with torch.no_grad():
            for idx, flat in zip(buckets, flats, strict=True):
                flat.div_(total)
                _unflatten_into(flat, [grads[i] for i in idx])
        return round(total)

    # ------------------------------------------------------------------ site collectives

    def _collective(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # gloo: RuntimeError/DistBackendError when a peer is gone
            raise _RankLost(f"{what} among ranks {self.members} failed: {e}") from e

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        self._collective("all-reduce", lambda: dist.all_reduce(tensor, group=self._group))

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in self.members]
        self._collective("all-gather", lambda: dist.all_gather(out, tensor, group=self._group))
        return out

    def _broadcast_object(self, obj: Any) -> Any:
        box = [obj if self.is_speaker else None]

        def run() -> None:
            dist.broadcast_object_list(
                box, src=self.speaker_rank, group=self._group, device=self._device
            )

        self._collective("object broadcast", run)
        return box[0]

    def _broadcast_params(self) -> None:
        """The speaker's parameters to every rank, received into a staging buffer first
        so that a broadcast cut short by a death leaves the old parameters intact."""
        buckets = _buckets(self.params)
        for idx in buckets:
            tensors = [self.params[i] for i in idx]
            if self.is_speaker:
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            else:
                flat = torch.empty(
                    sum(t.numel() for t in tensors),
                    dtype=tensors[0].dtype,
                    device=tensors[0].device,
                )
            self._collective(
                "parameter broadcast",
                lambda flat=flat: dist.broadcast(flat, src=self.speaker_rank, group=self._group),
            )
            if not self.is_speaker:
                with torch.no_grad():
                    _unflatten_into(flat, tensors)

    def _replicate_state(self) -> None:
        state = None
        if self.is_speaker:
            state = {"epoch": self._epoch, "state": self.swarm.state_dict()}
        state = self._broadcast_object(state)
        self._standby = state["state"]
        self._replicated_epoch = self._epoch

    # ------------------------------------------------------------------ forming a site

    def _check_same_model(self) -> None:
        mine = [
            (name, tuple(p.shape), str(p.dtype))
            for name, p in zip(self.names, self.params, strict=True)
        ]
        gathered: list[Any] = [None] * len(self.members)
        self._collective(
            "model check", lambda: dist.all_gather_object(gathered, mine, group=self._group)
        )
        problem = _describe_mismatch(dict(zip(self.members, gathered, strict=True)))
        if problem is not None:
            raise SiteMismatch(f"the ranks of the site disagree on the model: {problem}")

    def _form_site(self, resync: bool) -> None:
        """With ``self.members`` and ``self._group`` set: the speaker's parameters (and on
        a failover its state and epoch) to every rank, then the speaker joins the swarm
        if it is not in it yet."""
        if resync:
            if self.is_speaker and self.swarm is not None:
                self._standby = self.swarm.state_dict()
                self._epoch = self.swarm.local_epoch
            state = self._broadcast_object(
                {"epoch": self._epoch, "state": self._standby} if self.is_speaker else None
            )
            self._epoch, self._standby = state["epoch"], state["state"]
            self._replicated_epoch = self._epoch
        self._broadcast_params()
        failure = None
        if self.is_speaker and self.swarm is None:
            try:
                self._join_swarm()
            except Exception as e:
                failure = e
        message = self._broadcast_object(
            f"{type(failure).__name__}: {failure}" if failure is not None else None
        )
        if failure is not None:
            raise failure
        if message is not None:
            raise SiteError(f"the speaker (rank {self.speaker_rank}) could not join: {message}")

    def _join_swarm(self) -> None:
        dht = self._dht_factory()
        try:
            swarm = self._swarm_factory(dht, list(self.params))
        except BaseException:
            dht.shutdown()
            raise
        try:
            if self._local_opt is not None and not isinstance(
                getattr(swarm, "inner_optimizer", None), torch.optim.Optimizer
            ):
                raise ValidationError(
                    "local_optimizer mirrors the swarm optimizer's inner_optimizer (as "
                    f"DiLoCoOptimizer has); {type(swarm).__name__} has none"
                )
            if self._standby is not None:
                state = self._standby
                if isinstance(swarm, DiLoCoOptimizer) and self._local_opt is not None:
                    # our mirror of the inner optimizer is fresher than the last epoch's
                    state = {**state, "inner": self._local_opt.state_dict()}
                swarm.load_state_dict(state)
                # the swarm's state is at least as fresh as the site's last epoch: take it
                # (with nobody else in the swarm this returns at once, keeping ours)
                swarm.load_state_from_peers()
        except BaseException:
            swarm.shutdown()
            dht.shutdown()
            raise
        self.dht, self.swarm = dht, swarm
        logger.info(
            "site of ranks %s: rank %d speaks for it in the swarm as %s (epoch %d)",
            self.members,
            self.rank,
            dht.peer_id,
            swarm.local_epoch,
        )

    # ------------------------------------------------------------------ failover

    def _failover(self, cause: _RankLost) -> None:
        logger.warning("site of ranks %s lost a rank (%s); electing survivors", self.members, cause)
        for _ in range(len(self.members)):  # each round loses at least one rank
            self._generation += 1
            old_speaker = self.speaker_rank
            members = self._elect(self._generation)
            self.members = members
            self.failovers += 1
            logger.warning(
                "site re-formed with ranks %s; rank %d speaks%s",
                members,
                self.speaker_rank,
                "" if old_speaker == self.speaker_rank else f" (rank {old_speaker} is gone)",
            )
            try:
                self._group = self._collective(
                    "forming a group",
                    lambda members=members: dist.new_group(
                        members,
                        timeout=datetime.timedelta(seconds=self.timeout),
                        use_local_synchronization=True,
                    ),
                )
                self._form_site(resync=True)
                return
            except _RankLost as e:
                cause = e
                logger.warning("another rank was lost while re-forming the site: %s", e)
        raise SiteError(f"the site could not be re-formed: {cause}")

    def _key(self, *parts: Any) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    def _elect(self, generation: int) -> list[int]:
        """Agree with the other survivors on who is left (see the module docstring)."""
        members_key = self._key("gen", generation, "members")
        alive_key = lambda rank: self._key("gen", generation, "alive", rank)  # noqa: E731
        try:
            self._store.set(alive_key(self.rank), "1")
            seen: dict[int, tuple[int, float]] = {}
            deadline = time.monotonic() + self.election_timeout
            while not self._store.check([members_key]):
                now = time.monotonic()
                waiting = []
                for rank in self.members:
                    if rank == self.rank or self._store.check([alive_key(rank)]):
                        continue
                    beats = self._store.add(self._key("heartbeat", rank), 0)
                    last = seen.get(rank)
                    if last is None or last[0] != beats:
                        seen[rank] = (beats, now)
                        waiting.append(rank)
                    elif now - last[1] < self.heartbeat_timeout:
                        waiting.append(rank)
                if not waiting or now > deadline:
                    alive = [r for r in self.members if self._store.check([alive_key(r)])]
                    self._store.compare_set(members_key, "", ",".join(map(str, alive)))
                    break
                time.sleep(0.05)
            members = [int(r) for r in self._store.get(members_key).decode().split(",")]
        except Exception as e:
            raise SiteError(
                f"rank {self.rank} cannot reach the site's store to elect survivors ({e}); "
                "a store hosted by a rank dies with it: start the ranks with torchrun or "
                "python -m swarmgrad.optim.site_launch, whose store outlives them"
            ) from e
        if self.rank not in members:
            raise SiteError(
                f"rank {self.rank} was left out of the site re-formed with ranks {members} "
                "(it did not answer the election in time)"
            )
        return members

    def _beat(self) -> None:
        key = self._key("heartbeat", self.rank)
        while not self._stop.is_set():
            try:
                self._store.add(key, 1)
            except Exception as e:  # the store is gone: an election will say so
                logger.debug("site heartbeat of rank %d failed: %r", self.rank, e)
            self._stop.wait(self.heartbeat_interval)

    # ------------------------------------------------------------------ shutdown

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._heartbeat.is_alive() and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(self.heartbeat_interval + 5.0)

    def shutdown(self) -> None:
        """Leave: the speaker says goodbye to the swarm; every rank stops its heartbeat
        (idempotent; does not destroy the process groups, which belong to the caller)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.swarm is not None:
                self.swarm.shutdown()
            if self.dht is not None:
                self.dht.shutdown()
        finally:
            self.swarm = self.dht = None
            self._stop_heartbeat()

    def __repr__(self) -> str:
        return (
            f"SiteOptimizer(rank={self.rank}, members={self.members}, "
            f"speaker={self.speaker_rank}, epoch={self.local_epoch})"
        )


# ---------------------------------------------------------------------- helpers


def _split_params(params: Iterable[Any]) -> tuple[list[str], list[torch.Tensor]]:
    names, tensors = [], []
    for index, item in enumerate(params):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, tensor = item
        else:
            name, tensor = f"parameter {index}", item
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(
                f"params must be tensors or (name, tensor) pairs; {name} is {type(tensor).__name__}"
            )
        names.append(name)
        tensors.append(tensor)
    if not tensors:
        raise ValidationError("SiteOptimizer got no parameters")
    return names, tensors


def _describe_mismatch(models: dict[int, list[tuple[str, tuple, str]]]) -> str | None:
    """None if every rank has the same tensors; else which tensor differs on which ranks."""
    counts = {rank: len(model) for rank, model in models.items()}
    if len(set(counts.values())) > 1:
        by_count = _group_ranks(counts)
        return "number of parameters: " + "; ".join(
            f"{count} on {_ranks(ranks)}" for count, ranks in by_count.items()
        )
    for index in range(next(iter(counts.values()))):
        at = {rank: model[index] for rank, model in models.items()}
        shapes = {rank: (shape, dtype) for rank, (_, shape, dtype) in at.items()}
        if len(set(shapes.values())) > 1:
            names = {name for name, _, _ in at.values()}
            return f"{' / '.join(sorted(names))} (tensor {index}) is " + "; ".join(
                f"{list(shape)} {dtype} on {_ranks(ranks)}"
                for (shape, dtype), ranks in _group_ranks(shapes).items()
            )
    return None


def _group_ranks(values: dict[int, Any]) -> dict[Any, list[int]]:
    grouped: dict[Any, list[int]] = {}
    for rank in sorted(values):
        grouped.setdefault(values[rank], []).append(rank)
    return grouped


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _buckets(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of the tensors grouped by (dtype, device), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    return list(groups.values())


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset : offset + count].view_as(tensor))
        offset += count


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors in a fixed order (parameters, then keys)."""
    found = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            found += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return found


def _checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two float64 sums (values, squares): equal parameters give equal sums, and a change
    of one element's last bit shows in them."""
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for tensor in tensors:
            values = tensor.detach().to(torch.float64)
            total[0] += values.sum().cpu()
            total[1] += values.square().sum().cpu()
    return total
