"""The authority's revocation list in the DHT.

The authority publishes its newest signed :class:`~swarmgrad.net.admission.RevocationList`
under the well-known key :data:`REVOCATION_KEY` (``swarmgrad authority revoke`` does it).
Every DHT node of a swarm with an authority:

* refuses to store or believe anything under that key that is not a list signed by its
  authority, and gives a list no DHT lifetime beyond the list's own expiry
  (:class:`RevocationListValidator`), so a token holder can neither plant an empty list
  nor keep an old one alive past a newer one (the DHT keeps the later expiration, and a
  newer list expires later);
* reads the key every ``revocation_refresh`` seconds (20 by default), adopts a list with
  a higher serial and at once closes connections of revoked peers
  (:class:`RevocationWatcher`): a revocation is honoured within
  about ``revocation_refresh`` seconds of its publication, well within a minute.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from swarmgrad.dht.validation import NO_SUBKEY, DHTRecord, RecordValidatorBase, serialize
from swarmgrad.net.admission import Admission, RevocationList
from swarmgrad.utils.errors import SwarmgradError, TokenError

if TYPE_CHECKING:
    from swarmgrad.dht.node import DHTNode

__all__ = ["REVOCATION_KEY", "RevocationListValidator", "RevocationWatcher", "publish_revocations"]

logger = logging.getLogger(__name__)

REVOCATION_KEY = "_swarmgrad.admission.revocations"
_REVOCATION_KEY_BYTES = serialize(REVOCATION_KEY)
_EXPIRATION_SLACK = 1.0  # seconds: float rounding between the list and the record


class RevocationListValidator(RecordValidatorBase):
    """Under :data:`REVOCATION_KEY`, only lists signed by the swarm's authority."""

    def __init__(self, admission: Admission):
        self.admission = admission

    @property
    def priority(self) -> int:
        return 100  # judges the value exactly as stored

    def validate(self, record: DHTRecord) -> bool:
        if record.key != _REVOCATION_KEY_BYTES:
            return True
        if record.subkey != NO_SUBKEY:
            return False
        try:
            revocations = decode_record_value(record.value)
            self.admission.verify_revocations(revocations)
        except (TokenError, ValueError, TypeError) as e:
            logger.debug("refusing a revocation list record: %s", e)
            return False
        return record.expiration_time <= revocations.expires_at + _EXPIRATION_SLACK

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RevocationListValidator) and other.admission is self.admission


def decode_record_value(value: bytes) -> RevocationList:
    """The list inside a DHT value (the msgpack-serialized list bytes)."""
    import msgpack

    try:
        inner = msgpack.unpackb(value, raw=False)
    except Exception as e:
        raise TokenError(f"the revocation record is not msgpack: {type(e).__name__}") from None
    if not isinstance(inner, bytes):
        raise TokenError("the revocation record must hold the list's bytes")
    return RevocationList.decode(inner)


async def publish_revocations(node: DHTNode, revocations: RevocationList) -> bool:
    """Store the list under the well-known key until it expires; True if stored."""
    return await node.store(REVOCATION_KEY, revocations.encode(), revocations.expires_at)


class RevocationWatcher:
    """Reads the revocation list from the DHT every ``admission.revocation_refresh``
    seconds and enforces it on the node's peer. Owned by a :class:`DHTNode`."""

    def __init__(self, node: DHTNode, admission: Admission):
        self.node = node
        self.admission = admission
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.admission.revocation_refresh)

    async def refresh(self) -> bool:
        """Read the list now; True if a newer one was adopted (and enforced)."""
        try:
            found: Any = await self.node.get(REVOCATION_KEY, latest=True)
        except SwarmgradError as e:
            logger.debug("could not read the revocation list: %s", e)
            return False
        if found is None or not isinstance(found.value, bytes):
            return False
        try:
            adopted = self.admission.apply_revocations(found.value)
        except TokenError as e:  # the validator already refuses these; belt and braces
            logger.warning("ignoring a revocation list from the DHT: %s", e)
            return False
        if adopted:
            self.node.peer.enforce_admission()
        return adopted
