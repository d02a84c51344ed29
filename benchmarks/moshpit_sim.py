"""Moshpit averaging, simulated two ways: an algorithm-level model and the real protocol.

Both answer the question of the Moshpit SGD paper's averaging experiment: N peers hold
random scalars; in each round every peer fails (sits the round out) with probability p,
the others average in their Moshpit groups; how many rounds until the mean squared
deviation from the true global mean falls below a threshold (1e-9)?

* :func:`model_moshpit` is the algorithm with numpy: peers with equal group bits form
  groups of up to M in a random order (the order in which matchmaking would admit them),
  groups smaller than ``min_group_size`` do nothing, members average and move their group
  bits with the same functions as the real protocol
  (:mod:`swarmgrad.averaging.matchmaking.group_bits`). Fast: the full paper table in seconds.
  :func:`model_allreduce` (one global all-reduce that fails when any peer fails) and
  :func:`model_gossip` (random disjoint pairs average) are the baselines.
* :func:`run_protocol` runs the real thing on the simulated network
  (:mod:`swarmgrad.net.sim`, virtual clock): a Kademlia DHT swarm, one
  :class:`~swarmgrad.averaging.matchmaking.driver.Matchmaking` per peer, group keys in the DHT.
  Each peer's scalar travels in its join request (``data_for_gather``) and every member
  averages the scalars of the GroupInfo it receives (all members receive the same one).
  It also counts how many keys the protocol split into more groups than the model would,
  a direct check that both group peers alike.

Initial positions: peers take distinct random cells of the M^d grid, as in the paper; the
group bits of a peer are its coordinates on axes 1..d-1 (round 0 averages along axis 0).
"""

from __future__ import annotations

import asyncio
import math
import random
import struct
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import numpy as np

from swarmgrad.averaging.matchmaking.driver import Matchmaking
from swarmgrad.averaging.matchmaking.group_bits import (
    bits_per_axis_for,
    coordinate_of_rank,
    coordinates_to_bits,
    shift_in,
)
from swarmgrad.dht.node import DHTNode
from swarmgrad.utils.errors import ValidationError

__all__ = [
    "ProtocolRun",
    "build_dht_swarm",
    "initial_group_bits",
    "model_allreduce",
    "model_gossip",
    "model_moshpit",
    "run_protocol",
]

SIM_EPOCH = 1.8e9  # virtual DHT time starts at a plausible wall-clock value


def initial_group_bits(
    num_peers: int, grid_side: int, grid_dims: int, rng: random.Random
) -> list[str]:
    """Group bits of ``num_peers`` peers placed on distinct random cells of the grid."""
    cells = grid_side**grid_dims
    if num_peers > cells:
        raise ValidationError(f"{num_peers} peers do not fit on {cells} distinct grid cells")
    bits_per_axis = bits_per_axis_for(grid_side)
    if 2**bits_per_axis != grid_side:
        raise ValidationError(f"the grid side must be a power of two, got {grid_side}")
    result = []
    for cell in rng.sample(range(cells), num_peers):
        coordinates = [(cell // grid_side**axis) % grid_side for axis in range(grid_dims)]
        result.append(coordinates_to_bits(coordinates[1:], bits_per_axis))
    return result


def _mse(values: np.ndarray, mean: float) -> float:
    return float(np.mean((values - mean) ** 2))


def model_moshpit(
    num_peers: int,
    failure_prob: float,
    *,
    grid_side: int = 32,
    grid_dims: int = 2,
    min_group_size: int = 2,
    target_mse: float = 1e-9,
    max_rounds: int = 50,
    rotate: bool = True,
    seed: int = 0,
) -> int | None:
    """Rounds until the MSE is below ``target_mse`` (None if not within ``max_rounds``)."""
    rng = random.Random(seed)
    values = np.random.default_rng(seed).standard_normal(num_peers)
    mean = float(values.mean())
    bits = initial_group_bits(num_peers, grid_side, grid_dims, rng)
    bits_per_axis = bits_per_axis_for(grid_side)
    ranks = list(range(num_peers))  # stands in for the sorted order of peer ids
    rng.shuffle(ranks)
    for round_number in range(1, max_rounds + 1):
        by_key: dict[str, list[int]] = {}
        for peer in range(num_peers):
            if rng.random() >= failure_prob:
                by_key.setdefault(bits[peer], []).append(peer)
        for members in by_key.values():
            rng.shuffle(members)  # the (ready_by, peer id) order in which leaders admit
            for start in range(0, len(members), grid_side):
                group = members[start : start + grid_side]
                if len(group) < min_group_size:
                    continue
                values[group] = values[group].mean()
                group_id = rng.randbytes(20)
                for rank, peer in enumerate(sorted(group, key=ranks.__getitem__)):
                    coordinate = coordinate_of_rank(rank, group_id, grid_side, rotate=rotate)
                    bits[peer] = shift_in(bits[peer], coordinate, bits_per_axis)
        if _mse(values, mean) < target_mse:
            return round_number
    return None


def model_allreduce(
    num_peers: int, failure_prob: float, *, max_rounds: int = 50, seed: int = 0
) -> int | None:
    """One all-reduce over all peers per round, which fails (changes nothing) when any
    peer fails and otherwise gives everyone the exact mean: the round of the first
    success, or None."""
    rng = np.random.default_rng(seed)
    for round_number in range(1, max_rounds + 1):
        if not (rng.random(num_peers) < failure_prob).any():
            return round_number
    return None


def model_gossip(
    num_peers: int,
    failure_prob: float,
    *,
    target_mse: float = 1e-9,
    max_rounds: int = 50,
    seed: int = 0,
) -> int | None:
    """Each round, the live peers pair up at random and each pair averages."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(num_peers)
    mean = float(values.mean())
    for round_number in range(1, max_rounds + 1):
        alive = np.flatnonzero(rng.random(num_peers) >= failure_prob)
        alive = rng.permutation(alive)
        pairs = alive[: len(alive) // 2 * 2].reshape(-1, 2)
        values[pairs] = values[pairs].mean(axis=1, keepdims=True)
        if _mse(values, mean) < target_mse:
            return round_number
    return None


# ---------------------------------------------------------------------- the real protocol


async def build_dht_swarm(
    network,
    num_peers: int,
    rng: random.Random,
    *,
    client_mode: Container[int] = (),
    **node_kwargs,
) -> list[DHTNode]:
    """``num_peers`` DHT nodes on the simulated network, each bootstrapped from up to 3
    random earlier public ones, with DHT time on the virtual clock. Nodes whose index is
    in ``client_mode`` (never the first) run client-mode peers: no listener at all."""
    from swarmgrad.net.sim.backend import create_sim_peer

    loop = asyncio.get_running_loop()
    node_kwargs.setdefault("time_fn", lambda: SIM_EPOCH + loop.time())
    first = await create_sim_peer(network, rng=rng, keepalive_interval=None)
    nodes = [await DHTNode.create(first, [], **node_kwargs)]
    public = [nodes[0]]

    async def start_one(index: int, initial: list[str]) -> DHTNode:
        client = index in client_mode
        peer = await create_sim_peer(network, rng=rng, keepalive_interval=None, client_mode=client)
        try:
            return await DHTNode.create(peer, initial, client_mode=client, **node_kwargs)
        except BaseException:
            await peer.shutdown()
            raise

    while len(nodes) < num_peers:
        indices = range(len(nodes), min(len(nodes) + 50, num_peers))
        initial = [
            [str(n.peer.get_visible_maddrs()[0]) for n in rng.sample(public, min(3, len(public)))]
            for _ in indices
        ]
        started = await asyncio.gather(
            *(start_one(i, p) for i, p in zip(indices, initial, strict=True))
        )
        nodes.extend(started)
        public.extend(n for i, n in zip(indices, started, strict=True) if i not in client_mode)
    return nodes


@dataclass
class ProtocolRun:
    """What :func:`run_protocol` observed."""

    rounds: int | None  # rounds until the MSE fell below target, None if not reached
    mse: list[float] = field(default_factory=list)  # after each round
    group_sizes: list[list[int]] = field(default_factory=list)  # per round
    extra_splits: int = 0  # keys split into more groups than ceil(n / M) would need
    lonely: int = 0  # live peers that found no group although another peer shared their key


async def run_protocol(
    network,
    num_peers: int,
    failure_prob: float,
    *,
    grid_side: int = 32,
    grid_dims: int = 2,
    min_group_size: int = 2,
    target_mse: float = 1e-9,
    max_rounds: int = 50,
    seed: int = 0,
    min_matchmaking_time: float = 2.0,
    request_timeout: float = 1.0,
    progress: Callable[[int, float], None] | None = None,
) -> ProtocolRun:
    """The experiment of :func:`model_moshpit` with real DHT + matchmaking on ``network``
    (call inside :func:`~swarmgrad.net.sim.run_simulation`)."""
    rng = random.Random(seed)
    values = np.random.default_rng(seed).standard_normal(num_peers)
    mean = float(values.mean())
    nodes = await build_dht_swarm(network, num_peers, rng)
    bits = initial_group_bits(num_peers, grid_side, grid_dims, rng)
    matchmakers = [
        Matchmaking(
            node.peer,
            node,
            prefix="moshpit",
            target_group_size=grid_side,
            min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            initial_group_bits=bits[i],
            rng=random.Random(rng.getrandbits(64)),
        )
        for i, node in enumerate(nodes)
    ]
    run = ProtocolRun(rounds=None)
    timeout = 4 * min_matchmaking_time + 4 * request_timeout

    async def one_peer(i: int) -> tuple[int, bytes | None, float]:
        group = await matchmakers[i].look_for_group(
            data_for_gather=struct.pack("<d", values[i]), timeout=timeout
        )
        if group is None:
            return i, None, values[i]
        scalars = [struct.unpack("<d", g)[0] for g in group.gathered]
        if not all(math.isfinite(x) for x in scalars):
            raise ValidationError(f"group {group.group_id.hex()[:12]} gathered a non-finite value")
        return i, group.group_id, sum(scalars) / len(scalars)

    try:
        loop = asyncio.get_running_loop()
        for round_number in range(1, max_rounds + 1):
            started = loop.time()
            alive = [i for i in range(num_peers) if rng.random() >= failure_prob]
            keys = {i: matchmakers[i].get_group_bits() for i in alive}
            results = await asyncio.gather(*(one_peer(i) for i in alive))
            groups: dict[bytes, list[int]] = {}
            for i, group_id, value in results:
                values[i] = value
                if group_id is not None:
                    groups.setdefault(group_id, []).append(i)
            run.group_sizes.append(sorted(len(g) for g in groups.values()))
            _count_splits(run, keys, groups, results, grid_side)
            run.mse.append(_mse(values, mean))
            if progress is not None:
                progress(round_number, run.mse[-1])
            if run.mse[-1] < target_mse:
                run.rounds = round_number
                break
            # the next round starts together, as in a synchronous training step
            await asyncio.sleep(max(0.0, started + timeout + 1.0 - loop.time()))
    finally:
        for matchmaking in matchmakers:
            await matchmaking.shutdown()
        for node in nodes:
            await node.shutdown()
            await node.peer.shutdown()
    return run


def _count_splits(
    run: ProtocolRun,
    keys: dict[int, str],
    groups: dict[bytes, list[int]],
    results: list[tuple[int, bytes | None, float]],
    grid_side: int,
) -> None:
    peers_per_key: dict[str, int] = {}
    for key in keys.values():
        peers_per_key[key] = peers_per_key.get(key, 0) + 1
    groups_per_key: dict[str, int] = {}
    for members in groups.values():
        key = keys[members[0]]
        groups_per_key[key] = groups_per_key.get(key, 0) + 1
    for key, count in groups_per_key.items():
        run.extra_splits += max(0, count - math.ceil(peers_per_key[key] / grid_side))
    run.lonely += sum(1 for i, g, _ in results if g is None and peers_per_key[keys[i]] > 1)
