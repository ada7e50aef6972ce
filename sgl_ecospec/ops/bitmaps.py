"""Per-layer expert bitmaps: E experts packed into ceil(E/64) int64 words per layer.

Expert ``e`` is bit ``e % 64`` of word ``e // 64`` (two's complement, so bit 63 makes the
word negative). Bits at positions >= E are always zero.

Shape legend: L = MoE layers, K = experts per token (top-K), E = experts per layer,
W = ceil(E / 64) words per layer.
"""

import torch

from sgl_ecospec.ops import native as _native
from sgl_ecospec.ops.checks import INDEX_DTYPES, check_int, check_tensor

WORD_BITS = 64


def num_words(num_experts: int) -> int:
    """W = ceil(E / 64), the int64 words that hold one layer's E expert bits."""
    return (num_experts + WORD_BITS - 1) // WORD_BITS


def topk_to_bitmap(
    topk_ids: torch.Tensor, num_experts: int, *, validate: bool = True, impl: str = "auto"
) -> torch.Tensor:
    """Packs each token's per-layer top-K expert ids into per-layer bitmaps.

    Args:
        topk_ids: int32 or int64, shape ``[..., L, K]``: expert ids in [0, E). Repeated ids
            in one row set the same bit.
        num_experts: E, experts per layer (>= 1).
        validate: check that every id lies in [0, E) (a host sync on GPU). With False, ids
            outside the range give unspecified bits.
        impl: "auto" (compiled op when built), "native" or "reference".

    Returns:
        int64, shape ``[..., L, W]`` with W = ceil(E / 64).

    Example:
        >>> topk_to_bitmap(torch.tensor([[0, 3]]), 8)
        tensor([[9]])
    """
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, min_ndim=2)
    check_int("num_experts", num_experts, minimum=1)
    if validate:
        check_expert_ids(topk_ids, num_experts)
    if _native.use_native(impl, "topk_to_bitmap", topk_ids.device):
        return _native.ops().topk_to_bitmap(topk_ids.contiguous(), num_experts)
    return topk_to_bitmap_reference(topk_ids, num_experts)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raises ValueError unless every id lies in [0, E) (a host sync on GPU)."""
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    if topk_ids.numel() and bool(bad.any()):
        raise ValueError(
            f"topk_ids holds expert id {int(topk_ids[bad][0])}, outside [0, {num_experts}): "
            f"every id must be a valid expert index for num_experts={num_experts}"
        )


def topk_to_bitmap_reference(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Plain PyTorch version of :func:`topk_to_bitmap` (same shapes, no validation)."""
    words = num_words(num_experts)
    dense = torch.zeros(
        (*topk_ids.shape[:-1], words * WORD_BITS), dtype=torch.bool, device=topk_ids.device
    )
    dense.scatter_(-1, topk_ids.long(), True)
    # Distinct powers of two never carry, so their int64 sum is their bitwise OR
    # (2**63 appears as -2**63, which is the same bit pattern).
    powers = torch.ones(WORD_BITS, dtype=torch.int64, device=topk_ids.device)
    powers = powers << torch.arange(WORD_BITS, device=topk_ids.device)
    dense = dense.view(*dense.shape[:-1], words, WORD_BITS).long()
    return (dense * powers).sum(-1)


def bitmap_popcount(bitmaps: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Counts the set bits of each bitmap (experts per layer).

    Args:
        bitmaps: int64, shape ``[..., W]``.
        impl: "auto", "native" or "reference".

    Returns:
        int64, shape ``[...]``: set bits summed over the W words.
    """
    check_tensor("bitmaps", bitmaps, dtypes=(torch.int64,), min_ndim=1)
    if _native.use_native(impl, "bitmap_popcount", bitmaps.device):
        return _native.ops().bitmap_popcount(bitmaps.contiguous())
    return bitmap_popcount_reference(bitmaps)


_BYTE_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def bitmap_popcount_reference(bitmaps: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch version of :func:`bitmap_popcount`: a 256-entry table over the bytes."""
    if bitmaps.numel() == 0:
        return torch.zeros(bitmaps.shape[:-1], dtype=torch.int64, device=bitmaps.device)
    as_bytes = bitmaps.contiguous().view(torch.uint8).long()
    table = _BYTE_POPCOUNT.to(bitmaps.device)
    counts = table[as_bytes].view(*bitmaps.shape[:-1], bitmaps.shape[-1] * 8)
    return counts.sum(-1)


def bitmap_to_ids(bitmap: torch.Tensor, num_experts: int) -> list[int]:
    """Expert ids set in one layer's bitmap ``[W]`` (int64), ascending; for tests and reports."""
    check_tensor("bitmap", bitmap, ndim=1, dtypes=(torch.int64,))
    return [e for e in range(num_experts) if (int(bitmap[e // WORD_BITS]) >> (e % WORD_BITS)) & 1]
