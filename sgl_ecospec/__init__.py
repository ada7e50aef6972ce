"""sgl_ecospec: cost-aware speculative decoding (EcoSpec) for Mixture-of-Experts models.

The library (torch, numpy, scipy and safetensors; it never imports transformers, SGLang,
the plugin or the lab): ``ops`` (expert bitmaps, verify-set selection), ``predictors``
(expert predictors), ``costmodel`` (MoESD, its calibration), ``models`` (the EAGLE-3 draft,
the target's forward over a KV cache), ``placement`` (EP ranks) and ``step`` (the one
selection step the offline engine and the SGLang plugin share). ``sgl_ecospec.lab`` holds
the offline tools built on it. docs/structures.md maps every module.

The public ops are re-exported here: ``select_verify_set``, ``topk_to_bitmap``,
``bitmap_popcount``, ``num_words``, ``POLICIES``, ``DEFAULT_EPS`` and ``has_native``.
"""

from sgl_ecospec import ops
from sgl_ecospec.ops import *  # noqa: F403 (the ops are the package's public API)

__all__ = list(ops.__all__)
