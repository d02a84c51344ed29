"""State chunks, manifests, snapshots, assembly, the chunk scheduler and donor records,
without any network."""

from __future__ import annotations

import hashlib
import logging
import random

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.averaging.state import chunks as state_chunks
from swarmgrad.averaging.state.chunks import (
    CorruptChunk,
    StateAssembler,
    StateManifest,
    StateSnapshot,
)
from swarmgrad.averaging.state.protocol import (
    DonorRecord,
    encode_declaration,
    order_donors,
    parse_declarations,
)
from swarmgrad.averaging.state.scheduler import ChunkScheduler
from swarmgrad.compression import (
    CompressionType,
    Float16Compression,
    NoCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import CodecError, ProtocolViolation, ValidationError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


def random_tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


def sample_state(seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    rng = random.Random(seed)
    tensors = [
        random_tensor(rng, torch.float32, (300, 7)),
        random_tensor(rng, torch.int64, (5,)),
        torch.zeros(0),
        random_tensor(rng, torch.bfloat16, (33,)),
        torch.tensor(3.5),
    ]
    return {"epoch": seed, "name": "state"}, tensors


shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from(DTYPES), shapes), max_size=8),
    chunk_size=st.integers(1024, 5000),
    seed=st.integers(0, 1000),
)
def test_any_state_survives_chunking_and_reassembly_in_any_order(specs, chunk_size, seed):
    rng = random.Random(seed)
    tensors = [random_tensor(rng, dtype, shape) for dtype, shape in specs]
    snapshot = StateSnapshot.build({"seed": seed}, tensors, chunk_size)
    manifest = snapshot.manifest
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in tensors)
    # the chunks tile the byte stream exactly
    covered = [
        (manifest.offsets[t] + o, n) for i in range(manifest.num_chunks) for t, o, n in
        manifest.segments(i)
    ]  # fmt: skip
    position = 0
    for start, length in covered:
        assert start == position and length > 0
        position += length
    assert position == manifest.total_bytes

    wire = StateManifest.from_wire(manifest.to_wire(), source="test")
    assert wire == manifest and wire.root_digest == manifest.root_digest
    assembler = StateAssembler(wire)
    order = list(range(manifest.num_chunks))
    rng.shuffle(order)
    for index in order:
        assembler.write(index, [bytes(p) for p in snapshot.chunk(index)])
        assembler.done.add(index)
    metadata, result = assembler.result(snapshot.metadata)
    assert metadata == {"seed": seed}
    assert len(result) == len(tensors)
    for got, expected in zip(result, tensors, strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)


def test_a_snapshot_is_frozen_unless_told_to_share_memory():
    metadata, tensors = sample_state()
    copied = StateSnapshot.build(metadata, tensors, 1024)
    shared = StateSnapshot.build(metadata, tensors, 1024, copy=False)
    before = bytes(copied.chunk(0)[0])
    tensors[0].add_(1.0)
    assert bytes(copied.chunk(0)[0]) == before
    assert bytes(shared.chunk(0)[0]) != before


def test_chunks_that_do_not_match_the_manifest_are_refused_with_the_index():
    metadata, tensors = sample_state()
    snapshot = StateSnapshot.build(metadata, tensors, 1024)
    assembler = StateAssembler(snapshot.manifest)
    good = bytearray(b"".join(snapshot.chunk(2)))
    flipped = bytearray(good)
    flipped[10] ^= 1
    with pytest.raises(CorruptChunk, match=r"chunk 2 from peer X does not match its digest"):
        assembler.write(2, [flipped], "peer X")
    with pytest.raises(CorruptChunk, match=r"chunk 2 from peer X has 1023 bytes, .* says 1024"):
        assembler.write(2, [good[:-1]], "peer X")
    with pytest.raises(CorruptChunk, match="not a list of byte buffers"):
        assembler.write(2, ["text"], "peer X")
    with pytest.raises(ValidationError, match="out of range"):
        assembler.write(10_000, [good])
    assembler.write(2, [good[:100], good[100:]])  # split parts are fine


def test_metadata_is_checked_against_its_digest_and_must_be_msgpack():
    metadata, tensors = sample_state()
    snapshot = StateSnapshot.build(metadata, tensors[:1], 1024)
    assembler = StateAssembler(snapshot.manifest)
    for index in range(snapshot.manifest.num_chunks):
        assembler.write(index, snapshot.chunk(index))
        assembler.done.add(index)
    with pytest.raises(CorruptChunk, match=r"metadata .* does not match its digest"):
        assembler.result(snapshot.metadata[:-1] + b"\x00")
    with pytest.raises(ValidationError, match="msgpack-serializable"):
        StateSnapshot.build({"bad": object()}, tensors, 1024)
    with pytest.raises(ValidationError, match="state tensor 1 is a list"):
        StateSnapshot.build({}, [tensors[0], [1, 2]], 1024)
    with pytest.raises(ValidationError, match="chunk size"):
        StateSnapshot.build({}, tensors, 10)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.update(tensors=[["float33", [3]]]), "tensor 0: unknown dtype"),
        (lambda m: m.update(tensors=[["float32", [-1]]]), "tensor 0: shape"),
        (lambda m: m.update(chunk_size=3), "chunk size 3"),
        (lambda m: m.update(digests=m["digests"][:-32]), "digests"),
        (lambda m: m.update(digests=m["digests"] + b"x"), "multiple of 32"),
        (lambda m: m.update(tensors=[["float32", [1 << 30, 1 << 20]]]), "larger than the limit"),
        (lambda m: m.update(v=99), "version 99"),
        (lambda m: m.update(metadata_size=-1), "metadata size"),
    ],
)
def test_malformed_manifests_are_refused_naming_the_sender(change, message):
    metadata, tensors = sample_state()
    wire = StateSnapshot.build(metadata, tensors, 1024).manifest.to_wire()
    change(wire)
    with pytest.raises(ProtocolViolation, match=f"from donor-7: .*{message}"):
        StateManifest.from_wire(wire, source="donor-7", max_state_bytes=1 << 40)


def test_switching_targets_keeps_only_chunks_with_the_same_digest():
    metadata, tensors = sample_state()
    old = StateSnapshot.build(metadata, tensors, 1024)
    changed = [t.clone() for t in tensors]
    changed[0][-1, -1] += 1  # only the chunk holding the last float of tensor 0 differs
    new = StateSnapshot.build(metadata, changed, 1024)
    differing = [
        i
        for i in range(old.manifest.num_chunks)
        if old.manifest.chunk_digests[i] != new.manifest.chunk_digests[i]
    ]
    assert len(differing) == 1
    first = StateAssembler(old.manifest)
    for index in range(old.manifest.num_chunks):
        first.write(index, old.chunk(index))
        first.done.add(index)
    second = StateAssembler(new.manifest)
    assert second.adopt(first) == old.manifest.num_chunks - 1
    assert second.missing == differing
    other_layout = StateSnapshot.build(metadata, tensors, 2048)
    assert StateAssembler(other_layout.manifest).adopt(first) == 0


# ---------------------------------------------------------------------- scheduler


def test_scheduler_hands_each_chunk_to_one_donor_and_returns_failed_ones():
    scheduler = ChunkScheduler(range(6))
    scheduler.add_donor("a")
    scheduler.add_donor("b")
    taken = [scheduler.take(d, 0.0, 10.0) for d in "abab"]
    assert sorted(taken) == [0, 1, 2, 3]
    scheduler.fail(taken[0], "a")
    assert scheduler.take("b", 0.0, 10.0) == taken[0]  # back in the pool, lowest first
    assert scheduler.take("a", 0.0, 10.0) == 4
    assert scheduler.remove_donor("b") == sorted([taken[1], taken[3], taken[0]])
    assert scheduler.unobtainable() == []
    for chunk in (0, 1, 3, 5):
        assert scheduler.take("a", 0.0, 10.0) == chunk
    for chunk in range(6):
        scheduler.finish(chunk, "a")
    assert scheduler.complete and not scheduler.has_work("a")


def test_scheduler_endgame_copies_only_chunks_held_too_long():
    scheduler = ChunkScheduler(range(2))
    scheduler.add_donor("slow")
    scheduler.add_donor("fast")
    assert scheduler.take("slow", 0.0, 1.0) == 0
    assert scheduler.take("fast", 0.0, 1.0) == 1
    assert scheduler.finish(1, "fast") == []
    assert scheduler.take("fast", 0.5, 1.0) is None  # not held long enough yet
    assert scheduler.has_work("fast")
    assert scheduler.take("fast", 1.5, 1.0) == 0  # now a copy is fetched
    assert scheduler.take("fast", 9.0, 1.0) is None  # never twice by the same donor
    assert scheduler.finish(0, "fast") == ["slow"]
    assert scheduler.complete


def test_scheduler_respects_which_chunks_a_donor_holds():
    scheduler = ChunkScheduler(range(4))
    scheduler.add_donor("partial", [1, 3])
    assert [scheduler.take("partial", 0, 1) for _ in range(3)] == [1, 3, None]
    assert scheduler.unobtainable() == [0, 2]
    scheduler.add_donor("full")
    assert scheduler.unobtainable() == []
    scheduler.remove_donor("partial")
    assert [scheduler.take("full", 0, 1) for _ in range(5)] == [0, 1, 2, 3, None]


@settings(max_examples=100, deadline=None)
@given(
    num_chunks=st.integers(0, 30),
    partial=st.lists(st.sets(st.integers(0, 29)), max_size=3),
    seed=st.integers(0, 10_000),
)
def test_scheduler_delivers_every_chunk_once_under_random_failures(num_chunks, partial, seed):
    """Donors (one holding everything, some holding subsets) take chunks, fail some and
    deliver others in random order, some donors leave: every chunk is delivered exactly
    once, only by a donor that holds it, and never while that donor already fetches it."""
    rng = random.Random(seed)
    scheduler = ChunkScheduler(range(num_chunks))
    holdings = {"full": None, **{f"p{i}": {c for c in s if c < num_chunks} for i, s in
                                 enumerate(partial)}}  # fmt: skip
    for donor, chunks in holdings.items():
        scheduler.add_donor(donor, chunks)
    fetching: dict[str, set[int]] = {d: set() for d in holdings}
    delivered: list[int] = []
    now = 0.0
    for _ in range(2000):
        if scheduler.complete:
            break
        now += rng.random()
        donor = rng.choice(scheduler.donors)
        chunk = scheduler.take(donor, now, steal_after=2.0)
        if chunk is not None:
            assert holdings[donor] is None or chunk in holdings[donor]
            assert chunk not in fetching[donor] and chunk not in delivered
            fetching[donor].add(chunk)
        busy = [(d, c) for d, cs in fetching.items() for c in cs]
        if busy and rng.random() < 0.6:
            donor, chunk = rng.choice(busy)
            fetching[donor].discard(chunk)
            if rng.random() < 0.3:
                scheduler.fail(chunk, donor)
            elif chunk not in delivered:
                delivered.append(chunk)
                for other in scheduler.finish(chunk, donor):
                    fetching[other].discard(chunk)
        if rng.random() < 0.02 and len(scheduler.donors) > 1:
            leaving = rng.choice([d for d in scheduler.donors if d != "full"])
            scheduler.remove_donor(leaving)
            fetching[leaving].clear()
    assert scheduler.complete and sorted(delivered) == list(range(num_chunks))
    assert scheduler.unobtainable() == []


# ---------------------------------------------------------------------- declarations


def test_declarations_are_parsed_leniently_and_ordered_best_first():
    ids = [Identity.generate().peer_id for _ in range(5)]
    digest = bytes(32)
    entries = {
        ids[0].to_base58(): encode_declaration(1.0, ["/ip4/1.2.3.4/tcp/1"], None, None),
        ids[1].to_base58(): encode_declaration(5.0, [], digest, 100),
        ids[2].to_base58(): encode_declaration(5.0, [], bytes([1] * 32), 100),
        ids[3].to_base58(): encode_declaration(5.0, [], digest, 100),
        ids[4].to_base58(): {"v": 1, "priority": "high", "maddrs": []},  # malformed
        "not-a-peer-id": encode_declaration(9.0, [], None, None),
    }
    found = ValueWithExpiration({k: ValueWithExpiration(v, 1e10) for k, v in entries.items()}, 1e10)
    records = parse_declarations(found, exclude=ids[3])
    assert {r.peer_id for r in records} == {ids[0], ids[1], ids[2]}
    records.append(DonorRecord(ids[3], 5.0, (), digest, 100))
    for seed in range(5):
        ordered = order_donors(records, random.Random(seed))
        # priority 5 first; of those, the two sharing a digest before the odd one out
        assert {r.peer_id for r in ordered[:2]} == {ids[1], ids[3]}
        assert [r.peer_id for r in ordered[2:]] == [ids[2], ids[0]]
    assert parse_declarations(None) == []


def test_among_equal_donors_the_faster_announced_links_come_first():
    ids = [Identity.generate().peer_id for _ in range(5)]
    entries = {
        ids[0].to_base58(): encode_declaration(3.0, [], None, None, bandwidth=10.0),
        ids[1].to_base58(): encode_declaration(3.0, [], None, None, bandwidth=100.0),
        ids[2].to_base58(): encode_declaration(3.0, [], None, None),  # announced nothing
        ids[3].to_base58(): encode_declaration(3.0, [], None, None, bandwidth=20.0),
        # an older peer's declaration (no "bw") and a nonsensical one count as unknown
        ids[4].to_base58(): {"v": 1, "priority": 4.0, "maddrs": [], "bw": -5},
    }
    found = ValueWithExpiration({k: ValueWithExpiration(v, 1e10) for k, v in entries.items()}, 1e10)
    records = parse_declarations(found)
    assert {r.peer_id: r.bandwidth for r in records} == {
        ids[0]: 10.0, ids[1]: 100.0, ids[2]: None, ids[3]: 20.0, ids[4]: None
    }  # fmt: skip
    for seed in range(5):
        ordered = [r.peer_id for r in order_donors(records, random.Random(seed))]
        # a higher priority still wins; the unknown one counts as the median (20)
        assert ordered[0] == ids[4] and ordered[1] == ids[1] and ordered[-1] == ids[0]
        assert set(ordered[2:4]) == {ids[2], ids[3]}


# ---------------------------------------------------------------------- state compression


def assemble(snapshot: StateSnapshot, seed: int = 0) -> tuple[StateAssembler, list[int]]:
    """Every chunk of ``snapshot`` into a fresh assembler, in random order; returns it and
    the encoded tensors in the order :meth:`StateAssembler.finish` reported them ready."""
    manifest = StateManifest.from_wire(snapshot.manifest.to_wire(), source="test")
    assembler = StateAssembler(manifest)
    order = list(range(manifest.num_chunks))
    random.Random(seed).shuffle(order)
    ready = []
    for index in order:
        assembler.write(index, snapshot.chunk(index))
        ready += assembler.finish(index)
    return assembler, ready


def exact_and_mixed_state() -> list[torch.Tensor]:
    rng = random.Random(5)
    return [
        random_tensor(rng, torch.float32, (40, 50)),
        random_tensor(rng, torch.int64, (9,)),
        random_tensor(rng, torch.bool, (13,)),
        torch.zeros(0),
        random_tensor(rng, torch.float64, (300,)),
        random_tensor(rng, torch.uint8, (5, 5)),
    ]


def test_float16_state_compression_halves_the_bytes_and_decodes_to_half_precision():
    tensors = exact_and_mixed_state()
    exact = StateSnapshot.build({"step": 3}, tensors, 1024)
    half = StateSnapshot.build({"step": 3}, tensors, 1024, compression=Float16Compression())
    float_bytes = sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())
    assert exact.manifest.total_bytes == exact.manifest.decoded_bytes
    assert half.manifest.decoded_bytes == exact.manifest.total_bytes
    # float tensors cost half (float32) or a quarter (float64), the rest is unchanged
    saved = 40 * 50 * 2 + 300 * 6
    assert half.manifest.total_bytes == exact.manifest.total_bytes - saved
    assert half.manifest.total_bytes < exact.manifest.total_bytes - float_bytes // 2
    assert half.manifest.encoded == [0, 4]  # not the empty float tensor, nor ints and bools
    assembler, ready = assemble(half)
    assert sorted(ready) == [0, 4] == assembler.pending
    assembler.decode(ready)
    assert assembler.pending == []
    metadata, got = assembler.result(half.metadata)
    assert metadata == {"step": 3}
    for original, decoded in zip(tensors, got, strict=True):
        assert decoded.dtype == original.dtype and decoded.shape == original.shape
        expected = original.half().to(original.dtype) if original.is_floating_point() else original
        assert torch.equal(decoded, expected)


def test_an_8bit_codec_round_trips_within_its_documented_error():
    tensors = exact_and_mixed_state()
    snapshot = StateSnapshot.build({}, tensors, 1024, compression="blockwise_8bit")
    assert snapshot.manifest.total_bytes < snapshot.manifest.decoded_bytes * 0.4
    _, got = assemble(snapshot)[0].result(snapshot.metadata)
    for original, decoded in zip(tensors, got, strict=True):
        assert decoded.dtype == original.dtype and decoded.shape == original.shape
        if original.is_floating_point() and original.numel():
            # docs/compression.md: within 0.69% of the block's absolute maximum
            bound = 0.0069 * float(original.abs().max())
            assert float((decoded.double() - original.double()).abs().max()) <= bound
        else:
            assert torch.equal(decoded, original)  # ints, bools and empty tensors: exact


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from(DTYPES), shapes), max_size=6),
    codec=st.sampled_from([c for c in CompressionType if c != CompressionType.NONE]),
    chunk_size=st.integers(1024, 3000),
    seed=st.integers(0, 1000),
)
def test_any_state_with_any_codec_decodes_to_what_the_codec_gives(specs, codec, chunk_size, seed):
    rng = random.Random(seed)
    tensors = [random_tensor(rng, dtype, shape) for dtype, shape in specs]
    snapshot = StateSnapshot.build({"seed": seed}, tensors, chunk_size, compression=codec)
    again = StateSnapshot.build({"seed": seed}, tensors, chunk_size, compression=codec)
    assert again.manifest == snapshot.manifest  # deterministic: donors agree on manifests
    assembler, ready = assemble(snapshot, seed)
    assert sorted(ready) == snapshot.manifest.encoded
    _, got = assembler.result(snapshot.metadata)
    for original, decoded in zip(tensors, got, strict=True):
        expected = deserialize_torch_tensor(serialize_torch_tensor(original, codec))
        assert decoded.dtype == original.dtype and decoded.shape == original.shape
        assert torch.equal(decoded, expected)


def test_no_compression_keeps_the_manifest_byte_for_byte():
    tensors = [
        torch.arange(600, dtype=torch.float32).reshape(20, 30),
        torch.arange(5),
        torch.zeros(0),
        torch.arange(33).to(torch.bfloat16),
        torch.tensor(3.5),
        torch.arange(7) % 2 == 0,
    ]
    # the figures of this state's manifest before manifests could describe encodings
    wire = msgpack.packb(StateSnapshot.build({"epoch": 0}, tensors, 1024).manifest.to_wire())
    assert hashlib.sha256(wire).hexdigest().startswith("bb7d6368a2c843738005cee2aed3b506")
    for compression in (None, "none", CompressionType.NONE, NoCompression()):
        manifest = StateSnapshot.build({"epoch": 0}, tensors, 1024, compression=compression)
        assert msgpack.packb(manifest.manifest.to_wire()) == wire
        assert manifest.manifest.root_digest.hex().startswith("566172765dbe1e995b588ada147f26a7")
    with pytest.raises(ValidationError, match="unknown compression 'float17'"):
        StateSnapshot.build({}, tensors, 1024, compression="float17")


def test_donors_with_other_codecs_have_other_layouts_and_share_no_chunks():
    tensors = exact_and_mixed_state()
    half = StateSnapshot.build({}, tensors, 1024, compression="float16").manifest
    bf16 = StateSnapshot.build({}, tensors, 1024, compression="bfloat16").manifest
    exact = StateSnapshot.build({}, tensors, 1024).manifest
    assert half.total_bytes == bf16.total_bytes  # same sizes, yet never mixed:
    assert half.layout != bf16.layout and half.layout != exact.layout
    assert len({half.root_digest, bf16.root_digest, exact.root_digest}) == 3
    first = StateAssembler(half)
    assert StateAssembler(bf16).adopt(first) == 0


def test_a_codec_that_cannot_take_a_tensor_leaves_it_exact(caplog):
    class Broken(Float16Compression):
        def encode(self, tensor):
            if tensor.numel() == 300:
                raise CodecError("this codec dislikes 300 elements")
            return super().encode(tensor)

    tensors = exact_and_mixed_state()
    with caplog.at_level(logging.WARNING, logger="swarmgrad.averaging.state.chunks"):
        snapshot = StateSnapshot.build({}, tensors, 1024, compression=Broken())
    assert snapshot.manifest.encoded == [0]
    assert any("state tensor 4 travels exact" in r.getMessage() for r in caplog.records)
    _, got = assemble(snapshot)[0].result(snapshot.metadata)
    assert torch.equal(got[4], tensors[4]) and torch.equal(got[0], tensors[0].half().float())


def encoded_manifest_wire() -> dict:
    tensors = [torch.randn(100, 3), torch.arange(4), torch.randn(50)]
    return StateSnapshot.build({}, tensors, 1024, compression="uniform_8bit").manifest.to_wire()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: e.update(codec="float17"), "tensor 2: unknown codec 'float17'"),
        (lambda e: e.update(codec="none"), "tensor 2: codec 'none' is not the name of a lossy"),
        (lambda e: e.pop("params"), "tensor 2: codec params must be a dict"),
        (lambda e: e["params"].pop("step"), "tensor 2: .*parameter 'step'"),
        (lambda e: e["params"].update(step=float("nan")), "tensor 2: .*parameter 'step'"),
        (lambda e: e["params"].update(junk="x" * 300), "tensor 2: codec params take"),
        (lambda e: e["params"].update(junk=[1, 2]), "tensor 2: codec params must be a dict"),
        (lambda e: e.update(nbytes=49), "tensor 2: .*must have 50 bytes, header announces 49"),
        (lambda e: e.update(nbytes=None), "tensor 2: .*header announces None"),
        (lambda e: e.clear(), "tensor 2: .*not the name of a lossy codec"),
    ],
)
def test_malformed_tensor_encodings_are_refused_naming_the_tensor(change, message):
    wire = encoded_manifest_wire()
    assert len(wire["tensors"][2]) == 3
    change(wire["tensors"][2][2])
    with pytest.raises(ProtocolViolation, match=f"from donor-3: {message}"):
        StateManifest.from_wire(wire, source="donor-3")


def test_other_malformed_encodings_are_refused_naming_the_tensor():
    wire = encoded_manifest_wire()
    wire["tensors"][1].append({"codec": "float16", "params": {}, "nbytes": 8})  # an int64
    with pytest.raises(ProtocolViolation, match="tensor 1: codec 'float16' applies to float"):
        StateManifest.from_wire(wire, source="donor-3")
    wire = encoded_manifest_wire()
    wire["tensors"][0].append("extra")
    with pytest.raises(ProtocolViolation, match=r"tensor 0: expected \[dtype, shape\]"):
        StateManifest.from_wire(wire, source="donor-3")
    wire = encoded_manifest_wire()
    wire["tensors"][2] = ["float32", [50], "float16"]
    with pytest.raises(ProtocolViolation, match="tensor 2: the encoding must be a dict"):
        StateManifest.from_wire(wire, source="donor-3")


def test_the_size_limit_counts_decoded_tensors_and_encoded_payloads():
    numel = 1 << 20
    encoding = {"codec": "float16", "params": {}, "nbytes": 2 * numel}
    wire = {
        "v": 1,
        "tensors": [["float32", [numel], encoding]],
        "chunk_size": 1 << 20,
        "digests": b"\x00" * 64,
        "metadata_digest": b"\x00" * 32,
        "metadata_size": 0,
    }
    manifest = StateManifest.from_wire(wire, source="d", max_state_bytes=6 * numel)
    assert (manifest.total_bytes, manifest.decoded_bytes) == (2 * numel, 4 * numel)
    assert manifest.allocation_bytes == 6 * numel
    # the 2 MiB on the wire fit a 5 MiB limit, but the download would allocate 6 MiB
    with pytest.raises(
        ProtocolViolation,
        match=r"larger than the limit of 5242880 bytes .* tensor 0 \(float32\[1048576\] as float16",
    ):
        StateManifest.from_wire(wire, source="d", max_state_bytes=5 * numel)
    # a codebook payload for an empty tensor still counts
    quantile = {"codec": "quantile_8bit", "params": {}, "nbytes": 1024}
    wire.update(tensors=[["float32", [0], quantile]] * 3, digests=b"\x00" * 96)
    with pytest.raises(ProtocolViolation, match="larger than the limit of 3000 bytes"):
        StateManifest.from_wire(wire, source="d", max_state_bytes=3000)


def test_a_payload_that_decodes_to_another_shape_is_a_violation_naming_donor_and_tensor(
    monkeypatch,
):
    tensors = exact_and_mixed_state()
    snapshot = StateSnapshot.build({}, tensors, 1024, compression="float16")
    assembler, ready = assemble(snapshot)
    real = state_chunks.deserialize_torch_tensor
    monkeypatch.setattr(
        state_chunks, "deserialize_torch_tensor", lambda s: real(s).reshape(-1)[:-1]
    )
    with pytest.raises(
        ProtocolViolation,
        match=r"tensor 0 of the state from peer Q decodes to float32\[1999\], "
        r"the manifest says float32\[40, 50\]",
    ):
        assembler.decode(ready, "peer Q")
    monkeypatch.setattr(state_chunks, "deserialize_torch_tensor", lambda s: real(s).double())
    with pytest.raises(ProtocolViolation, match=r"tensor 0 .* decodes to float64\[40, 50\]"):
        assembler.result(snapshot.metadata, "peer Q")
    monkeypatch.setattr(state_chunks, "deserialize_torch_tensor", real)
    assert torch.equal(assembler.result(snapshot.metadata)[1][0], tensors[0].half().float())


def test_a_tensor_is_not_decoded_before_all_its_chunks_are_in():
    tensors = [torch.randn(3000)]
    snapshot = StateSnapshot.build({}, tensors, 1024, compression="float16")
    assert snapshot.manifest.num_chunks == 6
    assembler = StateAssembler(snapshot.manifest)
    for index in range(5):
        assembler.write(index, snapshot.chunk(index))
        assert assembler.finish(index) == []
    with pytest.raises(ValidationError, match="tensor 0 cannot be decoded: chunks are missing"):
        assembler.decode([0])
    assembler.write(5, snapshot.chunk(5))
    assert assembler.finish(5) == [0]
