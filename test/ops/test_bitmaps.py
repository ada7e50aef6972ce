import pytest
import torch
from _util import IMPLS, requires_native
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ecospec import bitmap_popcount, num_words, topk_to_bitmap
from sgl_ecospec.ops.bitmaps import (
    bitmap_popcount_reference,
    bitmap_to_ids,
    topk_to_bitmap_reference,
)


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def test_num_words():
    assert [num_words(e) for e in (1, 63, 64, 65, 128, 129, 256)] == [1, 1, 1, 2, 2, 3, 4]


def test_known_bits(impl):
    ids = torch.tensor([[[0, 3], [63, 64]]])  # [1, L=2, K=2], E = 70
    out = topk_to_bitmap(ids, 70, impl=impl)
    assert out.shape == (1, 2, 2) and out.dtype == torch.int64
    assert out[0, 0].tolist() == [0b1001, 0]
    assert out[0, 1].tolist() == [-(2**63), 1]  # bit 63 is the sign bit
    assert bitmap_to_ids(out[0, 1], 70) == [63, 64]


def test_duplicates_and_int32(impl):
    ids = torch.tensor([[5, 5, 7]], dtype=torch.int32)
    out = topk_to_bitmap(ids, 8, impl=impl)
    assert out.tolist() == [[(1 << 5) | (1 << 7)]]
    assert bitmap_popcount(out, impl=impl).tolist() == [2]


@pytest.mark.parametrize("bad", [-1, 8, 1000])
def test_rejects_out_of_range(impl, bad):
    with pytest.raises(ValueError, match=rf"expert id {bad}, outside \[0, 8\)"):
        topk_to_bitmap(torch.tensor([[1, bad]]), 8, impl=impl)


def test_rejects_bad_arguments():
    with pytest.raises(TypeError, match="int32 or int64|dtype"):
        topk_to_bitmap(torch.zeros(2, 2), 8)
    with pytest.raises(ValueError, match="at least 2 dims"):
        topk_to_bitmap(torch.tensor([1, 2]), 8)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        topk_to_bitmap(torch.tensor([[0]]), 0)


def test_empty_shapes(impl):
    assert topk_to_bitmap(torch.zeros(0, 3, 2, dtype=torch.long), 65, impl=impl).shape == (0, 3, 2)
    zero_k = topk_to_bitmap(torch.zeros(2, 3, 0, dtype=torch.long), 65, impl=impl)
    assert zero_k.shape == (2, 3, 2) and not zero_k.any()


@settings(max_examples=60, deadline=None)
@given(
    num_experts=st.integers(1, 300),
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=2),
    layers=st.integers(1, 5),
    top_k=st.integers(0, 9),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
@requires_native
def test_native_matches_reference(num_experts, lead, layers, top_k, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (*lead, layers, top_k), generator=gen).to(dtype)
    expected = topk_to_bitmap_reference(ids, num_experts)
    got = topk_to_bitmap(ids, num_experts, impl="native")
    assert torch.equal(got, expected)
    assert torch.equal(bitmap_popcount(got, impl="native"), bitmap_popcount_reference(got))
    # The bits are exactly the distinct ids of each row.
    flat_ids = ids.reshape(ids.shape[:-1].numel(), top_k)
    flat_bits = got.reshape(ids.shape[:-1].numel(), got.shape[-1])
    for row_ids, row_bits in list(zip(flat_ids, flat_bits, strict=True))[:8]:
        assert bitmap_to_ids(row_bits, num_experts) == sorted(set(row_ids.tolist()))


@settings(max_examples=40, deadline=None)
@given(words=st.integers(0, 5), rows=st.integers(0, 6), seed=st.integers(0, 2**31 - 1))
@requires_native
def test_popcount_matches_python(words, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    bitmaps = torch.randint(-(2**63), 2**63 - 1, (rows, words), generator=gen)
    expected = [sum(bin(w & (2**64 - 1)).count("1") for w in row) for row in bitmaps.tolist()]
    assert bitmap_popcount_reference(bitmaps).tolist() == expected
    assert bitmap_popcount(bitmaps, impl="native").tolist() == expected
