"""sgl_ecospec: cost-aware speculative decoding (EcoSpec) for Mixture-of-Experts models.

The library (torch, numpy and scipy only; it never imports transformers, SGLang, the plugin
or the lab): ``ops`` (expert bitmaps, verify-set selection), ``predictors`` (expert
predictors), ``costmodel`` (MoESD), ``placement`` (EP ranks) and ``step`` (the one
selection step the offline engine and the SGLang plugin share). ``sgl_ecospec.lab`` holds
the offline tools built on it. docs/structures.md maps every module.
"""

from sgl_ecospec.ops import (
    POLICIES,
    bitmap_popcount,
    has_native,
    num_words,
    select_verify_set,
    topk_to_bitmap,
)

__all__ = [
    "POLICIES",
    "bitmap_popcount",
    "has_native",
    "num_words",
    "select_verify_set",
    "topk_to_bitmap",
]
