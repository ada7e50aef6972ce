"""Offline tree speculative decoding on transformers (see docs/engine.md).

``OfflineEngine`` runs a Hugging Face MoE target with an EAGLE-3 draft: SGLang's draft-tree
growth, verify-set selection by any ``select_verify_set`` policy, lossless greedy
verification, and the target's real per-layer routing for every verified token.
"""

from sgl_ecospec.lab.engine.config import ENGINE_SELECTION, SpecConfig
from sgl_ecospec.lab.engine.offline import OfflineEngine
from sgl_ecospec.lab.engine.oracle import OracleExpertPredictor
from sgl_ecospec.lab.engine.stats import GreedyResult, SpecResult, StepStats

__all__ = [
    "ENGINE_SELECTION",
    "GreedyResult",
    "OfflineEngine",
    "OracleExpertPredictor",
    "SpecConfig",
    "SpecResult",
    "StepStats",
]
