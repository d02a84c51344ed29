"""Stage training and rebalancing on loopback: a stage's peers average their parameters,
a joining peer downloads parameters and optimizer state, and a peer of an over-served
stage moves to the bottleneck and serves it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from swarmgrad.dht import DHT
from swarmgrad.pipeline.peer import StagePeer, StagePeerOptions, read_stage_loads
from swarmgrad.pipeline.rebalance import RebalanceOptions
from swarmgrad.pipeline.server import StageServerOptions
from swarmgrad.pipeline.training import StageAverager, StageTrainingOptions
from swarmgrad.utils.errors import ValidationError
from tests.helpers.pipeline import PipelineSwarm, make_backend

TRAINING = StageTrainingOptions(
    average_period=3600.0, averaging_timeout=20.0, min_matchmaking_time=1.0, state_timeout=30.0
)


@pytest.fixture(scope="module")
def swarm():
    with PipelineSwarm() as swarm:
        yield swarm


def test_the_peers_of_a_stage_average_their_parameters(swarm):
    name = swarm.new_name()
    torch.manual_seed(0)
    servers = [swarm.serve(name, 0, 1, nn.Linear(4, 4), 4) for _ in range(2)]
    before = [[p.detach().clone() for p in s.backend.module.parameters()] for s in servers]
    averagers = [StageAverager(s.dht, name, 0, s.backend, TRAINING) for s in servers]
    try:
        results = [None, None]

        def run(i):
            results[i] = averagers[i].average_once()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [True, True]
        for i, params in enumerate(
            zip(*(s.backend.module.parameters() for s in servers), strict=True)
        ):
            mean = (before[0][i] + before[1][i]) / 2
            for param in params:
                torch.testing.assert_close(param.detach(), mean)
    finally:
        for averager in averagers:
            averager.shutdown()


def test_in_diloco_mode_the_peers_of_a_stage_step_their_anchor_by_the_mean_pseudo_gradient(
    swarm,
):
    name = swarm.new_name()
    servers = []
    for _ in range(2):
        torch.manual_seed(0)  # the same initial weights: the anchor of both peers
        servers.append(swarm.serve(name, 0, 1, nn.Linear(4, 4), 4))
    anchor = [p.detach().clone() for p in servers[0].backend.module.parameters()]
    options = StageTrainingOptions(
        average_period=60, averaging_timeout=30, min_matchmaking_time=1.0, mode="diloco",
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )  # fmt: skip
    averagers = [StageAverager(s.dht, name, 0, s.backend, options) for s in servers]
    try:
        with torch.no_grad():  # local steps: each peer moved its own way since the anchor
            for k, server in enumerate(servers):
                for p in server.backend.module.parameters():
                    p.add_(torch.full_like(p, 1.0 + k))
        moved = [[p.detach().clone() for p in s.backend.module.parameters()] for s in servers]
        results = [None, None]

        def run(i):
            results[i] = averagers[i].average_once()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [True, True]
        for i, start in enumerate(anchor):
            pseudo_gradient = ((start - moved[0][i]) + (start - moved[1][i])) / 2
            expected = start - 0.5 * pseudo_gradient  # outer SGD, lr 0.5
            for server in servers:
                param = list(server.backend.module.parameters())[i]
                torch.testing.assert_close(param.detach(), expected)
            for averager in averagers:
                torch.testing.assert_close(averager._anchor[i], expected)
    finally:
        for averager in averagers:
            averager.shutdown()


def test_bad_stage_training_options_are_refused_naming_them():
    with pytest.raises(ValidationError, match="mode must be one of"):
        StageTrainingOptions(mode="gradients")
    with pytest.raises(ValidationError, match="outer_optimizer needs"):
        StageTrainingOptions(outer_optimizer=lambda params: torch.optim.SGD(params, lr=1))


def test_a_joining_peer_downloads_parameters_and_optimizer_state(swarm):
    name = swarm.new_name()
    torch.manual_seed(1)
    donor = swarm.serve(name, 0, 1, nn.Linear(4, 4), 4)
    donor.backend.optimizer = torch.optim.SGD(
        donor.backend.module.parameters(), lr=0.1, momentum=0.9
    )
    pipe = swarm.pipeline(name, 1, timeout=20)
    for _ in range(3):  # builds momentum buffers on the donor
        pipe(torch.randn(2, 4)).square().sum().backward()
    donor_averager = StageAverager(donor.dht, name, 0, donor.backend, TRAINING)
    dht = DHT(start=True, initial_peers=swarm.addrs)
    swarm.dhts.append(dht)
    module = nn.Linear(4, 4)
    backend = make_backend(f"{name}.0", module, 4)
    backend.optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    joiner = StageAverager(dht, name, 0, backend, TRAINING)
    try:
        assert joiner.load_state_from_peers()
        for mine, theirs in zip(
            module.parameters(), donor.backend.module.parameters(), strict=True
        ):
            torch.testing.assert_close(mine, theirs)
        donor_state = donor.backend.optimizer.state_dict()["state"]
        my_state = backend.optimizer.state_dict()["state"]
        assert sorted(my_state) == sorted(donor_state) and donor_state
        for key in donor_state:
            torch.testing.assert_close(
                my_state[key]["momentum_buffer"], donor_state[key]["momentum_buffer"]
            )
        assert backend.update_count == donor.backend.update_count == 3
    finally:
        joiner.shutdown()
        donor_averager.shutdown()


class Slow(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.linear, self.seconds = nn.Linear(4, 4), seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


def test_a_peer_of_the_best_served_stage_moves_to_the_bottleneck(swarm):
    name = swarm.new_name()
    torch.manual_seed(2)
    modules = [nn.Linear(4, 4), Slow(0.05)]  # stage 1 is the bottleneck

    def factory(stage):
        module = nn.Linear(4, 4) if stage == 0 else Slow(0.05)
        module.load_state_dict(modules[stage].state_dict())
        return make_backend(f"{name}.{stage}", module, 4)

    options = StagePeerOptions(
        server=StageServerOptions(update_period=0.5),
        training=TRAINING,
        rebalance=RebalanceOptions(interval=0.1, hysteresis=0.2),
    )
    peers = []
    try:
        for stage in (0, 0, 1):
            dht = DHT(start=True, initial_peers=swarm.addrs)
            swarm.dhts.append(dht)
            peer = StagePeer(dht, name, 2, stage, factory, options)
            peer.start(background=False)
            peers.append(peer)
        with torch.no_grad():  # the bottleneck's peer has trained: its weights are not the init
            peers[2].server.backend.module.linear.weight.add_(1.0)
        pipe = swarm.pipeline(name, 2, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # traffic until every record shows a speed
            for _ in range(4):
                pipe(torch.randn(2, 4)).sum().backward()
            loads = peers[0].dht.run_coroutine(lambda _d, node: read_stage_loads(node, name, 2))
            if sum(len(s) for s in loads) == 3 and all(v > 0 for s in loads for v in s.values()):
                break
        # peers read the records at slightly different moments and may each see the
        # other as the one to move: checks repeat (as every interval does) until one moves
        moved = []
        for round_ in range(10):
            now = time.monotonic() + round_  # past the interval each round
            moves = [peer.check_rebalance(now) for peer in peers]
            moved = [p for p, m in zip(peers, moves, strict=True) if m is not None]
            if moved:
                break
            time.sleep(0.6)  # a record refresh (update_period 0.5 s): the views converge
        assert len(moved) == 1 and moves[2] is None
        mover = moved[0]
        assert mover.stage == 1 and mover.moves[0].from_stage == 0
        # it took the bottleneck stage's trained weights, not a fresh init
        torch.testing.assert_close(
            mover.server.backend.module.linear.weight, peers[2].server.backend.module.linear.weight
        )
        loads = peers[0].dht.run_coroutine(lambda _d, node: read_stage_loads(node, name, 2))
        assert mover.dht.peer_id in loads[1] and mover.dht.peer_id not in loads[0]
        assert len(loads[0]) == 1  # never empty
        time.sleep(pipe.caller.options.refresh_period)
        for _ in range(3):  # the pipeline keeps working across the move
            pipe(torch.randn(2, 4)).sum().backward()
        # nobody else moves now: stage 0 has one peer left
        assert all(p.check_rebalance(time.monotonic() + 10) is None for p in peers)
    finally:
        for peer in peers:
            peer.shutdown()


def test_of_two_peers_claiming_to_leave_one_stage_at_once_exactly_one_wins(swarm):
    name = swarm.new_name()
    options = StagePeerOptions(training=None, rebalance=RebalanceOptions(interval=1.0))
    peers = []
    for _ in range(2):
        dht = DHT(start=True, initial_peers=swarm.addrs)
        swarm.dhts.append(dht)
        peers.append(
            StagePeer(
                dht, name, 2, 0, lambda s: make_backend(f"{name}.{s}", nn.Linear(4, 4), 4), options
            )
        )
    results = [None, None]

    def claim(i):
        results[i] = peers[i]._claim_move(0)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results) == [False, True]
    winner = results.index(True)
    assert peers[winner]._claim_move(0)  # its claim holds for it
    assert not peers[1 - winner]._claim_move(0)  # and still excludes the other
