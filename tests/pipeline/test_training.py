"""Stage training and rebalancing on loopback: a stage's peers average their parameters
(or DiLoCo pseudo-gradients, or accumulated gradients), a joining peer downloads
parameters and optimizer state, and a peer of an over-served stage moves to the
bottleneck and serves it."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

from swarmgrad.dht import DHT
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import ModuleBackend
from swarmgrad.pipeline import protocol
from swarmgrad.pipeline.peer import StagePeer, StagePeerOptions, read_stage_loads
from swarmgrad.pipeline.protocol import BackwardAnswer, BackwardRequest
from swarmgrad.pipeline.rebalance import RebalanceOptions
from swarmgrad.pipeline.server import StageServerOptions
from swarmgrad.pipeline.training import StageAverager, StageTrainingOptions
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.loop_thread import run_coroutine
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


GRADIENTS = StageTrainingOptions(
    average_period=3600.0, averaging_timeout=20.0, min_matchmaking_time=1.0, mode="gradients"
)


def gradient_backend(name, module, lr=0.5, min_batch_size=1):
    """SGD (scale-sensitive, unlike Adam's first step); a backward pool that waits up to
    10 s for ``min_batch_size`` samples, so concurrent micro-batches merge."""
    return ModuleBackend(
        name,
        module,
        optimizer=torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9),
        args_schema=(BatchTensorDescriptor(4),),
        min_batch_size=min_batch_size,
        timeout=10.0,
    )


def micro_batch(n, seed):
    """Inputs, and the output gradients of the micro-batch's mean loss
    ``mean_s <y_s, r_s>`` (what a trainer's mean loss sends back)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randn(n, 3, generator=generator) / n


def send_backward(pipe, server, name, x, grad_out):
    peer = pipe.caller.peer
    peer.add_addresses(server.dht.peer_id, server.dht.get_visible_maddrs())
    request = BackwardRequest(name, 0, (x,), (grad_out,))
    reply = run_coroutine(
        peer.call(server.dht.peer_id, protocol.BACKWARD, request.encode(), timeout=30)
    )
    return BackwardAnswer.decode(reply).grad_inputs[0]


def mean_gradient(module, batches):
    """The mean gradient per sample over every micro-batch, as one big batch gives it,
    and each micro-batch's input gradients."""
    module = copy.deepcopy(module)
    total = sum(len(x) for x, _ in batches)
    input_grads = []
    for x, grad_out in batches:
        leaf = x.clone().requires_grad_()
        module(leaf).backward(grad_out * len(x) / total)  # sum_s <y_s, r_s> / total
        input_grads.append(leaf.grad * total / len(x))
    return [p.grad.clone() for p in module.parameters()], input_grads


def sgd_steps(module, steps, lr=0.5):
    """The weights after one SGD step (momentum 0.9) per list of gradients in ``steps``."""
    module = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    for grads in steps:
        for param, grad in zip(module.parameters(), grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()
    return [p.detach() for p in module.parameters()]


def run_together(averagers):
    results = [None] * len(averagers)

    def run(i):
        results[i] = averagers[i].average_once()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_in_gradients_mode_peers_step_together_on_the_sample_weighted_mean_gradient(swarm):
    name = swarm.new_name()
    torch.manual_seed(3)
    initial = nn.Linear(4, 3)
    # peer 0 merges its two micro-batches (2 and 3 samples) into one backward of 5
    backends = [
        gradient_backend(f"{name}.0", copy.deepcopy(initial), min_batch_size=5),
        gradient_backend(f"{name}.0", copy.deepcopy(initial)),
    ]
    servers = [swarm.serve(name, 0, 1, None, 4, backend=b) for b in backends]
    averagers = [StageAverager(s.dht, name, 0, s.backend, GRADIENTS) for s in servers]
    pipe = swarm.pipeline(name, 1, timeout=30)
    fed = [[micro_batch(2, 0), micro_batch(3, 1)], [micro_batch(4, 2)]]
    try:
        answers = [None, None]

        def feed(i):
            answers[i] = send_backward(pipe, servers[0], name, *fed[0][i])

        threads = [threading.Thread(target=feed, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        answers.append(send_backward(pipe, servers[1], name, *fed[1][0]))
        pool = backends[0].backward_pool.stats
        assert list(pool.recent_batch_sizes) == [5] and list(pool.recent_batch_requests) == [2]
        # input gradients go back unweighted, as if each micro-batch ran alone
        for answer, (x, grad_out) in zip(answers, fed[0] + fed[1], strict=True):
            _, (want,) = mean_gradient(initial, [(x, grad_out)])
            torch.testing.assert_close(answer, want)
        for backend in backends:  # nothing stepped yet: gradients wait for the round
            assert backend.update_count == 0
            for param, start in zip(backend.module.parameters(), initial.parameters(), strict=True):
                assert torch.equal(param, start)
        assert run_together(averagers) == [True, True]
        expected = sgd_steps(initial, [mean_gradient(initial, fed[0] + fed[1])[0]])
        for param_0, param_1, want in zip(
            backends[0].module.parameters(), backends[1].module.parameters(), expected, strict=True
        ):
            assert torch.equal(param_0, param_1)  # the replicas stay identical
            torch.testing.assert_close(param_0.detach(), want)
        assert [b.update_count for b in backends] == [1, 1]
        assert [a.rounds for a in averagers] == [1, 1]
        # a round in which nobody served anything steps nobody (momentum would move them)
        assert run_together(averagers) == [True, True]
        assert [b.update_count for b in backends] == [1, 1]
        # one peer served, the other not: both step with the same gradient
        send_backward(pipe, servers[1], name, *micro_batch(3, 4))
        assert run_together(averagers) == [True, True]
        assert [b.update_count for b in backends] == [2, 2]
        for param_0, param_1 in zip(
            backends[0].module.parameters(), backends[1].module.parameters(), strict=True
        ):
            assert torch.equal(param_0, param_1)
    finally:
        for averager in averagers:
            averager.shutdown()


def test_in_gradients_mode_a_lone_peer_trains_and_keeps_serving_during_a_round(swarm):
    name = swarm.new_name()
    torch.manual_seed(4)
    initial = nn.Linear(4, 3)
    backend = gradient_backend(f"{name}.0", copy.deepcopy(initial))
    server = swarm.serve(name, 0, 1, None, 4, backend=backend)
    options = StageTrainingOptions(
        average_period=3600.0, averaging_timeout=4.0, min_matchmaking_time=1.0, mode="gradients"
    )
    averager = StageAverager(server.dht, name, 0, backend, options)
    pipe = swarm.pipeline(name, 1, timeout=30)
    first, second = micro_batch(5, 5), micro_batch(3, 6)
    try:
        assert not averager.average_once()  # nothing served, nobody to meet: no step
        assert backend.update_count == 0 and averager.solo_steps == 0
        send_backward(pipe, server, name, *first)
        result = []
        round_ = threading.Thread(target=lambda: result.append(averager.average_once()))
        round_.start()
        deadline = time.monotonic() + 10
        while averager._samples and time.monotonic() < deadline:
            time.sleep(0.01)  # until the round has taken the first micro-batch's gradient
        started = time.monotonic()
        send_backward(pipe, server, name, *second)  # served while the round looks for peers
        assert round_.is_alive() and time.monotonic() - started < 3.0
        round_.join(30)
        assert result == [False] and averager.solo_steps == 1 and backend.update_count == 1
        assert averager._samples == 3  # the second micro-batch waits for the next round
        assert not averager.average_once()
        assert averager.solo_steps == 2 and backend.update_count == 2
        # both gradients were computed on the initial weights: the second one a round late
        grads = [mean_gradient(initial, [first])[0], mean_gradient(initial, [second])[0]]
        for param, want in zip(backend.module.parameters(), sgd_steps(initial, grads), strict=True):
            torch.testing.assert_close(param.detach(), want)
    finally:
        averager.shutdown()
    assert backend.gradient_sink is None  # after shutdown it steps per backward again


def test_in_gradients_mode_background_rounds_meet_at_the_same_dht_time_boundaries(swarm):
    name = swarm.new_name()
    torch.manual_seed(5)
    initial = nn.Linear(4, 3)
    backends = [gradient_backend(f"{name}.0", copy.deepcopy(initial)) for _ in range(2)]
    servers = [swarm.serve(name, 0, 1, None, 4, backend=b) for b in backends]
    options = StageTrainingOptions(
        average_period=3.0, averaging_timeout=10.0, min_matchmaking_time=1.0, mode="gradients"
    )
    averagers = []
    pipe = swarm.pipeline(name, 1, timeout=30)
    try:
        for server in servers:  # started at different moments: the rounds still line up
            averagers.append(StageAverager(server.dht, name, 0, server.backend, options))
            averagers[-1].start()
            time.sleep(1.3)
        for i, server in enumerate(servers):
            send_backward(pipe, server, name, *micro_batch(2 + i, 10 + i))
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            if all(a._samples == 0 for a in averagers) and all(a.rounds for a in averagers):
                if backends[0].update_count == backends[1].update_count >= 1:
                    break
            time.sleep(0.2)
        for averager in averagers:
            averager.shutdown()
        assert [a.solo_steps for a in averagers] == [0, 0]
        assert backends[0].update_count == backends[1].update_count >= 1
        for param_0, param_1, start in zip(
            backends[0].module.parameters(),
            backends[1].module.parameters(),
            initial.parameters(),
            strict=True,
        ):
            assert torch.equal(param_0, param_1) and not torch.equal(param_0, start)
    finally:
        for averager in averagers:
            averager.shutdown()


def test_in_gradients_mode_a_joining_peer_takes_the_state_and_then_steps_in_lockstep(swarm):
    name = swarm.new_name()
    torch.manual_seed(6)
    initial = nn.Linear(4, 3)
    # no background round during the test: the next multiple of 1e9 s of DHT time is years away
    options = StagePeerOptions(
        server=StageServerOptions(update_period=0.5),
        training=StageTrainingOptions(
            average_period=1e9, averaging_timeout=8.0, min_matchmaking_time=1.0,
            state_timeout=30.0, mode="gradients",
        ),
    )  # fmt: skip

    def factory(stage):
        return gradient_backend(f"{name}.{stage}", copy.deepcopy(initial))

    peers = []
    pipe = swarm.pipeline(name, 1, timeout=30)
    try:
        for _ in range(2):
            dht = DHT(start=True, initial_peers=swarm.addrs)
            swarm.dhts.append(dht)
            peers.append(StagePeer(dht, name, 1, 0, factory, options))
        donor, joiner = peers
        donor.start(background=False)
        send_backward(pipe, donor.server, name, *micro_batch(4, 7))
        assert not donor.averager.average_once()  # alone: a step, momentum buffers
        send_backward(pipe, donor.server, name, *micro_batch(2, 8))  # not applied yet
        deadline = time.monotonic() + 20  # the donor's record must be in the DHT
        while not joiner._stage_has_other_peers(0) and time.monotonic() < deadline:
            time.sleep(0.2)
        joiner.start(background=False)  # downloads the donor's weights and momentum
        for mine, theirs, start in zip(
            joiner.server.backend.module.parameters(),
            donor.server.backend.module.parameters(),
            initial.parameters(),
            strict=True,
        ):
            assert torch.equal(mine, theirs) and not torch.equal(mine, start)
        send_backward(pipe, joiner.server, name, *micro_batch(3, 9))
        assert run_together([donor.averager, joiner.averager]) == [True, True]
        assert donor.server.backend.update_count == joiner.server.backend.update_count == 2
        for mine, theirs in zip(
            joiner.server.backend.module.parameters(),
            donor.server.backend.module.parameters(),
            strict=True,
        ):
            assert torch.equal(mine, theirs)
    finally:
        for peer in peers:
            peer.shutdown()


def test_gradients_mode_refuses_a_backend_without_optimizer_or_with_another_averager(swarm):
    name = swarm.new_name()
    server = swarm.serve(name, 0, 1, nn.Linear(4, 4), 4)  # lr 0: no optimizer
    with pytest.raises(ValidationError, match=r'mode="gradients" needs the backend.s optimizer'):
        StageAverager(server.dht, name, 0, server.backend, GRADIENTS)
    server.backend.optimizer = torch.optim.SGD(server.backend.module.parameters(), lr=0.1)
    averager = StageAverager(server.dht, name, 0, server.backend, GRADIENTS)
    try:
        with pytest.raises(ValidationError, match="already hands its gradients"):
            StageAverager(server.dht, name, 0, server.backend, GRADIENTS)
    finally:
        averager.shutdown()


def test_bad_stage_training_options_are_refused_naming_them():
    with pytest.raises(ValidationError, match="mode must be one of"):
        StageTrainingOptions(mode="momentum")
    with pytest.raises(ValidationError, match=r"min_matchmaking_time=5.0 must be less than half"):
        StageTrainingOptions(mode="gradients", average_period=8.0, min_matchmaking_time=5.0)
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
