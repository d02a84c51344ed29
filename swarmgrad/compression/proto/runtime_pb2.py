"""``hivemind.proto.runtime_pb2``: only ``CompressionType``, the enum programs pass to
``BatchTensorDescriptor``, ``Server.create(compression=...)`` and
``serialize_torch_tensor``. It is swarmgrad's :class:`~swarmgrad.compression.CompressionType`,
which every such call takes; ``Name``/``Value``/``keys``/``items`` answer with hivemind's
protobuf numbers (``CompressionType.Value("FLOAT16") == 2``,
``CompressionType[CompressionType.Name(2)] is CompressionType.FLOAT16``)."""

from swarmgrad.compression.serialized import CompressionType

__all__ = ["CompressionType"]
