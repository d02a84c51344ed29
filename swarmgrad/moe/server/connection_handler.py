"""The expert-call RPC handlers (``moe.info``, ``moe.forward``, ``moe.backward``).

They run on the peer's event loop and do only cheap work there: decode the request's
tensors (views over the received buffers, no copy), check them against the expert's
schema, hand them to the expert's task pool and await the result, which the device thread
resolves. Any bad request raises a :class:`ValidationError` naming the expert, the tensor
and what was expected; the RPC layer sends it to the caller as a RemoteError and the
server carries on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarmgrad.compression.base import all_finite
from swarmgrad.compression.serialized import CompressionType
from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.moe import protocol
from swarmgrad.moe.server.module_backend import ModuleBackend
from swarmgrad.net.peer import Peer
from swarmgrad.net.rpc import RPCContext, ServicerBase
from swarmgrad.utils.errors import ValidationError

__all__ = ["ConnectionHandler"]

logger = logging.getLogger(__name__)

# lossy codecs on tensors with at least this many elements run in an executor thread
_OFFLOAD_NUMEL = 1 << 16


class ConnectionHandler(ServicerBase):
    """Serves the experts in ``module_backends`` ({uid: backend}) on a peer.

    hivemind runs several handler processes; here the peer's event loop serves all calls
    and the heavy work happens on the runtime's device thread, so one handler suffices.
    Its ``rpc_*`` methods are the expert protocol, served as ``moe.<name>``.
    """

    rpc_prefix = "moe"

    def __init__(self, module_backends: Mapping[str, ModuleBackend]):
        self.module_backends = module_backends
        self._peer: Peer | None = None

    def attach(self, peer: Peer) -> None:
        """Register the three handlers on ``peer`` (call on its loop)."""
        peer.add_servicer(self)
        self._peer = peer

    def detach(self) -> None:
        """Unregister the handlers; later calls get UnknownHandler."""
        peer, self._peer = self._peer, None
        if peer is not None:
            peer.remove_servicer(self)

    # ------------------------------------------------------------------ handlers

    async def rpc_info(self, request: Any, context: RPCContext) -> dict[str, Any]:
        return self._backend(request, protocol.INFO).get_info()

    async def rpc_forward(self, request: Any, context: RPCContext) -> dict[str, Any]:
        backend = self._backend(request, protocol.FORWARD)
        what = f"inputs of expert {backend.name!r}"
        inputs = tensors_from_message(_field(request, "inputs", protocol.FORWARD), what=what)
        batch_size = protocol.check_batch(inputs, backend.args_schema, what)
        self._check_size(backend, batch_size)
        if batch_size == 0:
            outputs = tuple(d.make_zeros(0) for d in backend.outputs_schema)
        else:
            outputs = await backend.forward_pool.submit_task(*inputs, size=batch_size)
        return {"outputs": await _encode(outputs, backend.outputs_schema)}

    async def rpc_backward(self, request: Any, context: RPCContext) -> dict[str, Any]:
        backend = self._backend(request, protocol.BACKWARD)
        uid = backend.name
        inputs = tensors_from_message(
            _field(request, "inputs", protocol.BACKWARD), what=f"inputs of expert {uid!r}"
        )
        grads = tensors_from_message(
            _field(request, "grad_outputs", protocol.BACKWARD),
            what=f"grad_outputs of expert {uid!r}",
        )
        batch_size = protocol.check_batch(inputs, backend.args_schema, f"inputs of expert {uid!r}")
        protocol.check_batch(
            grads, backend.outputs_schema, f"grad_outputs of expert {uid!r}", batch_size
        )
        self._check_size(backend, batch_size)
        # one caller's NaN or Inf would reach the shared weights through the optimizer step
        # (and fail the batch of everyone it is batched with): refuse it per request
        _check_finite(inputs, f"inputs of expert {uid!r}")
        _check_finite(grads, f"grad_outputs of expert {uid!r}")
        if batch_size == 0:
            grad_inputs = tuple(d.make_zeros(0) for d in backend.args_schema)
        else:
            grad_inputs = await backend.backward_pool.submit_task(*inputs, *grads, size=batch_size)
        return {"grad_inputs": await _encode(grad_inputs, backend.args_schema)}

    # ------------------------------------------------------------------ helpers

    def _backend(self, request: Any, rpc_name: str) -> ModuleBackend:
        uid = _field(request, "uid", rpc_name)
        backend = self.module_backends.get(uid) if isinstance(uid, str) else None
        if backend is None:
            raise ValidationError(
                f"this server hosts no expert {uid!r:.200} (it hosts "
                f"{len(self.module_backends)} experts)"
            )
        return backend

    @staticmethod
    def _check_size(backend: ModuleBackend, batch_size: int) -> None:
        if batch_size > backend.max_batch_size:
            raise ValidationError(
                f"expert {backend.name!r}: a request of {batch_size} samples exceeds its "
                f"max_batch_size of {backend.max_batch_size}; split the batch"
            )


def _field(request: Any, key: str, rpc_name: str) -> Any:
    if not isinstance(request, dict) or key not in request:
        raise ValidationError(f"a {rpc_name} request must be a dict with a {key!r} field")
    return request[key]


def _check_finite(tensors: Sequence[torch.Tensor], what: str) -> None:
    for i, tensor in enumerate(tensors):
        if not all_finite(tensor):
            raise ValidationError(f"{what}[{i}]: holds NaN or Inf values; expected finite ones")


async def _encode(
    tensors: Sequence[torch.Tensor], schema: Sequence[protocol.BatchTensorDescriptor]
) -> list[dict[str, Any]]:
    """Serialize results with the schema's codecs; lossy codecs on big tensors run in the
    loop's executor so that the loop keeps serving while they compress."""
    codecs = [d.compression for d in schema]
    lossy_numel = sum(
        t.numel() for t, c in zip(tensors, codecs, strict=True) if c != CompressionType.NONE
    )
    if lossy_numel < _OFFLOAD_NUMEL:
        return tensors_to_message(tensors, codecs)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, tensors_to_message, tensors, codecs)
