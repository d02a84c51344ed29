"""Copies between a GPU and the host, one wait per batch of tensors instead of per tensor.

Rounds average host (CPU) tensors; a model on a GPU keeps its gradients and parameters
there. Blocking copies tensor by tensor make the host wait for the device once per
tensor: hundreds of waits per round for a transformer. Host buffers made by
:func:`host_buffer_like` are pinned (page-locked) when their tensor lives on a CUDA
device, so copies into and out of them are queued on the device's stream without
waiting; :func:`copy_batch` then waits once per device, at the end, so that the host
may read (or write again) every buffer when it returns. On a CPU-only machine these are
plain copies.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["copy_batch", "host_buffer_like"]


def host_buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of ``tensor``'s shape and dtype; pinned when
    ``tensor`` is on a CUDA device (and CUDA works here)."""
    buffer = torch.zeros_like(tensor, device="cpu", memory_format=torch.contiguous_format)
    if tensor.device.type == "cuda" and torch.cuda.is_available():
        buffer = buffer.pin_memory()
    return buffer


def copy_batch(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``destination.copy_(source)`` for each ``(source, destination)``. A copy between a
    GPU and a pinned host buffer is queued on the device's current stream; each device is
    waited for once, at the end, so that the host may read or change every buffer when
    this returns."""
    devices: set[torch.device] = set()
    for source, destination in pairs:
        gpu = next((t.device for t in (source, destination) if t.device.type == "cuda"), None)
        host = destination if source.device.type == "cuda" else source
        queued = gpu is not None and host.device.type == "cpu" and host.is_pinned()
        destination.copy_(source, non_blocking=queued)
        if queued:
            devices.add(gpu)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
