"""MoESD's cost model of speculative decoding on MoE targets (see docs/costmodel.md).

- ``formulas``: closed forms (expected unique experts, saturation threshold, tokens per
  expert, roofline transition G, acceptance factor, speedup, target efficiency).
- ``profiles``: model and hardware numbers.
- ``performance``: the ten-parameter step-time model, its fit, and a roofline prior.
- ``report``: the ``sgl-ecospec costmodel`` command.
"""

from sgl_ecospec.costmodel.formulas import (
    acceptance_factor,
    expected_unique_experts,
    roofline_transition,
    saturation_threshold,
    sd_speedup,
    target_efficiency,
    tokens_per_expert,
)
from sgl_ecospec.costmodel.performance import (
    FitResult,
    MoESDParams,
    PerformanceModel,
    TimingPoint,
    analytic_params,
    fit_params,
    roofline_points,
)
from sgl_ecospec.costmodel.profiles import (
    HardwareProfile,
    ModelProfile,
    dense_load_time,
    expert_load_time,
    get_hardware,
    get_model,
    ridge_tokens,
)

__all__ = [
    "FitResult",
    "HardwareProfile",
    "ModelProfile",
    "MoESDParams",
    "PerformanceModel",
    "TimingPoint",
    "acceptance_factor",
    "analytic_params",
    "dense_load_time",
    "expected_unique_experts",
    "expert_load_time",
    "fit_params",
    "get_hardware",
    "get_model",
    "ridge_tokens",
    "roofline_points",
    "roofline_transition",
    "saturation_threshold",
    "sd_speedup",
    "target_efficiency",
    "tokens_per_expert",
]
