"""MoESD's ten-parameter performance model of an MoE target and its drafter, and its fit.

Shape legend: P = timing points. Times are seconds; ``batch`` counts requests, ``gamma``
tokens verified per request, ``unique_experts`` distinct routed experts per MoE layer
(averaged over layers).

Model (MoESD, arXiv 2505.19645), with G = ``formulas.roofline_transition`` whose knee is
lam x RP (RP = ``profiles.ridge_tokens``) and N = ``formulas.expected_unique_experts``:

    ar_time(B)            = bias + k1 G(B) + k2 N_ar + k3 G(B K / N_ar),  N_ar = N(B)
    verify_time(B, gamma) = bias + k1 G(B gamma) + k2 N_sd + k3 G(B gamma K / N_sd)
    draft_time(B)         = draft_bias + draft_k G(B)
    reject_time(B)        = reject_bias + reject_k B

N_sd defaults to N(B gamma) (uniform routing) but can be the measured union: the number
EcoSpec lowers by choosing which draft tokens to verify.

``analytic_params`` fits this model to first-principles roofline timings
(``roofline_points``) so predictions exist before anything is measured. Those predictions
are a model of an idealized GPU, not measurements; fit measured points with ``fit_params``
for numbers to trust.
"""

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np
from scipy.optimize import least_squares

from sgl_ecospec.costmodel import formulas
from sgl_ecospec.costmodel.profiles import (
    HardwareProfile,
    ModelProfile,
    dense_load_time,
    expert_load_time,
    ridge_tokens,
)

POINT_KINDS = ("ar", "verify", "draft", "reject")
# Assumed drafter for roofline_points: one EAGLE-3 decoder layer (4 h^2 attention + 8 h^2
# MLP, bf16) and an lm_head over a 32000-token draft vocabulary.
DRAFT_VOCAB = 32000
_DRAFT_LAYER_PARAMS_PER_H2 = 12
# Bytes per vocabulary entry the accept/reject step reads per request (fp32 probabilities).
_REJECT_BYTES_PER_VOCAB = 4
DEFAULT_FIT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_FIT_GAMMAS = (1, 2, 3, 4, 6, 8)


@dataclasses.dataclass(frozen=True)
class MoESDParams:
    """The ten fitted parameters. Times in seconds; G is dimensionless.

    Attributes:
        bias: seconds, fixed cost of a target step (dense weight loads, launches).
        k1: seconds per unit of G(tokens): the dense part's compute.
        k2: seconds per unique expert per layer: loading it in every MoE layer.
        k3: seconds per unit of G(tokens per expert): the expert GEMMs' compute.
        lam: knee of G as a fraction of the ridge point RP.
        s: growth base of G (>= 1).
        draft_bias: seconds, fixed cost of one draft step.
        draft_k: seconds per unit of G(batch) of one draft step.
        reject_bias: seconds, fixed cost of the accept/reject step.
        reject_k: seconds per request of the accept/reject step.
    """

    bias: float
    k1: float
    k2: float
    k3: float
    lam: float
    s: float
    draft_bias: float
    draft_k: float
    reject_bias: float
    reject_k: float

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"MoESDParams.{field.name} must be finite and >= 0, got {value}")
        if not 0 < self.lam <= 1:
            raise ValueError(f"MoESDParams.lam must be in (0, 1], got {self.lam}")
        if self.s < 1:
            raise ValueError(f"MoESDParams.s must be >= 1, got {self.s}")

    def as_dict(self) -> dict[str, float]:
        """Field name -> value."""
        return dataclasses.asdict(self)


PARAM_NAMES = tuple(field.name for field in dataclasses.fields(MoESDParams))


@dataclasses.dataclass(frozen=True)
class TimingPoint:
    """One timed operation, measured or synthetic.

    Attributes:
        kind: "ar" (one target decode step), "verify" (target pass over gamma tokens per
            request), "draft" (one draft step) or "reject" (accept/reject step).
        batch: requests in the batch, >= 1.
        gamma: tokens per request of a "verify" pass (>= 1); must be 1 for other kinds.
        seconds: measured time, > 0.
        unique_experts: measured distinct routed experts per MoE layer (mean over
            layers), for "ar" and "verify" only; None assumes uniform routing.
    """

    kind: str
    batch: int
    gamma: int
    seconds: float
    unique_experts: float | None = None

    def __post_init__(self):
        if self.kind not in POINT_KINDS:
            raise ValueError(f"TimingPoint.kind must be one of {POINT_KINDS}, got {self.kind!r}")
        if self.batch < 1:
            raise ValueError(f"TimingPoint.batch must be >= 1, got {self.batch}")
        if self.gamma < 1 or (self.kind != "verify" and self.gamma != 1):
            raise ValueError(
                f"TimingPoint.gamma must be >= 1, and 1 unless kind is 'verify'; "
                f"got kind={self.kind!r}, gamma={self.gamma}"
            )
        if not self.seconds > 0:
            raise ValueError(f"TimingPoint.seconds must be > 0, got {self.seconds}")
        if self.unique_experts is not None and self.kind not in ("ar", "verify"):
            raise ValueError(
                f"unique_experts applies to 'ar' and 'verify' points, not {self.kind!r}"
            )

    @property
    def tokens(self) -> int:
        """Tokens in the pass: batch x gamma."""
        return self.batch * self.gamma


def _check_unique_experts(model: ModelProfile, tokens: np.ndarray, unique_experts) -> np.ndarray:
    """Validates measured unions against what ``tokens`` routed tokens can touch."""
    n = np.asarray(unique_experts, dtype=np.float64)
    upper = np.minimum(model.num_experts, tokens * model.top_k)
    tol = 1e-9 * model.num_experts
    if np.isnan(n).any() or (n < model.top_k - tol).any() or (n > upper + tol).any():
        raise ValueError(
            f"unique_experts must lie in [top_k={model.top_k}, min(num_experts="
            f"{model.num_experts}, tokens x top_k)] per layer, got {unique_experts!r}"
        )
    return n


def _check_batch(batch) -> np.ndarray:
    b = np.asarray(batch, dtype=np.float64)
    if np.isnan(b).any() or (b < 1).any():
        raise ValueError(f"batch must be >= 1, got {batch!r}")
    return b


class PerformanceModel:
    """Predicts step times and SD speedup for one model on one hardware profile.

    Args:
        model: the target's profile.
        hardware: the accelerator profile (sets the ridge point RP).
        params: fitted or analytic parameters.

    Every method takes floats or numpy arrays (broadcast together) and returns a float
    for scalar inputs, else an array.
    """

    def __init__(self, model: ModelProfile, hardware: HardwareProfile, params: MoESDParams):
        self.model = model
        self.hardware = hardware
        self.params = params
        self.knee = params.lam * ridge_tokens(model, hardware)

    def _g(self, tokens):
        return formulas.roofline_transition(tokens, self.knee, self.params.s)

    def _target_time(self, tokens: np.ndarray, unique_experts):
        model, p = self.model, self.params
        if unique_experts is None:
            n = formulas.expected_unique_experts(tokens, model.num_experts, model.top_k)
        else:
            n = _check_unique_experts(model, tokens, unique_experts)
        per_expert = tokens * model.top_k / n
        return p.bias + p.k1 * self._g(tokens) + p.k2 * n + p.k3 * self._g(per_expert)

    def ar_time(self, batch, unique_experts=None):
        """Seconds of one autoregressive target step.

        Args:
            batch: requests (tokens in the step), >= 1.
            unique_experts: measured distinct experts per layer, or None for N(batch).
        """
        return self._target_time(_check_batch(batch), unique_experts)

    def verify_time(self, batch, gamma, unique_experts=None):
        """Seconds of one verify pass over ``batch x gamma`` tokens.

        Args:
            batch: requests, >= 1.
            gamma: tokens verified per request, integer >= 1.
            unique_experts: distinct experts per layer the pass reads (measured, or what a
                verify-set policy predicts); None for N(batch x gamma), uniform routing.
        """
        tokens = _check_batch(batch) * formulas.check_gamma(gamma)
        return self._target_time(tokens, unique_experts)

    def token_time(self, tokens, unique_experts=None):
        """Seconds one more token adds to a target pass over ``tokens`` tokens, with the
        experts the pass reads held fixed: the compute terms' step
        k1 (G(t + 1) - G(t)) + k3 (G((t + 1) K / N) - G(t K / N)). The load term k2 N does
        not move, because a token whose experts are already loaded costs only compute.

        Args:
            tokens: tokens in the pass, >= 1.
            unique_experts: distinct experts per layer the pass reads, or None for
                N(tokens), uniform routing.
        """
        tokens = np.asarray(tokens, dtype=np.float64)
        if np.isnan(tokens).any() or (tokens < 1).any():
            raise ValueError(f"tokens must be >= 1, got {tokens!r}")
        if unique_experts is None:
            n = formulas.expected_unique_experts(tokens, self.model.num_experts, self.model.top_k)
        else:
            n = _check_unique_experts(self.model, tokens, unique_experts)
        return self._target_time(tokens + 1, n) - self._target_time(tokens, n)

    def draft_time(self, batch):
        """Seconds of one draft step for ``batch`` requests (>= 1)."""
        return self.params.draft_bias + self.params.draft_k * self._g(_check_batch(batch))

    def reject_time(self, batch):
        """Seconds of the accept/reject step for ``batch`` requests (>= 1)."""
        return self.params.reject_bias + self.params.reject_k * _check_batch(batch)

    def sd_speedup(self, batch, gamma, accept_rate, unique_experts=None, ar_unique_experts=None):
        """Predicted SD speedup over autoregressive decoding at the same batch.

        Args:
            batch: requests, >= 1.
            gamma: draft tokens per round (and tokens verified per request), integer >= 1.
            accept_rate: per-token acceptance rate alpha, in [0, 1].
            unique_experts: distinct experts per layer of the verify pass, or None for
                uniform routing (see ``verify_time``).
            ar_unique_experts: distinct experts per layer of the autoregressive step it is
                compared with, or None for N(batch). Give both when both were measured:
                skewed routing shrinks the autoregressive union too.
        """
        sigma = formulas.acceptance_factor(accept_rate, gamma)
        return formulas.sd_speedup(
            sigma,
            gamma,
            self.ar_time(batch, ar_unique_experts),
            self.draft_time(batch),
            self.verify_time(batch, gamma, unique_experts),
            self.reject_time(batch),
        )

    def target_efficiency(self, batch, gamma, unique_experts=None, ar_unique_experts=None):
        """T_T(B, 1) / T_T(B, gamma): arguments as in ``sd_speedup``."""
        return formulas.target_efficiency(
            self.ar_time(batch, ar_unique_experts), self.verify_time(batch, gamma, unique_experts)
        )


@dataclasses.dataclass(frozen=True)
class FitResult:
    """Outcome of ``fit_params``.

    Attributes:
        params: the fitted parameters.
        residuals: float, shape ``[P]``: (predicted - measured) / measured per point.
        points: the P points, in input order.
        fixed: parameters held at 0 because no point of their kind was given.
    """

    params: MoESDParams
    residuals: np.ndarray
    points: tuple[TimingPoint, ...]
    fixed: tuple[str, ...]

    @property
    def rms_residual(self) -> float:
        """Root-mean-square relative residual."""
        return float(np.sqrt(np.mean(self.residuals**2)))

    @property
    def max_abs_residual(self) -> float:
        """Largest |relative residual|."""
        return float(np.max(np.abs(self.residuals)))


# The optimizer works on k1, k3 and draft_k times s^knee ("knee form"): the term's value at
# the knee. In the paper's form those products span 1e-90..1 as s moves over [1, 2] at a
# knee of ~200 tokens; in knee form every quantity stays O(step time) and nothing overflows.
_KNEE_SCALED = ("k1", "k3", "draft_k")
_DRAFT_REJECT = {"draft": ("draft_bias", "draft_k"), "reject": ("reject_bias", "reject_k")}
# Multi-start grid over the nonlinear parameters: least_squares is local, and the G knee
# makes the cost non-convex in (lam, s).
_START_LAM = (0.3, 0.6, 0.95)
_START_S = (1.01, 1.1, 1.5)


def _g_knee_form(tokens: np.ndarray, knee: float, log_s: float) -> np.ndarray:
    """G(tokens) / s^knee: exponent <= 0, so it never overflows."""
    return np.exp((np.minimum(tokens, knee) - knee) * log_s) * (
        1.0 + log_s * np.maximum(tokens - knee, 0.0)
    )


def fit_params(
    points: Sequence[TimingPoint],
    model: ModelProfile,
    hardware: HardwareProfile,
    *,
    load_bounds: bool = True,
) -> FitResult:
    """Fits the ten MoESD parameters to timing points (least squares, relative residuals).

    Bounds follow MoESD: bias in [T_dense, 5 T_dense] with T_dense = ``dense_load_time``;
    k2 in [T_expert, 5 T_expert] with T_expert = ``expert_load_time``; lam in [0.2, 1];
    s in [1, 2]; all others >= 0. ``load_bounds=False`` keeps only bias, k2 >= 0: a real
    software stack's step carries launch and host overheads that no load time bounds
    (``calibration``). Draft or reject parameters with no point of their kind are held at 0
    (listed in ``FitResult.fixed``).

    Args:
        points: at least one "ar" or "verify" point; about 20 spread over batch sizes and
            gammas (MoESD uses 21) pin all ten parameters.
        model: the target's profile (experts, dense size).
        hardware: the profile the points were timed on (sets the bounds and RP).

    Returns:
        The best of several local fits (a grid of starts over lam and s).
    """
    points = tuple(points)
    kinds = np.array([p.kind for p in points])
    if not np.isin(kinds, ("ar", "verify")).any():
        raise ValueError("fit_params needs at least one 'ar' or 'verify' point")
    batch = np.array([p.batch for p in points], dtype=np.float64)
    tokens = np.array([p.tokens for p in points], dtype=np.float64)
    seconds = np.array([p.seconds for p in points], dtype=np.float64)
    is_target = np.isin(kinds, ("ar", "verify"))
    # Points without a measured union use the uniform-routing expectation.
    unique = np.array(
        [
            p.unique_experts
            if p.unique_experts is not None
            else formulas.expected_unique_experts(p.tokens, model.num_experts, model.top_k)
            for p in points
        ]
    )
    _check_unique_experts(model, tokens[is_target], unique[is_target])
    per_expert = tokens * model.top_k / unique
    is_draft, is_reject = kinds == "draft", kinds == "reject"
    rp = ridge_tokens(model, hardware)

    t_dense, t_expert = dense_load_time(model, hardware), expert_load_time(model, hardware)
    ref = float(np.median(seconds))
    scale = {name: ref for name in PARAM_NAMES}
    scale.update(bias=t_dense, k2=t_expert, lam=1.0, s=1.0, reject_k=ref / batch.max())
    lower = dict.fromkeys(PARAM_NAMES, 0.0)
    upper = dict.fromkeys(PARAM_NAMES, np.inf)
    lower.update(bias=t_dense, k2=t_expert, lam=0.2, s=1.0)
    upper.update(bias=5 * t_dense, k2=5 * t_expert, lam=1.0, s=2.0)
    if not load_bounds:
        lower.update(bias=0.0, k2=0.0)
        upper.update(bias=np.inf, k2=np.inf)
    fixed = tuple(
        name for kind, names in _DRAFT_REJECT.items() if not (kinds == kind).any() for name in names
    )
    free = [name for name in PARAM_NAMES if name not in fixed]
    scales = np.array([scale[n] for n in free])

    def unpack(z: np.ndarray) -> dict[str, float]:
        values = dict.fromkeys(PARAM_NAMES, 0.0)
        values.update(zip(free, z * scales, strict=True))
        return values

    def residuals(z: np.ndarray) -> np.ndarray:
        v = unpack(z)
        knee, log_s = v["lam"] * rp, math.log(v["s"])
        target = (
            v["bias"]
            + v["k1"] * _g_knee_form(tokens, knee, log_s)
            + v["k2"] * unique
            + v["k3"] * _g_knee_form(per_expert, knee, log_s)
        )
        draft = v["draft_bias"] + v["draft_k"] * _g_knee_form(batch, knee, log_s)
        reject = v["reject_bias"] + v["reject_k"] * batch
        predicted = np.select([is_target, is_draft, is_reject], [target, draft, reject])
        return predicted / seconds - 1.0

    # Starts: fixed costs just above their floors, variable terms a tenth of a typical step.
    draft_ref = float(np.median(seconds[is_draft])) if is_draft.any() else ref
    reject_ref = float(np.median(seconds[is_reject])) if is_reject.any() else ref
    start = {
        "bias": 1.2 * t_dense,
        "k1": 0.1 * ref,
        "k2": 1.2 * t_expert,
        "k3": 0.1 * ref,
        "draft_bias": 0.5 * draft_ref,
        "draft_k": 0.5 * draft_ref,
        "reject_bias": 0.5 * reject_ref,
        "reject_k": 0.5 * reject_ref / batch.max(),
    }
    lo = np.array([lower[n] for n in free]) / scales
    hi = np.array([upper[n] for n in free]) / scales
    best = None
    for lam, s in itertools.product(_START_LAM, _START_S):
        x0 = np.array([{**start, "lam": lam, "s": s}[n] for n in free]) / scales
        fit = least_squares(residuals, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale="jac")
        if best is None or fit.cost < best.cost:
            best = fit

    values = {name: float(value) for name, value in unpack(best.x).items()}
    knee_growth = math.exp(values["lam"] * rp * math.log(values["s"]))
    for name in _KNEE_SCALED:
        values[name] /= knee_growth
    return FitResult(
        params=MoESDParams(**values),
        residuals=residuals(best.x),
        points=points,
        fixed=fixed,
    )


def _roofline_target_time(model: ModelProfile, hardware: HardwareProfile, tokens: float) -> float:
    """Seconds of a target pass over ``tokens`` tokens on an ideal roofline GPU."""
    bw, peak = hardware.memory_bandwidth, hardware.peak_flops(model.compute_dtype)
    dense = max(model.dense_bytes / bw, 2 * model.dense_params * tokens / peak)
    n = formulas.expected_unique_experts(tokens, model.num_experts, model.top_k)
    per_layer = max(
        n * model.bytes_per_expert / bw, 2 * model.expert_params * tokens * model.top_k / peak
    )
    return dense + model.moe_layers * per_layer


def roofline_points(
    model: ModelProfile,
    hardware: HardwareProfile,
    batches: Iterable[int],
    gammas: Iterable[int],
) -> list[TimingPoint]:
    """Synthetic timings from first principles: a model of an ideal GPU, not measurements.

    Each step costs max(bytes / bandwidth, FLOPs / peak) per part, summed:
    - target: the dense part max(dense_bytes / bw, 2 dense_params tokens / peak) plus, in
      each MoE layer, max(N(tokens) bytes_per_expert / bw, 2 expert_params tokens K / peak),
      uniform routing. Peak is the model's compute dtype.
    - draft (assumption): one EAGLE-3 decoder layer of the target's hidden size h
      (12 h^2 bf16 weights) plus an lm_head over a 32000-token draft vocabulary.
    - reject (assumption): reads one fp32 row of target probabilities per request.
    Not modelled: KV-cache reads and attention over the context (short contexts), kernel
    launch and host overheads, communication between GPUs.

    Args:
        model, hardware: the profiles.
        batches: batch sizes (>= 1); each gives an "ar", a "draft" and a "reject" point.
        gammas: tokens per request (>= 1); each (batch, gamma) gives a "verify" point.

    Returns:
        The points, ar/draft/reject per batch first, then verify per (batch, gamma).
    """
    batches, gammas = list(batches), list(gammas)
    bw = hardware.memory_bandwidth
    draft_params = _DRAFT_LAYER_PARAMS_PER_H2 * model.hidden**2 + DRAFT_VOCAB * model.hidden
    points = []
    for b in batches:
        draft = max(2 * draft_params / bw, 2 * draft_params * b / hardware.peak_bf16_flops)
        reject = _REJECT_BYTES_PER_VOCAB * model.vocab_size * b / bw
        points += [
            TimingPoint("ar", b, 1, _roofline_target_time(model, hardware, b)),
            TimingPoint("draft", b, 1, draft),
            TimingPoint("reject", b, 1, reject),
        ]
    for b, g in itertools.product(batches, gammas):
        points.append(TimingPoint("verify", b, g, _roofline_target_time(model, hardware, b * g)))
    return points


def analytic_params(
    model: ModelProfile,
    hardware: HardwareProfile,
    batches: Iterable[int] = DEFAULT_FIT_BATCHES,
    gammas: Iterable[int] = DEFAULT_FIT_GAMMAS,
) -> FitResult:
    """The MoESD parameters fitted to ``roofline_points``: a prior, not a measurement.

    Args:
        model, hardware: the profiles.
        batches, gammas: the grid of synthetic points (defaults cover 1..4096 tokens).
    """
    return fit_params(roofline_points(model, hardware, batches, gammas), model, hardware)
