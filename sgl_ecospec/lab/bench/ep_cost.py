"""Pricing testbed runs on a real model, with or without expert parallelism (EP).

A step's verify pass is priced by the MoESD model (``costmodel.performance``), whose expert
term is k2 x N: N distinct experts per layer, streamed at the bandwidth of the whole
hardware profile. Under EP R every layer waits for its busiest rank, so the pass costs
``costmodel.expert_parallel.ep_pass_time``: verify_time(tokens, N) + k2 (R b - N), b the
busiest rank's distinct experts per layer (the profile being the whole EP group, "8xh200"
for EP 8, as ``fit_params`` assumes); R = 1 (b = N) gives ``verify_time`` itself.

Scaling the busiest rank to the profile (the imbalance method). The testbed union u_t is
scaled to the profile's u_p with the effective-token method
(``costmodel.scaling.scale_unique_experts``). The testbed's busiest rank b_t is then
carried over as a share of the union: the measured imbalance b_t / (u_t / R) (1 = perfectly
balanced, R = all on one rank) is kept, so

    b_p = min(E_p / R, u_p x b_t / u_t).

Properties (tested): R = 1 gives b_p = u_p; a balanced testbed gives u_p / R; one rank
holding the whole union gives min(u_p, E_p / R); b_p always lies in [u_p / R, u_p]. The
method assumes the profile's routing is as lopsided over ranks as the testbed's. With
fewer experts per rank on the testbed (E_t / R) than on the profile (E_p / R), the same
routing spreads less evenly by chance alone, so the measured imbalance is more likely an
overestimate than an underestimate for larger models.

Shape legend: S = steps, L = MoE layers, W = bitmap words per layer.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from sgl_ecospec.costmodel.expert_parallel import ep_pass_time
from sgl_ecospec.costmodel.performance import PerformanceModel
from sgl_ecospec.costmodel.scaling import scale_unique_experts
from sgl_ecospec.lab.engine.stats import rank_loads
from sgl_ecospec.placement import expert_rank_map


def contiguous_expert_rank(num_experts: int, ep_size: int) -> torch.Tensor:
    """int64 ``[E]``: expert e on rank e // (E / R), SGLang's rank-major layout of physical
    experts with no redundant ones (E must be a multiple of R)."""
    return expert_rank_map(torch.arange(num_experts), num_experts, ep_size)


def busiest_rank_experts(steps: Sequence, num_experts: int, ep_size: int) -> np.ndarray:
    """float64 ``[S, L]``: per step and layer, the most distinct experts one rank holds
    under ``contiguous_expert_rank`` (from each step's ``expert_bitmap`` ``[L, W]``)."""
    return busiest_rank_loads(torch.stack([s.expert_bitmap for s in steps]), num_experts, ep_size)


def busiest_rank_loads(bitmaps: torch.Tensor, num_experts: int, ep_size: int) -> np.ndarray:
    """float64 ``[..., L]``: the most experts of each layer bitmap (int64 ``[..., L, W]``)
    that one rank holds under ``contiguous_expert_rank``; the union when ``ep_size`` is 1."""
    loads = rank_loads(bitmaps, contiguous_expert_rank(num_experts, ep_size), ep_size)
    return loads.amax(-1).double().numpy()


def scale_busiest_rank(busiest, unique, scaled_unique, *, ep_size: int, num_experts: int):
    """The profile's busiest-rank experts by the imbalance method (module docstring).

    Args:
        busiest: b_t, the testbed's busiest-rank experts; float or array.
        unique: u_t, the testbed's union (same shape), with b_t in [u_t / R, u_t].
        scaled_unique: u_p, that union scaled to the profile (same shape).
        ep_size: R (>= 1).
        num_experts: E_p, the profile's experts per layer.

    Returns:
        b_p = min(E_p / R, u_p b_t / u_t), float64, the broadcast shape.
    """
    b, u, u_p = (np.asarray(x, dtype=np.float64) for x in (busiest, unique, scaled_unique))
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    tol = 1e-9
    if (u <= 0).any() or (b > u + tol).any() or (b * ep_size < u - tol).any():
        raise ValueError(
            "busiest must lie in [unique / R, unique] with unique > 0 (a rank holds at most "
            f"the union and the busiest at least its even share); R = {ep_size}"
        )
    # b / u first: exactly 1 when b = u (R = 1), so b_p = u_p bit for bit.
    return np.minimum(num_experts / ep_size, u_p * (b / u))


@dataclasses.dataclass(frozen=True)
class PricedSteps:
    """Steps priced on one profile at one EP size.

    Attributes:
        busiest: float64 ``[S, L]``: testbed busiest-rank experts (the union when R = 1).
        unique_scaled: float64 ``[S, L]``: the unions scaled to the profile.
        busiest_scaled: float64 ``[S, L]``: the busiest rank scaled to the profile.
        seconds: float64 ``[S]``: each step's target pass.
    """

    busiest: np.ndarray
    unique_scaled: np.ndarray
    busiest_scaled: np.ndarray
    seconds: np.ndarray


def price_steps(
    steps: Sequence, perf: PerformanceModel, *, num_experts: int, top_k: int, ep_size: int
) -> PricedSteps:
    """Prices every step's target pass on ``perf``'s profile under EP ``ep_size``.

    Each (step, layer) union is scaled with ``scale_unique_experts`` (capped at tokens x
    K_p, as ``bench.metrics`` does) and its busiest rank with ``scale_busiest_rank``; the
    pass is priced by ``ep_pass_time`` on the means over layers (the layers run one after
    another, so their loads add up).

    Args:
        steps: the engine's ``StepStats`` (with ``expert_bitmap``).
        perf: the profile's model on the EP group's hardware.
        num_experts, top_k: the testbed's E_t and K_t (E_t a multiple of ``ep_size``).
        ep_size: R.
    """
    unique = np.asarray([s.unique_experts for s in steps], dtype=np.float64)  # [S, L]
    tokens = np.asarray([s.verified_tokens for s in steps], dtype=np.float64)  # [S]
    busiest = busiest_rank_experts(steps, num_experts, ep_size) if ep_size > 1 else unique
    return price_passes(
        unique, busiest, tokens, perf, num_experts=num_experts, top_k=top_k, ep_size=ep_size
    )


def price_passes(
    unique: np.ndarray,
    busiest: np.ndarray,
    tokens: np.ndarray,
    perf: PerformanceModel,
    *,
    num_experts: int,
    top_k: int,
    ep_size: int,
) -> PricedSteps:
    """:func:`price_steps` on arrays: testbed unions ``unique`` and busiest ranks
    ``busiest`` float64 ``[S, L]`` of passes of ``tokens`` float64 ``[S]`` tokens."""
    scaled = np.asarray(
        scale_unique_experts(
            unique, num_experts=num_experts, top_k=top_k, profile=perf.model, tokens=tokens[:, None]
        ),
        dtype=np.float64,
    )
    busiest_scaled = scale_busiest_rank(
        busiest, unique, scaled, ep_size=ep_size, num_experts=perf.model.num_experts
    )
    seconds = ep_pass_time(perf, tokens, scaled.mean(1), busiest_scaled.mean(1), ep_size)
    return PricedSteps(busiest, scaled, busiest_scaled, np.asarray(seconds, dtype=np.float64))


def predicted_speedup(
    spec_steps: Sequence,
    spec: PricedSteps,
    ar_steps: Sequence,
    ar: PricedSteps,
    perf: PerformanceModel,
    *,
    num_draft_steps: int,
) -> dict:
    """Predicted step time and speedup of a speculative run over no speculation.

    As ``bench.metrics.predicted_cost``: each speculative step costs its pass plus
    ``num_draft_steps`` x draft_time(B) plus reject_time(B); speedup = (generated tokens /
    speculative seconds) / (greedy tokens / greedy seconds).

    Returns:
        ``step_ms`` (mean speculative step: pass + drafting + accept/reject),
        ``verify_ms`` (mean pass), ``ar_ms`` (mean greedy step), ``speedup`` and
        ``speedup_stderr``: the standard error of the speculative token rate over its
        steps (ratio estimator, steps taken as independent), over the greedy rate; a
        measure of how much the speedup moves with the sample of steps.
    """
    seconds = spec.seconds + _step_overhead(spec_steps, perf, num_draft_steps)  # [S]
    generated = np.asarray([len(s.accepted) + sum(s.accepted) for s in spec_steps], np.float64)
    rate = generated.sum() / seconds.sum()
    ar_rate = _greedy_rate(ar_steps, ar)
    n = len(spec_steps)
    residual = generated - rate * seconds
    stderr = np.sqrt((residual**2).sum() * n / (n - 1)) / seconds.sum() if n > 1 else 0.0
    return {
        "step_ms": 1e3 * float(seconds.mean()),
        "verify_ms": 1e3 * float(spec.seconds.mean()),
        "ar_ms": 1e3 * float(ar.seconds.mean()),
        "speedup": float(rate / ar_rate),
        "speedup_stderr": float(stderr / ar_rate),
    }


def paired_speedup(
    steps: Sequence,
    ar_steps: Sequence,
    ar: PricedSteps,
    perf: PerformanceModel,
    *,
    num_experts: int,
    top_k: int,
    ep_size: int,
    num_draft_steps: int,
) -> dict:
    """The predicted speedups of a run's verify sets and of the compared selection's on the
    same trees (steps with ``paired_bitmaps``, ``paired_accepted``, ``paired_verified``),
    each priced as :func:`predicted_speedup` prices a run, and their paired difference.

    The difference of the two token rates R_j = sum g_j / sum t_j (g generated tokens, t
    seconds per step) gets the standard error of its linearisation over steps (steps taken
    as independent): the residuals (g_0 - R_0 t_0) / sum t_0 - (g_1 - R_1 t_1) / sum t_1.

    Returns:
        ``run``, ``compared`` (the two speedups over no speculation), ``difference`` and
        ``stderr``.
    """
    bitmaps = torch.stack([s.paired_bitmaps for s in steps])  # [S, 2, L, W]
    batch = np.asarray([s.batch_size for s in steps], dtype=np.float64)
    overhead = _step_overhead(steps, perf, num_draft_steps)
    ar_rate = _greedy_rate(ar_steps, ar)
    rates, residuals = [], []
    for j in range(2):
        unique = busiest_rank_loads(bitmaps[:, j], num_experts, 1)  # [S, L]
        busiest = busiest_rank_loads(bitmaps[:, j], num_experts, ep_size)
        tokens = np.asarray([s.paired_verified[j] for s in steps], dtype=np.float64)
        priced = price_passes(
            unique, busiest, tokens, perf, num_experts=num_experts, top_k=top_k, ep_size=ep_size
        )
        seconds = priced.seconds + overhead
        generated = batch + np.asarray([s.paired_accepted[j] for s in steps], dtype=np.float64)
        rate = generated.sum() / seconds.sum()
        rates.append(rate)
        residuals.append((generated - rate * seconds) / seconds.sum())
    n = len(steps)
    diff = residuals[0] - residuals[1]
    stderr = float(np.sqrt((diff**2).sum() * n / (n - 1))) if n > 1 else 0.0
    return {
        "run": float(rates[0] / ar_rate),
        "compared": float(rates[1] / ar_rate),
        "difference": float((rates[0] - rates[1]) / ar_rate),
        "stderr": stderr / ar_rate,
    }


def _step_overhead(steps: Sequence, perf: PerformanceModel, num_draft_steps: int) -> np.ndarray:
    """float64 ``[S]``: each speculative step's seconds besides its target pass: drafting
    (``num_draft_steps`` x draft_time(B)) and accept/reject (reject_time(B))."""
    batch = np.asarray([s.batch_size for s in steps], dtype=np.float64)
    overhead = num_draft_steps * np.asarray(perf.draft_time(batch), dtype=np.float64)
    return overhead + np.asarray(perf.reject_time(batch), dtype=np.float64)


def _greedy_rate(ar_steps: Sequence, ar: PricedSteps) -> float:
    """Tokens per predicted second of the greedy run (no speculation)."""
    return sum(s.verified_tokens for s in ar_steps) / float(ar.seconds.sum())
