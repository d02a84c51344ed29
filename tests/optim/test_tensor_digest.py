"""TensorDigest: equal tensors give equal digests; a changed value, dtype, shape or order
gives a different one."""

from __future__ import annotations

import torch

from swarmgrad.optim.tensor_digest import TensorDigest


def digest_of(*tensors: torch.Tensor, extra: bytes = b"") -> bytes:
    digest = TensorDigest()
    digest.update_tensors(tensors)
    digest.update_bytes(extra)
    return digest.digest()


def test_equal_tensors_have_equal_16_byte_digests():
    a = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert digest_of(a, a[:10]) == digest_of(a.clone(), a[:10].clone())
    assert len(digest_of(a)) == 16


def test_one_changed_value_changes_the_digest():
    a = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    b = a.clone()
    b[517] = torch.nextafter(b[517], torch.tensor(float("inf")))  # one ulp
    assert digest_of(a) != digest_of(b)


def test_same_bytes_under_another_dtype_or_shape_or_order_differ():
    a = torch.arange(12, dtype=torch.int32)
    assert digest_of(a) != digest_of(a.view(torch.float32))
    assert digest_of(a) != digest_of(a.reshape(3, 4))
    x, y = torch.zeros(3), torch.ones(3)
    assert digest_of(x, y) != digest_of(y, x)
    assert digest_of(x, extra=b"lr=0.1") != digest_of(x, extra=b"lr=0.2")


def test_non_contiguous_tensors_hash_their_values():
    a = torch.arange(16.0).reshape(4, 4)
    assert digest_of(a.t()) == digest_of(a.t().contiguous())
