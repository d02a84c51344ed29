"""``RemoteExpert``: a module whose forward and backward run on an expert server.

Synchronous code (a training loop) calls it like any module; the call runs on the
process's event loop thread (:mod:`swarmgrad.utils.loop_thread`) and autograd sends the
backward pass to the server, which updates the expert's weights there. Coroutines use
the ``*_async`` methods instead, which do not block and can run many calls at once.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from swarmgrad.dht.node import DHTNode
from swarmgrad.moe.dht_records import get_experts_info_on_node
from swarmgrad.moe.expert_uid import ExpertInfo, ExpertUID
from swarmgrad.moe.protocol import check_batch
from swarmgrad.net.identity import PeerID
from swarmgrad.utils.compat import unsupported
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.loop_thread import run_coroutine

from .caller import DEFAULT_TIMEOUT, ExpertCaller, ExpertSchema

__all__ = ["RemoteExpert", "create_remote_experts", "get_experts"]

# A tensor that requires grad, passed to every remote call so that autograd runs the
# backward pass (and the server updates its weights) even if no input requires grad.
DUMMY = torch.empty(0, requires_grad=True)


class RemoteExpert(nn.Module):
    """An expert hosted elsewhere, used as a local module.

    :param expert_info: the uid and the servers hosting it (from :func:`get_experts`,
        the beam search, or built by hand); calls rotate over its servers
    :param p2p: the peer to call from, or a running ``DHT`` (its peer is used)
    :param forward_timeout: seconds for one forward call, retries included
    :param backward_timeout: seconds for one backward call, retries included
    """

    stub = property(
        unsupported(
            "RemoteExpert.stub",
            "calls go over the DHT peer's RPC ('moe.forward'/'moe.backward'); call the expert "
            "as a module, or read expert.info for its uid and servers",
        )
    )

    def __init__(
        self,
        expert_info: ExpertInfo,
        p2p: Any,
        *,
        forward_timeout: float = DEFAULT_TIMEOUT,
        backward_timeout: float = DEFAULT_TIMEOUT,
    ):
        super().__init__()
        self.caller = ExpertCaller(expert_info, p2p, timeout=forward_timeout)
        self.forward_timeout, self.backward_timeout = forward_timeout, backward_timeout

    @property
    def uid(self) -> ExpertUID:
        return self.caller.uid

    @property
    def expert_info(self) -> ExpertInfo:
        return self.caller.expert_info

    @property
    def peer_id(self) -> PeerID:
        """The first server's PeerID (hivemind's experts have exactly one server)."""
        return self.caller.expert_info.peer_id

    @property
    def schema(self) -> ExpertSchema:
        """The expert's schema, fetched from a server on first use."""
        if self.caller.schema is None:
            run_coroutine(self.caller.get_schema(self.forward_timeout))
        return self.caller.schema

    @property
    def info(self) -> dict[str, Any]:
        """hivemind's ``info``: ``{"args_schema", "outputs_schema", "max_batch_size", ...}``."""
        return self.schema.to_info()

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor]:
        """Run the expert remotely; one output comes back as a tensor, several as a tuple."""
        if kwargs:
            raise ValidationError(
                f"expert {self.uid!r} takes positional tensors only, got keyword arguments "
                f"{sorted(kwargs)}"
            )
        check_batch(args, self.schema.args_schema, f"inputs of expert {self.uid!r}")
        device = args[0].device if args else torch.device("cpu")
        outputs = _RemoteCall.apply(DUMMY, self, *to_host(args))
        outputs = to_device(outputs, device)
        return outputs[0] if len(outputs) == 1 else outputs

    async def info_async(self, timeout: float | None = None) -> dict[str, Any]:
        return (await self.caller.get_schema(timeout or self.forward_timeout)).to_info()

    async def forward_async(
        self, *inputs: torch.Tensor, timeout: float | None = None
    ) -> list[torch.Tensor]:
        """Outputs for ``inputs`` without autograd, for use in coroutines."""
        schema = await self.caller.get_schema(timeout or self.forward_timeout)
        check_batch(inputs, schema.args_schema, f"inputs of expert {self.uid!r}")
        return await self.caller.forward(inputs, timeout=timeout or self.forward_timeout)

    async def backward_async(
        self,
        inputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
        timeout: float | None = None,
    ) -> list[torch.Tensor]:
        """Input gradients for ``grad_outputs`` (the server updates its weights)."""
        return await self.caller.backward(
            inputs, grad_outputs, timeout=timeout or self.backward_timeout
        )

    def extra_repr(self) -> str:
        servers = ", ".join(str(s.peer_id) for s in self.expert_info.servers)
        return f"uid={self.uid!r}, servers=[{servers}]"


def to_host(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the CPU, through autograd (a no-op for CPU tensors).

    A remote call's autograd Function must see only CPU tensors. The autograd engine runs
    a node's backward on the thread of the device its gradients are on: for CUDA, one
    engine thread per device, shared by every backward pass in the process. A Function
    whose backward blocks on the network while holding that thread deadlocks a server in
    the same process, whose own backward (on its runtime thread) needs the same engine
    thread. With CPU tensors inside, the remote backward runs on the thread that called
    ``backward()``, and the copies to and from the device stay ordinary autograd nodes.
    The copy to the host is the one the wire needs anyway: no extra synchronisation."""
    return tuple(t.to("cpu") for t in tensors)


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The outputs of a remote call moved (through autograd) to the caller's device."""
    if device.type == "cpu":
        return tuple(tensors)
    return tuple(t.to(device, non_blocking=True) for t in tensors)


class _RemoteCall(torch.autograd.Function):
    """Forward on the server now; backward on the server when autograd asks. Sees CPU
    tensors only (see :func:`to_host`)."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, expert: RemoteExpert, *inputs: torch.Tensor):
        inputs = tuple(t.detach() for t in inputs)
        ctx.expert = expert
        ctx.save_for_backward(*inputs)
        outputs = run_coroutine(
            expert.caller.forward(inputs, timeout=expert.forward_timeout, schema=expert.schema)
        )
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor):
        expert: RemoteExpert = ctx.expert
        inputs = ctx.saved_tensors
        grads = run_coroutine(
            expert.caller.backward(
                inputs, grad_outputs, timeout=expert.backward_timeout, schema=expert.schema
            )
        )
        needs = ctx.needs_input_grad[2:]
        pairs = zip(grads, inputs, needs, strict=True)
        return (None, None, *(g if need else None for g, _, need in pairs))


# ---------------------------------------------------------------------- from the DHT


def create_remote_experts(
    infos: Sequence[ExpertInfo | None], dht: Any, return_future: bool = False
) -> list[RemoteExpert | None] | concurrent.futures.Future:
    """A :class:`RemoteExpert` per info (None stays None), calling through ``dht``'s peer."""
    experts = [RemoteExpert(info, dht) if info is not None else None for info in infos]
    if return_future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(experts)
        return future
    return experts


def get_experts(
    dht: Any,
    uids: Sequence[ExpertUID],
    expiration_time: float | None = None,
    return_future: bool = False,
) -> list[RemoteExpert | None] | concurrent.futures.Future:
    """hivemind's ``get_experts``: a :class:`RemoteExpert` for every uid some server
    declared in the DHT (None for the others), listing every server that hosts it.
    With ``expiration_time``, only declarations valid at least until then count."""
    uids = list(uids)

    async def fetch(_dht: Any, node: DHTNode) -> list[RemoteExpert | None]:
        infos = await get_experts_info_on_node(node, uids, expiration_time=expiration_time)
        return create_remote_experts(infos, _dht)

    return dht.run_coroutine(fetch, return_future=return_future)
