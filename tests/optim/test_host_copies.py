"""host_copies: host buffers for a model's tensors and batched copies between a GPU and
the host. On a CPU-only machine the buffers are plain and the copies exact; with CUDA
(``gpu`` tests) the buffers are pinned, the copies are queued and waited for once, and
the averagers' buffers for a model on a GPU are pinned."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.dht import DHT
from swarmgrad.optim import GradientAverager, TrainingStateAverager
from swarmgrad.optim.host_copies import copy_batch, host_buffer_like
from swarmgrad.optim.optimizer_state import optimizer_parameters

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_host_buffers_are_contiguous_zeroed_cpu_copies_of_shape_and_dtype():
    source = torch.randn(4, 6, dtype=torch.float64).t()  # not contiguous
    buffer = host_buffer_like(source)
    assert buffer.device.type == "cpu" and buffer.dtype == torch.float64
    assert buffer.shape == source.shape and buffer.is_contiguous()
    assert not buffer.any()
    assert not buffer.is_pinned()  # a CPU tensor needs no pinning


def test_copy_batch_copies_every_pair_in_either_direction():
    sources = [torch.randn(3, 5), torch.arange(7.0), torch.randn(2, 2).t()]
    buffers = [host_buffer_like(t) for t in sources]
    copy_batch(zip(sources, buffers, strict=True))
    for source, buffer in zip(sources, buffers, strict=True):
        assert torch.equal(source, buffer)
    back = [torch.empty_like(t) for t in sources]
    copy_batch(zip(buffers, back, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(sources, back, strict=True))
    copy_batch([])  # nothing to copy, nothing to wait for


@pytest.mark.gpu
@needs_cuda
def test_buffers_of_gpu_tensors_are_pinned_and_batched_copies_are_exact():
    sources = [torch.randn(1000, 100, device="cuda") for _ in range(8)]
    buffers = [host_buffer_like(t) for t in sources]
    assert all(b.is_pinned() and b.device.type == "cpu" for b in buffers)
    copy_batch(zip(sources, buffers, strict=True))
    # readable at once on the host: the copies were waited for
    assert all(torch.equal(b, s.cpu()) for b, s in zip(buffers, sources, strict=True))
    targets = [torch.zeros_like(s) for s in sources]
    for buffer in buffers:
        buffer.mul_(2)
    copy_batch(zip(buffers, targets, strict=True))
    for buffer in buffers:
        buffer.zero_()  # changing the host buffers afterwards does not reach the GPU
    assert all(torch.equal(t, 2 * s) for t, s in zip(targets, sources, strict=True))


@pytest.mark.gpu
@needs_cuda
def test_averagers_of_a_gpu_model_keep_pinned_host_buffers_and_the_right_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).cuda()
    dht = DHT(start=True)
    grads = GradientAverager(model.parameters(), dht=dht, prefix="pinned", start=True)
    state = TrainingStateAverager(
        dht=dht,
        prefix="pinned_state",
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        params=model.parameters(),
        offload_optimizer=True,
        start=True,
    )
    try:
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        grads.accumulate_grads_(batch_size=4)
        grads.load_accumulators_into_averager_()
        with grads.get_tensors() as averaged:
            assert all(t.is_pinned() for t in averaged)
            for param, mean in zip(model.parameters(), averaged, strict=True):
                assert torch.allclose(mean, param.grad.cpu(), atol=1e-6)
        masters = optimizer_parameters(state.optimizer)
        assert all(m.is_pinned() for m in masters)
        before = [p.detach().cpu() for p in model.parameters()]
        state.step(optimizer_step=True)  # on the host copy, then back to the GPU
        for param, old in zip(model.parameters(), before, strict=True):
            assert torch.allclose(param.detach().cpu(), old - 0.1 * param.grad.cpu(), atol=1e-6)
    finally:
        grads.shutdown()
        state.shutdown()
        dht.shutdown()
