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

The cost model (:func:`cost_model`): a calibration profile file (``SGLANG_ECOSPEC_PROFILE=
FILE`` from ``sgl-ecospec calibrate``, or the one ``SGLANG_ECOSPEC_CALIBRATE=on`` made at
startup: :mod:`sglang_ecospec.startup_calibration`; the served model timed on this device)
when given; otherwise the roofline prior of a model profile on a hardware profile, the
fallback. The log says which.
"""

import bisect
import dataclasses
import logging
import re

from sgl_ecospec.costmodel import (
    ModelProfile,
    PerformanceModel,
    analytic_params,
    get_hardware,
    get_model,
    selection_cost,
)
from sgl_ecospec.costmodel.calibration import CalibrationProfile
from sgl_ecospec.ops.options import SelectionOptions
from sglang_ecospec.settings import EcoSpecSettings, is_calibration_file

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EpsTable:
    """eps by batch-size bucket.

    Attributes:
        batches: ascending bucket keys (the first is 1).
        eps: eps of each bucket, > 0.
        step_costs: policy "adaptive"'s step cost of each bucket, or None.
        candidate_costs: (candidate_cost, candidate_decay) of each bucket, with
            ``step_costs`` (``selection_cost``'s).
    """

    batches: tuple[int, ...]
    eps: tuple[float, ...]
    step_costs: tuple[float, ...] | None = None
    candidate_costs: tuple[tuple[float, float], ...] | None = None

    def lookup(self, batch: int) -> float:
        """eps of the largest bucket <= ``batch`` (the first bucket below it)."""
        return self.eps[self._index(batch)]

    def step_cost(self, batch: int) -> float:
        """A request's share of the step's cost before any candidate, in expert loads, for
        ``batch`` requests (policy "adaptive"; ``selection_cost``'s ``step_cost``)."""
        if self.step_costs is None:
            raise ValueError("this eps table carries no step costs (built without draft_steps)")
        return self.step_costs[self._index(batch)]

    def candidate_cost(self, batch: int) -> tuple[float, float]:
        """(candidate_cost, candidate_decay) for ``batch`` requests (policy "adaptive"): what
        a request's first candidate costs beyond eps, in expert loads, and the factor by
        which each later one's cost falls."""
        if self.candidate_costs is None:
            raise ValueError(
                "this eps table carries no candidate costs (built without draft_steps)"
            )
        return self.candidate_costs[self._index(batch)]

    def _index(self, batch: int) -> int:
        return max(bisect.bisect_right(self.batches, batch) - 1, 0)


class BatchOptions:
    """The selection options of each batch size: the settings' own ``selection`` when eps is
    a number; with eps "auto", the settings' fixed fields (``selection_fields``) and the
    batch's bucket of the cost model (``table``): its eps and, for "adaptive", its step cost
    and candidate costs. One checked :class:`SelectionOptions` per bucket, built on first
    use, so a decode step neither rebuilds nor re-checks its options.
    """

    def __init__(self, settings: EcoSpecSettings, table: EpsTable | None):
        if settings.eps_auto != (table is not None):
            raise ValueError("eps comes from the settings or from the eps table, never both")
        self.table = table
        if table is None:  # one bucket: the settings' own checked options
            self.fields = None
            self._by_bucket = {0: settings.selection}
        else:
            self.fields = settings.selection_fields()
            self._by_bucket: dict[int, SelectionOptions] = {}

    def __call__(self, batch: int) -> SelectionOptions:
        """The options for a batch of ``batch`` requests."""
        bucket = 0 if self.table is None else self.table._index(batch)
        options = self._by_bucket.get(bucket)
        if options is None:
            options = SelectionOptions(**self.fields, **self._bucket_fields(batch))
            self._by_bucket[bucket] = options
        return options

    def _bucket_fields(self, batch: int) -> dict:
        fields = {"eps": self.table.lookup(batch)}
        if self.fields["policy"] == "adaptive":
            cost, decay = self.table.candidate_cost(batch)
            fields.update(
                step_cost=self.table.step_cost(batch), candidate_cost=cost, candidate_decay=decay
            )
        return fields


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch`` (>= 1)."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max(max_batch, 1)]


def check_hardware_covers(hardware: str | None, ep_size: int) -> None:
    """ValueError unless the hardware profile ``hardware`` has at least ``ep_size`` GPUs:
    ``selection_cost`` prices an expert on the busiest of ep_size GPUs at 1 / ep_size of the
    profile's bandwidth. None (a calibration profile: one device's times) passes."""
    if hardware is None:
        return
    name = get_hardware(hardware).name
    match = re.match(r"(\d+)x", name)
    gpus = int(match.group(1)) if match else 1
    if ep_size > gpus:
        raise ValueError(
            f"hardware {name!r} is smaller than the EP group of {ep_size} ranks: name the "
            f"GPUs of one model replica, e.g. {ep_size}x{name}"
        )


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The performance model the server prices with, and where it comes from.

    Attributes:
        perf: the fitted model.
        calibrated: True for a calibration profile file, False for the roofline prior.
        source: what the log names (the file and its fit, or the prior's profiles).
    """

    perf: PerformanceModel
    calibrated: bool
    source: str


def cost_model(profile: str, hardware: str | None) -> CostModel:
    """The calibrated model of the profile file ``profile``, or (``profile`` a model-profile
    name) the roofline prior of that model on ``hardware``.

    Raises:
        ValueError: an unknown name, or a missing or corrupt file (``CalibrationFileError``).
    """
    if is_calibration_file(profile):
        calibration = CalibrationProfile.load(profile)
        source = f"calibrated profile {profile} ({calibration.summary()})"
        return CostModel(calibration.performance_model(), True, source)
    if hardware is None:
        raise ValueError(f"the prior of model profile {profile!r} needs a hardware profile")
    model, gpus = get_model(profile), get_hardware(hardware)
    source = (
        f"prior (fallback; no calibrated profile): roofline analytic_params of {model.name} on "
        f"{gpus.name}; SGLANG_ECOSPEC_CALIBRATE=on, or `sgl-ecospec calibrate` and "
        "SGLANG_ECOSPEC_PROFILE=FILE, fit it to this device"
    )
    return CostModel(
        PerformanceModel(model, gpus, analytic_params(model, gpus).params), False, source
    )


def _check_served(model: ModelProfile, moe_layers: int, num_experts: int, top_k: int) -> None:
    if (model.moe_layers, model.num_experts, model.top_k) != (moe_layers, num_experts, top_k):
        raise ValueError(
            f"cost-model profile {model.name!r} has {model.moe_layers} MoE layers x "
            f"{model.num_experts} experts (top-{model.top_k}), the served model "
            f"{moe_layers} x {num_experts} (top-{top_k}): pick the profile of this model, "
            "or set a numeric SGLANG_ECOSPEC_EPS"
        )


def cost_model_eps_table(
    profile: str,
    hardware: str | None,
    *,
    moe_layers: int,
    num_experts: int,
    top_k: int,
    verify_tokens: int,
    max_batch: int,
    ep_size: int = 1,
    draft_steps: int | None = None,
) -> EpsTable:
    """eps per batch-size bucket from the cost model (:func:`cost_model`).

    Args:
        profile: a calibration profile file, or a ``sgl_ecospec.costmodel.profiles.MODELS``
            name; either must describe the served model (same MoE layers, experts, top-k).
        hardware: for a model-profile name, the hardware profile of the GPUs of one model
            replica (``8xh200``); under EP it must cover at least the ep_size GPUs whose
            busiest one sets the pace. None with a calibration profile.
        moe_layers, num_experts, top_k: the served model's (``routing.moe_layout``).
        verify_tokens: tokens verified per request (speculative_num_draft_tokens).
        max_batch: the largest decode batch (the last bucket).
        ep_size: expert-parallel ranks (1: no EP). A calibration profile's k2 is already
            one device's seconds per expert, the pace of the busiest EP rank, so it is priced
            as is (``selection_cost(ep_size=1)``).
        draft_steps: the draft forward passes per step (speculative_num_steps), or None: the
            table then carries no step costs (only policy "adaptive" reads them).

    Raises:
        ValueError: unknown names, a missing or corrupt file, a profile of another model,
            hardware smaller than the EP group.
    """
    model_cost = cost_model(profile, hardware)
    perf = model_cost.perf
    _check_served(perf.model, moe_layers, num_experts, top_k)
    if not model_cost.calibrated:
        check_hardware_covers(hardware, ep_size)
    priced_ep = 1 if model_cost.calibrated else ep_size
    batches = bucket_sizes(max_batch)
    eps, step_costs, candidate_costs = [], [], []
    for batch in batches:
        # layers = the profile's MoE layers (checked above): no layer weights.
        cost = selection_cost(
            perf,
            batch,
            verify_tokens,
            draft_steps=draft_steps or 0,
            layers=moe_layers,
            ep_size=priced_ep,
        )
        eps.append(cost.eps)
        step_costs.append(cost.step_cost)
        candidate_costs.append((cost.candidate_cost, cost.candidate_decay))
    adaptive = draft_steps is not None
    table = EpsTable(
        tuple(batches),
        tuple(eps),
        tuple(step_costs) if adaptive else None,
        tuple(candidate_costs) if adaptive else None,
    )
    logger.info("ECOSPEC cost model: %s", model_cost.source)
    logger.info(
        "ECOSPEC eps from the cost model (%s on %s, %d verify tokens, ep_size %d): %s",
        perf.model.name,
        perf.hardware.name,
        verify_tokens,
        ep_size,
        ", ".join(f"bs>={b}: {e:.4g}" for b, e in zip(table.batches, table.eps, strict=True)),
    )
    if table.step_costs is not None:
        logger.info(
            "ECOSPEC adaptive step cost per request, in expert loads (%d draft steps): %s",
            draft_steps,
            ", ".join(
                f"bs>={b}: {c:.4g}" for b, c in zip(table.batches, table.step_costs, strict=True)
            ),
        )
        logger.info(
            "ECOSPEC adaptive cost of a request's first candidate, in expert loads, and its "
            "decay per candidate taken: %s",
            ", ".join(
                f"bs>={b}: {c:.4g} x {d:.3g}^k"
                for b, (c, d) in zip(table.batches, table.candidate_costs, strict=True)
            ),
        )
    return table
