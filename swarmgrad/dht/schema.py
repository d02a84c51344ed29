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
* **pydantic.v1 models** (hivemind's schemas: ``conint(strict=True)``, ``StrictFloat``,
  ``conbytes``...) are accepted too: each field validates the value with v1's own rules,
  and a value v1 would have converted (``"1"`` for an ``int``, ``True`` for an ``int``)
  is refused, as in hivemind. :data:`BytesWithPublicKey` works in both kinds of model.
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
from pydantic import TypeAdapter
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

try:  # hivemind's schemas are pydantic.v1 models (pydantic 2 ships v1 as pydantic.v1)
    import pydantic.v1 as pydantic_v1
except ImportError:  # pragma: no cover - pydantic builds without the v1 shim
    pydantic_v1 = None

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


class BytesWithPublicKey(bytes):
    """Bytes that contain a well-formed owner marker, e.g. a subkey that only its owner may
    write (with :class:`~swarmgrad.dht.crypto.Ed25519SignatureValidator` enforcing it).

    A type for both pydantic v2 models and ``pydantic.v1`` models (hivemind's schemas are
    v1): each finds its own validation hook here. Values stay plain ``bytes``."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        return core_schema.no_info_after_validator_function(
            _require_owner_marker, core_schema.bytes_schema(strict=True)
        )

    @classmethod
    def __get_validators__(cls):  # pydantic.v1
        yield cls._validate_v1

    @classmethod
    def _validate_v1(cls, value: Any) -> bytes:
        if not isinstance(value, bytes):
            raise TypeError(f"expected bytes with an owner marker, got {type(value).__name__}")
        return _require_owner_marker(value)


@dataclass(frozen=True)
class _KeyType:
    """One schema field: the DHT key it names and the type its values must have."""

    key: str
    model: type[pydantic.BaseModel]
    field: str
    adapter: TypeAdapter = field(compare=False)

    def mismatch(self, value: Any) -> str | None:
        """Why ``value`` does not fit this field, or None if it does."""
        try:
            self.adapter.validate_python(value, strict=True)
        except pydantic.ValidationError as e:
            return _first_error(e.errors())
        return None


@dataclass(frozen=True)
class _V1KeyType:
    """A field of a ``pydantic.v1`` model (hivemind's schemas): validated by the field
    itself, then refused if pydantic had to convert anything (``"1"`` for an int, ``1.5``
    for a str...), so that v1 schemas are as strict as v2 ones."""

    key: str
    model: type
    field: str
    model_field: Any = field(compare=False)

    def mismatch(self, value: Any) -> str | None:
        parsed, errors = self.model_field.validate(value, {}, loc=self.field, cls=self.model)
        if errors:
            flat = pydantic_v1.ValidationError([errors], self.model).errors()
            return _first_error(flat)
        plain = self.model.construct(**{self.field: parsed}).dict(
            include={self.field}, exclude_unset=True
        )
        if not _same_value(plain[self.field], value):
            return f"the value needed a type conversion to fit (got {value!r})"
        return None


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
        is_v1 = _is_v1_model(schema)
        if not (is_v1 or (isinstance(schema, type) and issubclass(schema, pydantic.BaseModel))):
            raise ValidationError(
                f"SchemaValidator needs a pydantic.BaseModel (or pydantic.v1.BaseModel) "
                f"subclass, got {schema!r}"
            )
        if prefix is not None and not isinstance(prefix, str):
            raise ValidationError(f"the schema prefix must be a str, got {type(prefix).__name__}")
        key_types: dict[bytes, tuple[_KeyType | _V1KeyType, ...]] = {}
        if is_v1:
            for name, model_field in schema.__fields__.items():
                key = f"{prefix}_{model_field.alias}" if prefix is not None else model_field.alias
                key_types[serialize(key)] = (_V1KeyType(key, schema, name, model_field),)
        for name, info in () if is_v1 else schema.model_fields.items():
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
            reasons = []
            for key_type in key_types:
                reason = key_type.mismatch(candidate)
                if reason is None:
                    return True
                reasons.append(f"{key_type.model.__name__}.{key_type.field}: {reason}")
            return _refuse(record, f"the value does not match {'; '.join(reasons)}")
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


def _is_v1_model(schema: Any) -> bool:
    return (
        pydantic_v1 is not None
        and isinstance(schema, type)
        and issubclass(schema, pydantic_v1.BaseModel)
    )


def _first_error(errors: list[dict]) -> str:
    if not errors:
        return "invalid value"
    error = errors[0]
    where = ".".join(str(part) for part in error.get("loc", ()))
    return f"{where}: {error.get('msg', 'invalid value')}" if where else str(error.get("msg"))


def _same_value(parsed: Any, original: Any) -> bool:
    """Equal and of the same types all the way down (an int is fine for a float)."""
    if isinstance(original, dict):
        return (
            isinstance(parsed, dict)
            and len(parsed) == len(original)
            and all(
                _same_value(pk, ok) and _same_value(pv, ov)
                for (pk, pv), (ok, ov) in zip(parsed.items(), original.items(), strict=True)
            )
        )
    if isinstance(original, list | tuple):
        return (
            isinstance(parsed, list | tuple)
            and len(parsed) == len(original)
            and all(_same_value(p, o) for p, o in zip(parsed, original, strict=True))
        )
    if type(original) is int and type(parsed) is float:
        return parsed == original
    return type(parsed) is type(original) and parsed == original


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
