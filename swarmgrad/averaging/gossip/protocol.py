"""Gossip averaging's wire protocol: a DHT declaration and one unary RPC per prefix.

* Declaration: under ``<prefix>.gossip``, subkey the peer's base58 PeerID, value
  :class:`GossipDeclaration` (``{"v": 1, "maddrs": [...]}``): where to pull from.
* ``<prefix>.gossip.pull`` (:func:`pull_rpc_name`): a :class:`PullRequest` names the
  puller's tensor schema; the :class:`PullAnswer` carries a copy of the server's tensors
  (serialized, maybe compressed), its sample clock and its latest loss. A server whose
  tensors differ refuses with an error (the RPC layer's), naming the first mismatch.

``decode_*`` check shapes and types and raise
:class:`~swarmgrad.utils.errors.ProtocolViolation` naming the field; whether the values
fit (the schema matches ours, tensors are finite) is the averager's to judge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from swarmgrad.net.identity import PeerID
from swarmgrad.utils.errors import ProtocolViolation, SwarmgradError

__all__ = [
    "MAX_MADDRS",
    "PROTOCOL_VERSION",
    "GossipDeclaration",
    "PullAnswer",
    "PullRequest",
    "declaration_key",
    "decode_declaration",
    "decode_pull_answer",
    "decode_pull_request",
    "pull_rpc_name",
]

PROTOCOL_VERSION = 1  # "v" of declarations and pull requests; others are ignored / refused
MAX_MADDRS = 16  # addresses per declaration kept


def declaration_key(prefix: str) -> str:
    """The DHT key under which the gossip peers of ``prefix`` declare themselves."""
    return f"{prefix}.gossip"


def pull_rpc_name(prefix: str) -> str:
    """The pull RPC's wire name (the servicer's ``rpc_pull`` under ``<prefix>.gossip``)."""
    return f"{declaration_key(prefix)}.pull"


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


@dataclass(frozen=True)
class GossipDeclaration:
    """A gossip peer's DHT entry: the addresses it serves pulls at."""

    maddrs: tuple[str, ...]

    def encode(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "maddrs": list(self.maddrs[:MAX_MADDRS])}


def decode_declaration(subkey: Any, value: Any) -> tuple[PeerID, GossipDeclaration] | None:
    """A declaration read from the DHT, or None if it is not one we can use (another
    version, a malformed entry: other peers' records are skipped, not refused)."""
    try:
        peer_id = PeerID.from_base58(subkey)
    except (SwarmgradError, ValueError, TypeError):
        return None
    if not isinstance(value, dict) or value.get("v") != PROTOCOL_VERSION:
        return None
    maddrs = value.get("maddrs")
    if not isinstance(maddrs, list) or not all(isinstance(m, str) for m in maddrs):
        return None
    return peer_id, GossipDeclaration(tuple(maddrs[:MAX_MADDRS]))


@dataclass(frozen=True)
class PullRequest:
    """A puller asks for the server's tensors; ``schema`` is ours, for the server to
    compare: ``[[dtype name, [shape...]], ...]``."""

    schema: list

    def encode(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "schema": self.schema}


def decode_pull_request(message: Any) -> PullRequest:
    if not isinstance(message, dict):
        raise ProtocolViolation(f"malformed gossip pull: {message!r:.40} is not a map")
    if message.get("v") != PROTOCOL_VERSION:
        raise ProtocolViolation(
            f"malformed gossip pull: v {message.get('v')!r:.20} is not version {PROTOCOL_VERSION}"
        )
    schema = message.get("schema")
    if not isinstance(schema, list):
        raise ProtocolViolation(f"malformed gossip pull: schema {schema!r:.40} is not a list")
    return PullRequest(schema)


@dataclass(frozen=True)
class PullAnswer:
    """The server's tensors as :func:`~swarmgrad.compression.wire.tensors_to_message`
    made them, its sample clock (samples its parameters have seen) and latest loss."""

    tensors: list  # serialized tensor messages
    samples: float
    loss: float | None = None

    def encode(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "samples": self.samples, "loss": self.loss}


def decode_pull_answer(message: Any, peer_id: Any) -> PullAnswer:
    """The answer of ``peer_id``; ProtocolViolation naming the field (tensors are decoded
    by the caller, who names them)."""
    if not isinstance(message, dict):
        raise ProtocolViolation(f"gossip answer from {peer_id} is not a dict")
    tensors, samples, loss = message.get("tensors"), message.get("samples"), message.get("loss")
    if not isinstance(tensors, list):
        raise ProtocolViolation(f"gossip answer from {peer_id}: tensors is not a list")
    if not _number(samples) or not math.isfinite(samples) or samples < 0:
        raise ProtocolViolation(f"{peer_id} reports an invalid sample clock {samples!r}")
    if loss is not None and (not _number(loss) or not math.isfinite(loss)):
        raise ProtocolViolation(f"{peer_id} reports an invalid loss {loss!r}")
    return PullAnswer(tensors, float(samples), None if loss is None else float(loss))
