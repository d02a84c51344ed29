"""DHT record validators: ed25519-protected keys and subkeys refuse forged, replayed and
malformed records; schemas enforce strict types; composites order their layers; no
validator raises on garbage."""

from __future__ import annotations

import base64
import dataclasses
import math
import struct
from typing import Annotated, Literal

import pydantic
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import Field, StrictInt, conint

from swarmgrad.dht import crypto
from swarmgrad.dht.crypto import Ed25519SignatureValidator, RSASignatureValidator
from swarmgrad.dht.schema import BytesWithPublicKey, SchemaValidator
from swarmgrad.dht.validation import (
    NO_SUBKEY,
    CompositeValidator,
    DHTRecord,
    RecordValidatorBase,
    deserialize,
    serialize,
)
from swarmgrad.net.identity import Identity, verify_signature
from swarmgrad.utils.errors import ValidationError

ALICE = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(1, 33)))
EXPIRATION = 1_700_000_123.25

SUFFIX = crypto.SIGNATURE_SUFFIX_LENGTH


@pytest.fixture
def alice():
    return Ed25519SignatureValidator(ALICE)


@pytest.fixture
def mallory():
    return Ed25519SignatureValidator(MALLORY)


def _record(key, value, subkey=None, expiration=EXPIRATION) -> DHTRecord:
    """A record as the node builds it: key, subkey and value serialized."""
    return DHTRecord(
        serialize(key),
        NO_SUBKEY if subkey is None else serialize(subkey),
        serialize(value),
        expiration,
    )


def _signed(validator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


def _protected_records(validator):
    marker = validator.local_public_key
    return [
        _record(b"key" + marker, {"a": 1}),  # protected key, plain value
        _record("run" + marker.decode(), [1, 2]),  # str key
        _record("key", 42, subkey=b"peer" + marker),  # protected subkey
        _record(b"key" + marker, "v", subkey=b"sub" + marker),  # both, same owner
    ]


# --- wire format -----------------------------------------------------------------------


def test_local_public_key_is_the_documented_owner_marker(alice):
    expected = b"[owner:" + base64.b64encode(ALICE.public_key_bytes) + b"]"
    assert alice.local_public_key == expected
    assert len(expected) == crypto.OWNER_MARKER_LENGTH == 52
    assert crypto.owner_marker(ALICE.public_key_bytes) == expected


def test_signature_suffix_signs_the_documented_payload(alice):
    record = _record("key", b"value", subkey=b"sub" + alice.local_public_key)
    stored = alice.sign_value(record)
    assert stored[: len(record.value)] == record.value
    suffix = stored[len(record.value) :]
    assert len(suffix) == SUFFIX == 100
    assert suffix.startswith(b"[signature:") and suffix.endswith(b"]")
    signature = base64.b64decode(suffix[len(b"[signature:") : -1], validate=True)
    # the payload, built independently of the implementation
    payload = b"swarmgrad/dht-record-signature/v1\x00"
    for part in (record.key, record.subkey, record.value):
        payload += struct.pack(">Q", len(part)) + part
    payload += struct.pack(">d", EXPIRATION)
    assert verify_signature(ALICE.public_key_bytes, signature, payload)


def test_markers_match_their_published_regexes(alice):
    import re

    assert re.fullmatch(Ed25519SignatureValidator.PUBLIC_KEY_REGEX, alice.local_public_key)
    record = _record(b"k" + alice.local_public_key, 1)
    suffix = alice.sign_value(record)[-SUFFIX:]
    assert re.fullmatch(Ed25519SignatureValidator.SIGNATURE_REGEX, suffix)


# --- signatures ------------------------------------------------------------------------


def test_unprotected_records_pass_untouched(alice):
    for record in [_record("key", 1), _record(b"key", b"v", subkey="s"), _record("k", None)]:
        assert alice.validate(record)
        assert alice.sign_value(record) == record.value
        assert alice.strip_value(record) == record.value


def test_sign_validate_strip_round_trip(alice):
    receiver = Ed25519SignatureValidator(Identity.from_seed(b"\x07" * 32))
    for record in _protected_records(alice):
        signed = _signed(alice, record)
        assert signed.value != record.value
        assert alice.validate(signed)
        assert receiver.validate(signed)  # anyone can check, not only the owner
        assert receiver.strip_value(signed) == record.value
        assert deserialize(receiver.strip_value(signed)) == deserialize(record.value)


def test_protected_record_without_signature_is_refused(alice):
    for record in _protected_records(alice):
        assert not alice.validate(record)


def test_record_protected_by_someone_else_is_not_signed_and_refused(alice, mallory):
    for record in _protected_records(alice):
        assert mallory.sign_value(record) == record.value
        assert not mallory.validate(_signed(mallory, record))


def test_forged_signature_by_another_identity_is_refused(alice):
    for record in _protected_records(alice):
        forged_signature = MALLORY.sign(crypto.record_signing_payload(record))
        forged = dataclasses.replace(
            record,
            value=record.value + b"[signature:" + base64.b64encode(forged_signature) + b"]",
        )
        assert not alice.validate(forged)


def test_signature_over_other_fields_is_refused_when_moved(alice):
    marker = alice.local_public_key
    original = _signed(alice, _record("key", 42, subkey=b"peer" + marker))
    suffix = original.value[-SUFFIX:]
    moved = {
        "another key": dataclasses.replace(original, key=serialize("other key")),
        "another subkey": dataclasses.replace(original, subkey=serialize(b"peer2" + marker)),
        "a later expiration": dataclasses.replace(original, expiration_time=EXPIRATION + 1),
        "another value": dataclasses.replace(original, value=serialize(43) + suffix),
        "a plain value": dataclasses.replace(
            original, subkey=NO_SUBKEY, key=serialize(b"k" + marker)
        ),
    }
    assert alice.validate(original)
    for what, record in moved.items():
        assert not alice.validate(record), what


def test_signature_moved_between_key_and_subkey_is_refused(alice):
    # the same bytes split differently between key and subkey must not verify
    marker = alice.local_public_key
    original = _signed(alice, DHTRecord(b"ab" + marker, b"cd", b"\x01", EXPIRATION))
    shifted = dataclasses.replace(original, key=b"a" + marker, subkey=b"bcd")
    shifted2 = dataclasses.replace(original, key=b"ab" + marker + b"c", subkey=b"d")
    assert alice.validate(original)
    assert not alice.validate(shifted)
    assert not alice.validate(shifted2)


_B64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _stray_bits(text: bytes, length: int) -> bytes:
    """``text`` with unused low bits set in its last data character (at ``length - 1``):
    the same bytes in a non-canonical spelling."""
    last = _B64.index(text[length - 1 : length]) + 1
    spelled = text[: length - 1] + _B64[last : last + 1] + text[length:]
    assert base64.b64decode(spelled) == base64.b64decode(text) and spelled != text
    return spelled


def _corrupt_suffixes(signed_value: bytes):
    body = signed_value[-SUFFIX + len(b"[signature:") : -1]
    head = signed_value[:-SUFFIX]
    flipped = (b"B" if body[:1] != b"B" else b"C") + body[1:]
    yield "truncated by one byte", signed_value[:-1]
    yield "closing bracket dropped and a byte added", signed_value[:-1] + b"A"
    yield "base64 shortened", head + b"[signature:" + body[:-4] + b"]"
    yield "base64 without padding", head + b"[signature:" + body.rstrip(b"=") + b"]"
    yield "invalid base64 character", head + b"[signature:" + b"*" + body[1:] + b"]"
    yield "one base64 character changed", head + b"[signature:" + flipped + b"]"
    # the same 64 bytes spelled with a stray low bit set in the last character
    yield "non-canonical base64", head + b"[signature:" + _stray_bits(body, 86) + b"]"
    yield "trailing byte after the signature", signed_value + b" "
    yield "signature twice", signed_value + signed_value[-SUFFIX:]
    yield "signature without its value", signed_value[-SUFFIX:]
    yield "short look-alike", b"[signature:]"
    yield "empty value", b""


def test_malformed_signatures_are_refused(alice):
    record = _record(b"key" + alice.local_public_key, "value")
    signed = _signed(alice, record)
    assert alice.validate(signed)
    for what, value in _corrupt_suffixes(signed.value):
        assert not alice.validate(dataclasses.replace(record, value=value)), what


@pytest.mark.parametrize(
    "marker",
    [
        b"[owner:" + base64.b64encode(ALICE.public_key_bytes)[:-1] + b"]",  # no padding
        b"[owner:" + base64.b64encode(ALICE.public_key_bytes)[:-2] + b"=]",  # short
        b"[owner:" + base64.b64encode(ALICE.public_key_bytes) + b")",  # wrong end
        b"[owner:" + base64.b64encode(ALICE.public_key_bytes[:24]) + b"]",  # 24-byte key
        b"[owner:" + b"*" * 43 + b"=]",  # not base64
        b"[owner:" + _stray_bits(base64.b64encode(ALICE.public_key_bytes), 43) + b"]",
        b"[owner:",
    ],
)
def test_malformed_owner_markers_are_refused(alice, marker):
    record = DHTRecord(b"key" + marker, NO_SUBKEY, serialize(1), EXPIRATION)
    assert not alice.validate(record)
    # even with a valid signature by the key the marker (almost) names
    signature = base64.b64encode(ALICE.sign(crypto.record_signing_payload(record)))
    signed = dataclasses.replace(record, value=record.value + b"[signature:" + signature + b"]")
    assert not alice.validate(signed)
    # a malformed marker is never signed either, so its records cannot be stored at all
    assert alice.sign_value(record) == record.value


def test_two_different_owners_are_refused(alice, mallory):
    record = _record(b"k" + alice.local_public_key, 1, subkey=b"s" + mallory.local_public_key)
    assert alice.sign_value(record) == record.value
    forged = dataclasses.replace(
        record,
        value=record.value
        + b"[signature:"
        + base64.b64encode(ALICE.sign(crypto.record_signing_payload(record)))
        + b"]",
    )
    assert not alice.validate(forged)
    both_in_key = _record(alice.local_public_key + mallory.local_public_key, 1)
    assert not alice.validate(_signed(alice, both_in_key))


def test_unprotected_value_that_ends_like_a_signature_is_accepted_and_kept(alice):
    signed = _signed(alice, _record(b"k" + alice.local_public_key, "v"))
    look_alike = DHTRecord(serialize("plain key"), NO_SUBKEY, signed.value, EXPIRATION)
    assert alice.validate(look_alike)
    assert alice.strip_value(look_alike) == signed.value


def test_non_finite_expiration_cannot_be_signed(alice):
    record = _record(b"k" + alice.local_public_key, 1, expiration=math.inf)
    with pytest.raises(ValidationError):
        alice.sign_value(record)


def test_merged_signature_validators_sign_for_both_identities(alice, mallory):
    composite = CompositeValidator([alice])
    composite.extend([mallory])
    assert composite.validators == (alice,)
    for record in _protected_records(alice) + _protected_records(mallory):
        assert alice.validate(_signed(composite, record))
    assert alice.local_public_key == crypto.owner_marker(ALICE.public_key_bytes)


def test_rsa_name_is_the_ed25519_validator():
    validator = RSASignatureValidator(ALICE)
    assert isinstance(validator, Ed25519SignatureValidator)
    assert "ed25519" in RSASignatureValidator.__doc__
    record = _record(b"k" + validator.local_public_key, 1)
    assert Ed25519SignatureValidator(MALLORY).validate(_signed(validator, record))


def test_validators_without_identity_share_one_process_identity():
    first, second = Ed25519SignatureValidator(), RSASignatureValidator()
    assert first.local_public_key == second.local_public_key
    record = _record(b"k" + first.local_public_key, 1)
    assert second.validate(_signed(first, record))


def test_signature_validator_refuses_a_non_identity():
    with pytest.raises(ValidationError):
        Ed25519SignatureValidator(b"\x00" * 32)


# --- composite -------------------------------------------------------------------------


class _Wrapper(RecordValidatorBase):
    """Wraps values in ``<name>(...)`` and logs what each call saw."""

    def __init__(self, name: str, priority: int, log: list):
        self.name, self._priority, self.log = name, priority, log

    @property
    def priority(self) -> int:
        return self._priority

    def validate(self, record):
        self.log.append(("validate", self.name, record.value))
        return record.value.startswith(self.name.encode() + b"(")

    def sign_value(self, record):
        self.log.append(("sign", self.name, record.value))
        return self.name.encode() + b"(" + record.value + b")"

    def strip_value(self, record):
        self.log.append(("strip", self.name, record.value))
        prefix = self.name.encode() + b"("
        assert record.value.startswith(prefix) and record.value.endswith(b")")
        return record.value[len(prefix) : -1]


def test_composite_signs_lowest_priority_first_and_strips_highest_first():
    log = []
    low, mid, high = _Wrapper("low", 0, log), _Wrapper("mid", 5, log), _Wrapper("high", 10, log)
    composite = CompositeValidator([mid, low])
    composite.extend([high])  # added later, still ordered by priority
    assert composite.validators == (high, mid, low)
    record = DHTRecord(b"k", NO_SUBKEY, b"v", EXPIRATION)

    stored = composite.sign_value(record)
    assert stored == b"high(mid(low(v)))"
    assert [entry[1] for entry in log] == ["low", "mid", "high"]

    log.clear()
    assert composite.validate(dataclasses.replace(record, value=stored))
    assert [(kind, name, value) for kind, name, value in log if kind == "validate"] == [
        ("validate", "high", b"high(mid(low(v)))"),
        ("validate", "mid", b"mid(low(v))"),
        ("validate", "low", b"low(v)"),
    ]

    log.clear()
    assert composite.strip_value(dataclasses.replace(record, value=stored)) == b"v"
    assert [entry[1] for entry in log] == ["high", "mid", "low"]


def test_composite_stops_at_the_first_refusal():
    log = []
    composite = CompositeValidator([_Wrapper("a", 1, log), _Wrapper("b", 0, log)])
    assert not composite.validate(DHTRecord(b"k", NO_SUBKEY, b"b(v)", EXPIRATION))
    assert [entry[1] for entry in log] == ["a"]


def test_composite_equal_priorities_keep_insertion_order():
    log = []
    first, second = _Wrapper("first", 0, log), _Wrapper("second", 0, log)
    composite = CompositeValidator([first])
    composite.extend([second])
    assert composite.validators == (first, second)


def test_composite_flattens_nested_composites_and_merges_same_kind():
    class A(pydantic.BaseModel):
        a: int

    class B(pydantic.BaseModel):
        b: str

    inner = CompositeValidator([SchemaValidator(B), Ed25519SignatureValidator(MALLORY)])
    composite = CompositeValidator([SchemaValidator(A), Ed25519SignatureValidator(ALICE)])
    composite.extend([inner])
    kinds = [type(v) for v in composite.validators]
    assert kinds == [Ed25519SignatureValidator, SchemaValidator]
    assert composite.validate(_record("a", 1)) and composite.validate(_record("b", "x"))
    assert not composite.validate(_record("b", 1))


def test_composite_refuses_instead_of_raising_when_a_validator_raises():
    class Broken(RecordValidatorBase):
        def validate(self, record):
            raise RuntimeError("bug")

    assert not CompositeValidator([Broken()]).validate(_record("k", 1))


def test_composite_refuses_non_validators():
    composite = CompositeValidator()
    with pytest.raises(ValidationError):
        composite.extend([object()])
    assert composite.validators == ()


def test_signature_and_schema_compose(alice):
    class Schema(pydantic.BaseModel):
        progress: dict[BytesWithPublicKey, conint(ge=0, strict=True)]

    composite = CompositeValidator([SchemaValidator(Schema, allow_extra_keys=False)])
    composite.extend([alice])  # signature validator added after the schema one
    record = _record("progress", 7, subkey=alice.local_public_key)
    signed = dataclasses.replace(record, value=composite.sign_value(record))
    assert composite.validate(signed)
    assert deserialize(composite.strip_value(signed)) == 7

    assert not composite.validate(record)  # unsigned
    wrong_type = _record("progress", -1, subkey=alice.local_public_key)
    assert not composite.validate(_signed(composite, wrong_type))
    unprotected_subkey = _record("progress", 7, subkey=b"no marker")
    assert not composite.validate(unprotected_subkey)


# --- schema ----------------------------------------------------------------------------


class Inner(pydantic.BaseModel):
    epoch: conint(ge=0, strict=True)
    rate: float


class Schema(pydantic.BaseModel):
    count: int
    name: str
    blob: bytes
    ratio: float
    flag: bool
    positive: conint(gt=0)
    strict_int: StrictInt
    small: Annotated[int, Field(lt=10)]
    bounded: int = Field(default=0, ge=-5, le=5)
    maybe: int | None = None
    items: list[int] = []
    peers: dict[str, int] = {}
    models: dict[bytes, Inner] = {}
    aliased: int = Field(default=0, alias="with-dash")


@pytest.fixture
def schema():
    return SchemaValidator(Schema, allow_extra_keys=False)


@pytest.mark.parametrize(
    ("key", "good", "bad"),
    [
        ("count", [0, -3, 2**62], ["1", 1.0, True, None, b"1", [1]]),
        ("name", ["", "x"], [b"x", 1, None]),
        ("blob", [b"", b"\x00"], ["x", 1]),
        ("ratio", [0.5, 1], ["0.5", None]),
        ("flag", [True, False], [1, "true", None]),
        ("positive", [1], [0, -1, "1"]),
        ("strict_int", [5], [5.0, "5"]),
        ("small", [9, -100], [10, "1"]),
        ("bounded", [-5, 5], [6, -6, "0"]),
        ("maybe", [None, 3], ["3"]),
        ("items", [[], [1, 2]], [["1"], [1.5], "12"]),
        ("with-dash", [1], ["1"]),
    ],
)
def test_schema_plain_values_are_strictly_typed(schema, key, good, bad):
    for value in good:
        assert schema.validate(_record(key, value)), value
    for value in bad:
        assert not schema.validate(_record(key, value)), value


def test_schema_keeps_discriminators_and_is_strict_even_when_a_field_says_otherwise():
    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pets(pydantic.BaseModel):
        pet: Cat | Dog = Field(discriminator="kind")
        pets: dict[str, Annotated[Cat | Dog, Field(discriminator="kind")]] = {}
        lax: int = Field(default=0, strict=False)

    validator = SchemaValidator(Pets)
    assert validator.validate(_record("pets", {"kind": "cat", "lives": 9}, subkey="tom"))
    assert validator.validate(_record("pets", {"kind": "dog", "good": True}, subkey="rex"))
    assert not validator.validate(_record("pets", {"kind": "dog", "lives": 9}, subkey="rex"))
    assert not validator.validate(_record("pets", {"kind": "cow"}, subkey="rex"))
    pet = validator._key_types[serialize("pet")][0].adapter
    assert isinstance(pet.validate_python({"kind": "dog", "good": True}, strict=True), Dog)
    assert validator.validate(_record("lax", 1))
    assert not validator.validate(_record("lax", "1"))


def test_schema_uses_the_alias_not_the_field_name(schema):
    assert not schema.validate(_record("aliased", 1))  # not a key of the schema


def test_schema_dictionary_subkeys_and_values_are_typed(schema):
    assert schema.validate(_record("peers", 1, subkey="alice"))
    assert not schema.validate(_record("peers", 1, subkey=b"alice"))  # subkey type
    assert not schema.validate(_record("peers", 1, subkey=1))
    assert not schema.validate(_record("peers", "1", subkey="alice"))  # value type
    assert not schema.validate(_record("peers", {"alice": 1}))  # a map without a subkey
    assert not schema.validate(_record("count", 1, subkey="alice"))  # not a dictionary


def test_schema_dictionary_of_models(schema):
    assert schema.validate(_record("models", {"epoch": 3, "rate": 1.5}, subkey=b"p"))
    assert not schema.validate(_record("models", {"epoch": "3", "rate": 1.5}, subkey=b"p"))
    assert not schema.validate(_record("models", {"epoch": -1, "rate": 1.5}, subkey=b"p"))
    assert not schema.validate(_record("models", {"rate": 1.5}, subkey=b"p"))
    assert not schema.validate(_record("models", [3, 1.5], subkey=b"p"))


def test_schema_unhashable_subkey_is_refused(schema):
    assert not schema.validate(_record("peers", 1, subkey=[1, 2]))


def test_schema_extra_keys_follow_the_flag():
    record = _record("unknown", "anything")
    assert SchemaValidator(Schema).validate(record)
    assert not SchemaValidator(Schema, allow_extra_keys=False).validate(record)


def test_schema_prefix_names_the_keys():
    validator = SchemaValidator(Schema, allow_extra_keys=False, prefix="run1")
    assert validator.validate(_record("run1_count", 3))
    assert not validator.validate(_record("run1_count", "3"))
    assert not validator.validate(_record("count", 3))
    assert validator.validate(_record("run1_with-dash", 3))


def test_schema_keys_are_serialized_strings_not_bytes(schema):
    assert not schema.validate(_record(b"count", 3))


def test_schema_refuses_undecodable_values(schema):
    good = _record("count", 3)
    for value in [b"", b"\xc1", serialize(3) + b"\x00", serialize(3)[:0]]:
        assert not schema.validate(dataclasses.replace(good, value=value))
    assert not schema.validate(dataclasses.replace(good, subkey=b"\xc1"))


def test_schemas_merge():
    class First(pydantic.BaseModel):
        shared: int
        only_first: str

    class Second(pydantic.BaseModel):
        shared: str
        only_second: bytes

    merged = SchemaValidator(First, allow_extra_keys=False, prefix="p")
    composite = CompositeValidator([merged])
    composite.extend([SchemaValidator(Second, allow_extra_keys=False, prefix="p")])
    assert composite.validators == (merged,)
    assert merged.schemas == (First, Second)
    assert composite.validate(_record("p_shared", 1))
    assert composite.validate(_record("p_shared", "one"))
    assert not composite.validate(_record("p_shared", b"one"))
    assert composite.validate(_record("p_only_first", "x"))
    assert composite.validate(_record("p_only_second", b"x"))
    assert not composite.validate(_record("p_only_second", "x"))
    assert not composite.validate(_record("p_other", 1))
    composite.extend([SchemaValidator(Second, allow_extra_keys=True)])
    assert composite.validate(_record("p_other", 1))  # extra keys allowed by either


def test_schema_merging_the_same_schema_twice_is_harmless():
    validator = SchemaValidator(Schema)
    validator.merge_with(SchemaValidator(Schema))
    validator.merge_with(validator)
    assert validator.schemas == (Schema,)
    assert validator.validate(_record("count", 1))


def test_schema_validator_needs_a_model():
    with pytest.raises(ValidationError):
        SchemaValidator(dict)


def test_bytes_with_public_key(alice):
    adapter = pydantic.TypeAdapter(BytesWithPublicKey)
    assert adapter.validate_python(b"x" + alice.local_public_key + b"y")
    for bad in [b"x", alice.local_public_key[:-1], alice.local_public_key.decode()]:
        with pytest.raises(pydantic.ValidationError):
            adapter.validate_python(bad)


# --- garbage never raises --------------------------------------------------------------


def _all_validators():
    class S(pydantic.BaseModel):
        count: int
        peers: dict[BytesWithPublicKey, Inner]

    composite = CompositeValidator(
        [SchemaValidator(S, allow_extra_keys=False), Ed25519SignatureValidator(ALICE)]
    )
    return [composite, *composite.validators]


_VALIDATORS = _all_validators()
_MARKER = Ed25519SignatureValidator(ALICE).local_public_key
_fragments = st.sampled_from(
    [
        b"",
        _MARKER,
        _MARKER[:-1],
        b"[owner:",
        b"[signature:",
        b"]",
        b"=",
        serialize("count"),
        serialize("peers"),
        serialize(1),
        b"\xc1",
        b"A" * 44,
    ]
)
_byteish = st.one_of(
    st.binary(max_size=200),
    st.lists(st.one_of(_fragments, st.binary(max_size=20)), max_size=6).map(b"".join),
)


@settings(
    max_examples=400, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
)
@given(
    key=_byteish,
    subkey=_byteish,
    value=_byteish,
    expiration=st.one_of(st.floats(allow_nan=True), st.integers(), st.none(), st.text()),
)
def test_validate_never_raises_on_arbitrary_records(key, subkey, value, expiration):
    record = DHTRecord(key, subkey, value, expiration)
    for validator in _VALIDATORS:
        assert validator.validate(record) in (True, False)
        validator.strip_value(record)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=60))
def test_signed_protected_records_verify_for_any_key_and_value(value, key_tail):
    alice = Ed25519SignatureValidator(ALICE)
    key = key_tail + alice.local_public_key
    # a key holding another, malformed "[owner:" is refused by design (tested elsewhere)
    assume(key.count(b"[owner:") == 1)
    record = DHTRecord(key, NO_SUBKEY, value, EXPIRATION)
    signed = _signed(alice, record)
    assert alice.validate(signed)
    assert alice.strip_value(signed) == value


@pytest.mark.parametrize("garbage", [None, "text", 3, b"\xc1", b"\x92\x01", [1]])
def test_validators_refuse_records_of_the_wrong_shape(garbage):
    for validator in _VALIDATORS:
        for field in ("key", "subkey", "value"):
            record = dataclasses.replace(_record("count", 1), **{field: garbage})
            assert validator.validate(record) in (True, False)


def test_deserialize_refuses_malformed_bytes():
    for bad in [b"", b"\xc1", serialize(1) + b"\x01", b"\x92\x01", "text"]:
        with pytest.raises(ValidationError):
            deserialize(bad)
    assert deserialize(serialize({1: [b"x", "y"]})) == {1: [b"x", "y"]}
