"""sgl_ecospec: cost-aware speculative decoding (EcoSpec) for Mixture-of-Experts models.

The engine-independent core: expert bitmaps, verify-set selection, expert predictors and
the MoESD cost model. ``docs/`` explains each part.
"""

from sgl_ecospec._native import has_native
from sgl_ecospec.bitmaps import bitmap_popcount, num_words, topk_to_bitmap
from sgl_ecospec.selection import POLICIES, select_verify_set

__all__ = [
    "POLICIES",
    "bitmap_popcount",
    "has_native",
    "num_words",
    "select_verify_set",
    "topk_to_bitmap",
]
