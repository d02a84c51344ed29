"""State chunks, manifests, snapshots, assembly, the chunk scheduler and donor records,
without any network."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmgrad.averaging.state_chunks import (
    CorruptChunk,
    StateAssembler,
    StateManifest,
    StateSnapshot,
)
from swarmgrad.averaging.state_protocol import (
    DonorRecord,
    encode_declaration,
    order_donors,
    parse_declarations,
)
from swarmgrad.averaging.state_scheduler import ChunkScheduler
from swarmgrad.dht.storage import ValueWithExpiration
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

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
