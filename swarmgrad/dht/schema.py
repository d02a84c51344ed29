"""Typed DHT keys: a pydantic model says which values may be stored under which keys.

As in hivemind 1.1, each field of the model names a DHT key (``f"{prefix}_{field}"`` when
a prefix is given, the field's alias if it has one, else its name) and the field's type
constrains the values stored under it::

    class Progress(pydantic.BaseModel):
        epoch: pydantic.conint(ge=0, strict=True)
        peers: dict[BytesWithPublicKey, PeerInfo]  # a dictionary key: subkey -> value

    dht = DHT(record_validators=[SchemaValidator(Progress, prefix="my_run")], ...)

Rules, applied to the record's deserialized key, subkey and value:

* **Strict types.** Values are checked in pydantic's strict mode: nothing is converted,
  so an ``int`` field refuses ``"1"``, ``1.5`` and ``True``, and ``bytes`` and ``str``
  stay apart, even for a field declared ``Field(strict=False)``. Constraints are part of
  the type: ``conint(ge=0)``, ``StrictInt``, ``Annotated[int, Field(ge=0)]``,
  ``x: int = Field(ge=0)``, ``Annotated[..., AfterValidator(f)]``. Validator *methods* of
  the schema model itself (``@field_validator``, ``@model_validator``) are not run, since
  a record carries a single field, never a whole schema; those of models used as field
  types are (a nested model is validated whole).
* **Dictionaries.** An entry stored with a subkey is checked as ``{subkey: value}``
  against the field's type, so ``dict[K, V]`` constrains subkeys by ``K`` and values by
  ``V``. A value stored *without* a subkey that decodes to a map is refused (as in
  hivemind): dictionaries are written entry by entry, and a plain value with a later
  expiration would otherwise hide every entry of a dictionary key.
* **Sequences** travel as msgpack arrays and come back as lists: declare ``list[...]``
  fields (a ``tuple[...]`` field refuses lists in strict mode).
* **Other keys** are accepted when ``allow_extra_keys`` is True, refused otherwise.

Two schema validators merge into one (the DHT does this when validators are added): a
key may then be declared by several schemas, and a record under it is accepted if any of
them accepts it; extra keys stay allowed if either validator allowed them.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any

import pydantic
from pydantic import AfterValidator, Strict, TypeAdapter
from pydantic.fields import FieldInfo

from swarmgrad.dht.crypto import Ed25519SignatureValidator
from swarmgrad.dht.validation import (
    NO_SUBKEY,
    DHTRecord,
    RecordValidatorBase,
    deserialize,
    serialize,
)
from swarmgrad.utils.errors import ValidationError

__all__ = ["BytesWithPublicKey", "SchemaValidator"]

logger = logging.getLogger(__name__)

_OWNER_MARKER_RE = re.compile(Ed25519SignatureValidator.PUBLIC_KEY_REGEX)


def _require_owner_marker(value: bytes) -> bytes:
    if _OWNER_MARKER_RE.search(value) is None:
        raise ValueError("expected bytes containing an owner marker [owner:<base64 key>]")
    return value


BytesWithPublicKey = Annotated[bytes, Strict(), AfterValidator(_require_owner_marker)]
"""Bytes that contain a well-formed owner marker, e.g. a subkey that only its owner may
write (with :class:`~swarmgrad.dht.crypto.Ed25519SignatureValidator` enforcing it)."""


@dataclass(frozen=True)
class _KeyType:
    """One schema field: the DHT key it names and the type its values must have."""

    key: str
    model: type[pydantic.BaseModel]
    field: str
    adapter: TypeAdapter = field(compare=False)

    def accepts(self, value: Any) -> bool:
        try:
            self.adapter.validate_python(value, strict=True)
        except pydantic.ValidationError:
            return False
        return True


class SchemaValidator(RecordValidatorBase):
    """Constrains the values stored under the keys named by a pydantic model's fields.

    See the module docstring for the rules. ``schema`` is the model class, ``prefix``
    (optional) is prepended to every field name with an underscore, ``allow_extra_keys``
    says whether keys the schema does not name are accepted.
    """

    def __init__(
        self,
        schema: type[pydantic.BaseModel],
        allow_extra_keys: bool = True,
        prefix: str | None = None,
    ):
        if not (isinstance(schema, type) and issubclass(schema, pydantic.BaseModel)):
            raise ValidationError(
                f"SchemaValidator needs a pydantic.BaseModel subclass, got {schema!r}"
            )
        if prefix is not None and not isinstance(prefix, str):
            raise ValidationError(f"the schema prefix must be a str, got {type(prefix).__name__}")
        key_types: dict[bytes, tuple[_KeyType, ...]] = {}
        for name, info in schema.model_fields.items():
            field_key = info.alias or name
            key = f"{prefix}_{field_key}" if prefix is not None else field_key
            try:
                adapter = TypeAdapter(_field_type(info))
            except Exception as e:
                raise ValidationError(
                    f"field {name!r} of schema {schema.__name__} cannot be used to check DHT "
                    f"values: {e}"
                ) from e
            key_types[serialize(key)] = (_KeyType(key, schema, name, adapter),)
        self._schemas: tuple[type[pydantic.BaseModel], ...] = (schema,)
        self._key_types = key_types
        self._allow_extra_keys = bool(allow_extra_keys)
        self._lock = threading.Lock()

    @property
    def schemas(self) -> tuple[type[pydantic.BaseModel], ...]:
        return self._schemas

    @property
    def allow_extra_keys(self) -> bool:
        return self._allow_extra_keys

    def validate(self, record: DHTRecord) -> bool:
        try:
            key_types = self._key_types.get(record.key)
            if key_types is None:
                if not self._allow_extra_keys:
                    return _refuse(record, "the key is not in the schema")
                return True
            value = deserialize(record.value)
            if record.subkey == NO_SUBKEY:
                if isinstance(value, dict):
                    return _refuse(
                        record,
                        "a map stored without a subkey (store dictionary entries with subkeys)",
                    )
                candidate = value
            else:
                candidate = {deserialize(record.subkey): value}
            for key_type in key_types:
                if key_type.accepts(candidate):
                    return True
            expected = " or ".join(f"{t.model.__name__}.{t.field}" for t in key_types)
            return _refuse(record, f"the value does not match {expected}")
        except ValidationError as e:
            return _refuse(record, str(e))
        except Exception as e:  # unhashable subkey, a user-defined type check that raised...
            return _refuse(record, f"{type(e).__name__}: {e}")

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, SchemaValidator):
            return False
        if other is self:
            return True
        with self._lock:
            key_types = dict(self._key_types)
            for key, types in other._key_types.items():
                known = key_types.get(key, ())
                key_types[key] = known + tuple(t for t in types if t not in known)
            self._schemas = self._schemas + tuple(
                s for s in other._schemas if s not in self._schemas
            )
            self._key_types = key_types
            self._allow_extra_keys = self._allow_extra_keys or other._allow_extra_keys
        return True

    def __repr__(self) -> str:
        names = ", ".join(schema.__name__ for schema in self._schemas)
        return f"SchemaValidator([{names}], allow_extra_keys={self._allow_extra_keys})"


def _field_type(info: FieldInfo) -> Any:
    """The field's type with the constraints pydantic keeps beside it (``ge=``, ``strict=``,
    ``conint``'s bounds, a union's discriminator), as one standalone type."""
    metadata = [item for item in info.metadata if item is not None]
    if info.discriminator is not None:
        metadata.append(pydantic.Field(discriminator=info.discriminator))
    return Annotated[(info.annotation, *metadata)] if metadata else info.annotation


def _refuse(record: DHTRecord, reason: str) -> bool:
    key = repr(getattr(record, "key", None))
    key = key if len(key) <= 80 else key[:77] + "..."
    logger.debug(f"Refusing a DHT record under key {key} (schema): {reason}")
    return False


def conbytes(*, regex: bytes | None = None, **kwargs: Any) -> type:
    """hivemind's ``conbytes``: pydantic v1's constrained bytes (``min_length``,
    ``max_length``, ``strict``, ...), plus a ``regex`` the whole value must match from its
    start (as hivemind's ``BytesWithPublicKey`` uses). A pydantic.v1 type, for the
    pydantic.v1 models hivemind programs write."""
    from pydantic import v1 as pydantic_v1

    base = pydantic_v1.conbytes(**kwargs)
    if regex is None:
        return base
    pattern = re.compile(regex)

    class ConstrainedBytesWithRegex(base):  # type: ignore[valid-type,misc]
        @classmethod
        def __get_validators__(cls):
            yield from super().__get_validators__()
            yield cls._match_regex

        @classmethod
        def _match_regex(cls, value: bytes) -> bytes:
            if pattern.match(value) is None:
                raise ValueError(f"{value[:40]!r} does not match the pattern {regex!r}")
            return value

    return ConstrainedBytesWithRegex
