"""MoESD's cost model of speculative decoding on MoE targets (see docs/costmodel.md).

- ``formulas``: closed forms (expected unique experts, saturation threshold, tokens per
  expert, roofline transition G, acceptance factor, speedup, target efficiency).
- ``profiles``: model and hardware numbers.
- ``performance``: the ten-parameter step-time model, its fit, and a roofline prior.
- ``expert_parallel``: the verify pass under expert parallelism, paced by the busiest rank.
- ``calibration``: the model fitted to forwards timed on the running device, and its
  profile file (``sgl-ecospec calibrate``).
- ``selection_cost``: EcoSpec's eps, layer weights and adaptive account from that model,
  and draft steps per batch-size bucket for SGLang.
- ``report``: the ``sgl-ecospec costmodel`` command.
"""

from sgl_ecospec.costmodel.calibration import (
    CalibrationFileError,
    CalibrationGrid,
    CalibrationProfile,
)
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
from sgl_ecospec.costmodel.selection_cost import (
    EPS_FLOOR,
    SelectionCost,
    adaptive_draft_steps,
    selection_cost,
    sglang_adaptive_config,
)

__all__ = [
    "CalibrationFileError",
    "CalibrationGrid",
    "CalibrationProfile",
    "EPS_FLOOR",
    "FitResult",
    "HardwareProfile",
    "ModelProfile",
    "MoESDParams",
    "PerformanceModel",
    "SelectionCost",
    "TimingPoint",
    "acceptance_factor",
    "adaptive_draft_steps",
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
    "selection_cost",
    "sglang_adaptive_config",
    "saturation_threshold",
    "sd_speedup",
    "target_efficiency",
    "tokens_per_expert",
]
