"""The ops: expert bitmaps, verify-set selection, the Triton verify-MoE kernel.

Each op has one public function with its argument checks (``checks``), a plain PyTorch
reference beside it, and a compiled fast path (``native``: the C++ and CUDA ops of
``csrc/``, built as ``sgl_ecospec._C``).
"""

from sgl_ecospec.ops.bitmaps import bitmap_popcount, num_words, topk_to_bitmap
from sgl_ecospec.ops.native import has_native
from sgl_ecospec.ops.selection import DEFAULT_EPS, POLICIES, select_verify_set

__all__ = [
    "DEFAULT_EPS",
    "POLICIES",
    "bitmap_popcount",
    "has_native",
    "num_words",
    "select_verify_set",
    "topk_to_bitmap",
]
