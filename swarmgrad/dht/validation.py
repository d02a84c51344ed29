"""Record validators: which DHT records a peer agrees to store, and in what form.

Every record that enters the DHT (stored by the local user, received in a store request,
or found during a lookup) passes through the node's :class:`CompositeValidator`. The API
follows hivemind 1.1 (``hivemind.dht.validation``):

* :meth:`RecordValidatorBase.validate` says whether a record may be stored or believed.
  It judges data sent by remote peers, so it returns False for anything malformed and
  never raises.
* :meth:`RecordValidatorBase.sign_value` turns the user's value into the value actually
  stored (a signature validator appends a signature).
* :meth:`RecordValidatorBase.strip_value` undoes it: the value given back to the user.

A :class:`DHTRecord` holds everything in serialized form: the key and the subkey as
:func:`serialize` encodes them, and the value bytes. A plain (non-dictionary) value has
the subkey :data:`NO_SUBKEY` (``b""``, never the encoding of any object: msgpack encodes
every object, ``None`` included, to at least one byte).

**Layers and priority.** Validators wrap the value in layers. The one with the highest
:attr:`~RecordValidatorBase.priority` is the outermost layer: it signs last, and it strips
and validates first, so that each validator sees the value exactly as it produced it.
Concretely, within a :class:`CompositeValidator`, sorted by decreasing priority:

* ``sign_value`` runs from the lowest priority to the highest;
* ``strip_value`` runs from the highest priority to the lowest;
* ``validate`` runs from the highest priority to the lowest, each validator receiving
  the value stripped by the validators before it; the first refusal wins.

The signature validator (:mod:`swarmgrad.dht.crypto`) has priority 10, the schema
validator (:mod:`swarmgrad.dht.schema`) 0, so the schema sees the value without its
signature.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmgrad.utils.errors import ValidationError

__all__ = [
    "NO_SUBKEY",
    "CompositeValidator",
    "DHTRecord",
    "RecordValidatorBase",
    "deserialize",
    "serialize",
]

logger = logging.getLogger(__name__)

NO_SUBKEY = b""
"""The :attr:`DHTRecord.subkey` of a plain value (one stored without a subkey)."""


@dataclass(frozen=True)
class DHTRecord:
    """One DHT entry as validators see it, everything serialized.

    ``key`` and ``subkey`` are :func:`serialize` d (``subkey`` is :data:`NO_SUBKEY` for a
    plain value); ``value`` is the serialized value, possibly wrapped by validators (for
    instance with a signature appended); ``expiration_time`` is in DHT time (seconds).
    """

    key: bytes
    subkey: bytes
    value: bytes
    expiration_time: float


def serialize(obj: Any) -> bytes:
    """How keys, subkeys and values are encoded in a :class:`DHTRecord`: msgpack, with
    ``bytes`` kept distinct from ``str``."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValidationError(f"{type(obj).__name__} value is not msgpack-serializable: {e}") from e


def deserialize(data: bytes) -> Any:
    """Decode what :func:`serialize` produced; the one decoder the validators use.

    Raises ValidationError for anything that is not exactly one msgpack object (garbage,
    truncated data, trailing bytes, nesting too deep, unhashable map keys): validators turn
    that into a refusal. Arrays come back as lists and ``str`` / ``bytes`` as themselves;
    map keys may be any hashable msgpack type (not only strings), since dictionary subkeys
    and values may be keyed by integers.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValidationError(f"expected serialized bytes, got {type(data).__name__}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many types (ExtraData, StackError, ...)
        raise ValidationError(f"not a msgpack-encoded object: {type(e).__name__}: {e}") from None


class RecordValidatorBase(ABC):
    """What every record validator provides (hivemind's interface).

    Subclasses implement :meth:`validate`; they override :meth:`sign_value` and
    :meth:`strip_value` when they wrap the value, :attr:`priority` to choose their layer
    (see the module docstring), and :meth:`merge_with` when two instances of the same kind
    should act as one (for example two schemas).
    """

    @abstractmethod
    def validate(self, record: DHTRecord) -> bool:
        """True if the record may be stored or believed. Never raises: malformed input,
        most often sent by a remote peer, gives False."""

    def sign_value(self, record: DHTRecord) -> bytes:
        """The value to store for this locally written record (default: unchanged)."""
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        """The value to give back to the user for this stored record (default:
        unchanged). Inverse of :meth:`sign_value`."""
        return record.value

    @property
    def priority(self) -> int:
        """The layer of this validator: the higher, the later it signs and the earlier it
        strips and validates."""
        return 0

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Absorb ``other`` into this validator if it is of a kind this one can combine
        with; return True if it did (then ``other`` is not added separately)."""
        return False


class CompositeValidator(RecordValidatorBase):
    """Several validators acting as one, in the order set by their priorities.

    :meth:`extend` adds validators at any time, even while the DHT runs: a new validator
    is first offered to each existing one through :meth:`~RecordValidatorBase.merge_with`
    and appended only if none absorbed it. Validators of equal priority keep the order in
    which they were added. A ``CompositeValidator`` passed to another one is flattened.

    ``extend`` may be called from any thread; calls in progress on the event loop keep
    the list they started with.
    """

    def __init__(self, validators: Iterable[RecordValidatorBase] = ()):
        self._validators: tuple[RecordValidatorBase, ...] = ()
        self._lock = threading.RLock()
        self.extend(validators)

    @property
    def validators(self) -> tuple[RecordValidatorBase, ...]:
        """The validators, highest priority first."""
        return self._validators

    def extend(self, validators: Iterable[RecordValidatorBase]) -> None:
        """Add validators, merging each into an existing one of its kind when possible."""
        new_validators = list(_flatten(validators))  # type errors before any change
        with self._lock:
            current = list(self._validators)
            for new in new_validators:
                if any(existing.merge_with(new) for existing in current):
                    continue
                current.append(new)
            current.sort(key=lambda validator: validator.priority, reverse=True)  # stable
            self._validators = tuple(current)

    def validate(self, record: DHTRecord) -> bool:
        validators = self._validators
        try:
            for i, validator in enumerate(validators):
                if not validator.validate(record):
                    return False
                if i + 1 < len(validators):
                    record = dataclasses.replace(record, value=validator.strip_value(record))
        except Exception as e:  # a validator broke its promise not to raise
            logger.warning(f"Validator raised on a record (refusing it): {type(e).__name__}: {e}")
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        for validator in reversed(self._validators):
            record = dataclasses.replace(record, value=validator.sign_value(record))
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        for validator in self._validators:
            record = dataclasses.replace(record, value=validator.strip_value(record))
        return record.value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, CompositeValidator):
            return False
        self.extend(other.validators)
        return True

    def __repr__(self) -> str:
        return f"CompositeValidator({list(self._validators)!r})"


def _flatten(validators: Iterable[RecordValidatorBase]) -> Iterable[RecordValidatorBase]:
    for validator in validators:
        if isinstance(validator, CompositeValidator):
            yield from validator.validators
        elif isinstance(validator, RecordValidatorBase):
            yield validator
        else:
            raise ValidationError(
                f"record validators derive from RecordValidatorBase, got {type(validator).__name__}"
            )
