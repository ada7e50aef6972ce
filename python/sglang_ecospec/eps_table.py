"""eps per batch-size bucket, from the cost model (``SGLANG_ECOSPEC_EPS=auto``).

``sgl_ecospec.costmodel.selection_cost`` gives eps = token_seconds / expert_seconds for one
batch size: the compute of one more verified token over the load of one more expert in one
layer (docs/costmodel.md). Past the roofline knee the token's compute grows with the pass,
so eps does too. At startup :func:`cost_model_eps_table` evaluates it once per bucket (powers
of two up to the largest batch, SGLang's bucket rule: the largest key <= the batch size);
the selector looks its batch up on the host (the batch size is a Python int there), so no
device sync. A CUDA graph captured for a padded batch size uses that size's bucket.

Layer weights: the predictor covers every MoE layer of the served model and the fitted model
has one expert cost for all of them, so ``selection_cost`` returns none (all ones); the
profile must describe the served model (checked).
"""

import bisect
import dataclasses
import logging
import re

from sgl_ecospec.costmodel import (
    PerformanceModel,
    analytic_params,
    get_hardware,
    get_model,
    selection_cost,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EpsTable:
    """eps by batch-size bucket.

    Attributes:
        batches: ascending bucket keys (the first is 1).
        eps: eps of each bucket, > 0.
    """

    batches: tuple[int, ...]
    eps: tuple[float, ...]

    def lookup(self, batch: int) -> float:
        """eps of the largest bucket <= ``batch`` (the first bucket below it)."""
        index = bisect.bisect_right(self.batches, batch) - 1
        return self.eps[max(index, 0)]


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch`` (>= 1)."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max(max_batch, 1)]


def check_hardware_covers(hardware: str, ep_size: int) -> None:
    """ValueError unless the hardware profile ``hardware`` has at least ``ep_size`` GPUs:
    ``selection_cost`` prices an expert on the busiest of ep_size GPUs at 1 / ep_size of the
    profile's bandwidth."""
    name = get_hardware(hardware).name
    match = re.match(r"(\d+)x", name)
    gpus = int(match.group(1)) if match else 1
    if ep_size > gpus:
        raise ValueError(
            f"hardware {name!r} is smaller than the EP group of {ep_size} ranks: name the "
            f"GPUs of one model replica, e.g. {ep_size}x{name}"
        )


def cost_model_eps_table(
    profile: str,
    hardware: str,
    *,
    moe_layers: int,
    num_experts: int,
    top_k: int,
    verify_tokens: int,
    max_batch: int,
    ep_size: int = 1,
) -> EpsTable:
    """eps per batch-size bucket from the analytic cost model of ``profile`` on ``hardware``.

    Args:
        profile: a ``sgl_ecospec.costmodel.profiles.MODELS`` name; must describe the served
            model (same MoE layers, experts, top-k).
        hardware: a hardware profile name for the GPUs of one model replica (``8xh200``);
            under EP it must cover at least the ep_size GPUs whose busiest one sets the pace.
        moe_layers, num_experts, top_k: the served model's (``routing.moe_layout``).
        verify_tokens: tokens verified per request (speculative_num_draft_tokens).
        max_batch: the largest decode batch (the last bucket).
        ep_size: expert-parallel ranks (1: no EP).

    Raises:
        ValueError: unknown names, a profile of another model, hardware smaller than the EP
            group.
    """
    model, gpus = get_model(profile), get_hardware(hardware)
    served = (moe_layers, num_experts, top_k)
    if (model.moe_layers, model.num_experts, model.top_k) != served:
        raise ValueError(
            f"cost-model profile {model.name!r} has {model.moe_layers} MoE layers x "
            f"{model.num_experts} experts (top-{model.top_k}), the served model "
            f"{moe_layers} x {num_experts} (top-{top_k}): pick the profile of this model, "
            "or set a numeric SGLANG_ECOSPEC_EPS"
        )
    check_hardware_covers(hardware, ep_size)
    perf = PerformanceModel(model, gpus, analytic_params(model, gpus).params)
    batches = bucket_sizes(max_batch)
    eps = []
    for batch in batches:
        # layers = the profile's MoE layers (checked above): no layer weights.
        cost = selection_cost(perf, batch, verify_tokens, layers=moe_layers, ep_size=ep_size)
        eps.append(cost.eps)
    table = EpsTable(tuple(batches), tuple(eps))
    logger.info(
        "ECOSPEC eps from the cost model (%s on %s, %d verify tokens, ep_size %d): %s",
        model.name,
        gpus.name,
        verify_tokens,
        ep_size,
        ", ".join(f"bs>={b}: {e:.4g}" for b, e in zip(table.batches, table.eps, strict=True)),
    )
    return table
