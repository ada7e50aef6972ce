"""Aggregating the engine's per-step statistics into benchmark metrics, and pricing them.

Steps are the engine's ``StepStats`` (read by attribute, so any object with these works):
``batch_size`` (requests in the pass), ``verified_tokens`` (tokens the target pass ran,
batch-wide: batch x (budget + 1) for a verify step, batch for a greedy step),
``accepted`` (per request, draft tokens accepted, bonus excluded), ``unique_experts`` (per
MoE layer, distinct experts the pass read) and ``recall`` (predictor recall, or None).

Shape legend: S = steps, L = MoE layers.
"""

from collections.abc import Sequence

import numpy as np

from sgl_ecospec.costmodel import formulas
from sgl_ecospec.costmodel.performance import PerformanceModel
from sgl_ecospec.costmodel.scaling import scale_unique_experts

P90 = 90


def _experts_matrix(steps: Sequence) -> np.ndarray:
    """float64, shape ``[S, L]``: distinct experts per step and layer."""
    rows = [list(s.unique_experts) for s in steps]
    if len({len(r) for r in rows}) != 1 or not rows[0]:
        raise ValueError(
            "every step must report unique_experts for the same number (>= 1) of MoE layers, "
            f"got lengths {sorted({len(r) for r in rows})}"
        )
    return np.asarray(rows, dtype=np.float64)


def _check_steps(steps: Sequence, what: str) -> None:
    if not steps:
        raise ValueError(
            f"no {what} steps were recorded (every request finished at prefill?): raise "
            "--max-new-tokens"
        )


def acceptance_length(steps: Sequence) -> float:
    """Mean over (request, verify step) of accepted draft tokens + 1 (the bonus token).

    The tokens a request gains per verify step: 1 means every draft was rejected.
    """
    _check_steps(steps, "verify")
    pairs = sum(len(s.accepted) for s in steps)
    if pairs == 0:
        raise ValueError("the verify steps list no requests (empty 'accepted')")
    return (pairs + sum(sum(s.accepted) for s in steps)) / pairs


def predicted_acceptance(steps: Sequence) -> dict:
    """Predicted against measured acceptance length of one run.

    A step's prediction (``predicted_accepted`` and ``predicted_accepted_raw``, per request)
    is made before its own verify result is learnt, so it is a forecast on unseen tokens.

    Returns:
        ``predicted_accept_length``: mean over (request, verify step) of 1 + the calibrated
        predicted accepted draft tokens; ``predicted_accept_length_raw``: the same from the
        raw cumulative draft probabilities (the draft's own promise); and each over the
        measured ``accept_length``: ``predicted_accept_ratio``,
        ``predicted_accept_ratio_raw`` (1 = exact). All None when a step recorded none.
    """
    measured = acceptance_length(steps)
    out = {}
    for suffix in ("", "_raw"):
        per_step = [getattr(s, "predicted_accepted" + suffix, None) for s in steps]
        length = None
        if all(p is not None for p in per_step):
            pairs = sum(len(p) for p in per_step)
            length = 1 + sum(sum(p) for p in per_step) / pairs
        out["predicted_accept_length" + suffix] = length
        out["predicted_accept_ratio" + suffix] = None if length is None else length / measured
    return out


def expert_stats(steps: Sequence) -> tuple[float, float]:
    """Mean and 90th percentile (numpy's linear interpolation) of distinct experts over all
    (step, layer) pairs."""
    experts = _experts_matrix(steps)  # [S, L]
    return float(experts.mean()), float(np.percentile(experts, P90))


def summarize(steps: Sequence) -> dict:
    """Testbed metrics of one run (verify steps of one policy and budget).

    Returns:
        ``verify_steps``, ``request_steps`` ((request, step) pairs), ``tokens`` (tokens
        generated: accepted + 1 summed over requests and steps), ``accept_length``,
        ``experts_per_layer_step`` and ``experts_per_layer_step_p90`` (``expert_stats``) and
        ``predictor_recall`` (mean of the steps' recall, None when no step has one).
    """
    _check_steps(steps, "verify")
    mean, p90 = expert_stats(steps)
    recalls = [s.recall for s in steps if s.recall is not None]
    request_steps = sum(len(s.accepted) for s in steps)
    return {
        "verify_steps": len(steps),
        "request_steps": request_steps,
        "tokens": request_steps + sum(sum(s.accepted) for s in steps),
        "accept_length": acceptance_length(steps),
        "experts_per_layer_step": mean,
        "experts_per_layer_step_p90": p90,
        "predictor_recall": float(np.mean(recalls)) if recalls else None,
    }


def uniform_experts(steps: Sequence, num_experts: int, top_k: int) -> float:
    """Mean over steps of N(verified_tokens): the union uniform routing would give."""
    _check_steps(steps, "verify")
    tokens = np.array([s.verified_tokens for s in steps], dtype=np.float64)
    return float(np.mean(formulas.expected_unique_experts(tokens, num_experts, top_k)))


def equivalent_alpha(accept_length: float, num_draft_steps: int) -> float:
    """Per-token acceptance rate of a draft chain with the same acceptance length.

    Solves sigma(alpha, n) (n + 1) = accept_length for alpha (bisection), n =
    ``num_draft_steps``, sigma = ``formulas.acceptance_factor``: a tree's acceptance
    expressed as MoESD's chain model sees it. 0 at accept_length = 1, 1 at n + 1.
    """
    n = num_draft_steps
    if not 1 - 1e-9 <= accept_length <= n + 1 + 1e-9:
        raise ValueError(
            f"accept_length must be in [1, num_draft_steps + 1 = {n + 1}], got {accept_length}"
        )
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if formulas.acceptance_factor(mid, n) * (n + 1) < accept_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _priced_passes(steps: Sequence, perf: PerformanceModel, num_experts: int, top_k: int):
    """Scaled unions ``[S, L]``, and seconds ``[S]`` of each step's target pass."""
    experts = _experts_matrix(steps)  # [S, L]
    tokens = np.array([s.verified_tokens for s in steps], dtype=np.float64)  # [S]
    scaled = np.asarray(
        scale_unique_experts(
            experts,
            num_experts=num_experts,
            top_k=top_k,
            profile=perf.model,
            tokens=tokens[:, None],
        ),
        dtype=np.float64,
    )
    # The target's step time depends on the batch only through tokens = batch x gamma, so a
    # pass of any shape is priced as one request of ``tokens`` tokens.
    seconds = np.asarray(perf.verify_time(1, tokens, scaled.mean(axis=1)), dtype=np.float64)
    return scaled, seconds


def predicted_ar(ar_steps: Sequence, perf: PerformanceModel, *, num_experts: int, top_k: int):
    """Autoregressive steps priced on the profile: ``experts_per_layer_step`` (scaled, see
    ``predicted_cost``) and ``ar_ms`` (mean predicted step time)."""
    _check_steps(ar_steps, "greedy")
    scaled, seconds = _priced_passes(ar_steps, perf, num_experts, top_k)
    return {"experts_per_layer_step": float(scaled.mean()), "ar_ms": 1e3 * float(seconds.mean())}


def predicted_cost(
    spec_steps: Sequence,
    ar_steps: Sequence,
    perf: PerformanceModel,
    *,
    num_experts: int,
    top_k: int,
    num_draft_steps: int,
) -> dict:
    """Prices a testbed run on a real model and hardware with the MoESD model.

    Every testbed (step, layer) union is scaled to the profile with
    ``scale_unique_experts`` (effective-token method; capped at tokens x K_p), then each
    step is priced on its own and the totals are compared:

    - verify pass: ``verify_time`` over the step's physical tokens (batch x (budget + 1):
      the drafts plus the bonus position) with its scaled union (mean over layers);
    - drafting: ``num_draft_steps`` x ``draft_time(batch)`` (each draft forward reads the
      draft weights once; its width topk is not priced);
    - accept/reject: ``reject_time(batch)``;
    - autoregressive baseline: ``ar_time(batch)`` per greedy step, with that step's scaled
      union.

    speedup = (tokens per second of SD) / (tokens per second of AR) = (sum of accepted + 1)
    / T_SD over (sum of batch) / T_AR. With every step alike it equals MoESD's
    sigma (gamma + 1) T_T(B, 1) / (gamma T_D + T_T(B, gamma') + T_reject) with gamma =
    num_draft_steps, sigma (gamma + 1) = the measured acceptance length, and gamma' = budget
    + 1 tokens verified per request.

    Args:
        spec_steps: verify steps of one run.
        ar_steps: greedy (autoregressive) steps on the same prompts and batches.
        perf: the performance model of the real model and hardware.
        num_experts, top_k: the testbed's E_t and K_t.
        num_draft_steps: draft forwards per round (SpecConfig.num_steps).

    Returns:
        ``experts_per_layer_step`` and ``experts_per_layer_step_p90`` (scaled to the
        profile), ``expert_bytes_per_step`` (scaled mean x moe_layers x bytes_per_expert),
        ``verify_ms``, ``draft_ms``, ``reject_ms`` (means per verify step), ``ar_ms`` (mean
        per greedy step), ``speedup``, and ``alpha`` (``equivalent_alpha``).
    """
    _check_steps(spec_steps, "verify")
    _check_steps(ar_steps, "greedy")
    model = perf.model
    spec_experts, verify = _priced_passes(spec_steps, perf, num_experts, top_k)  # [S, L], [S]
    _, ar = _priced_passes(ar_steps, perf, num_experts, top_k)
    spec_batch = np.array([s.batch_size for s in spec_steps], dtype=np.float64)
    draft = num_draft_steps * np.asarray(perf.draft_time(spec_batch), dtype=np.float64)
    reject = np.asarray(perf.reject_time(spec_batch), dtype=np.float64)

    accept_length = acceptance_length(spec_steps)
    generated = sum(len(s.accepted) + sum(s.accepted) for s in spec_steps)
    sd_rate = generated / float(np.sum(verify + draft + reject))
    ar_rate = sum(s.verified_tokens for s in ar_steps) / float(np.sum(ar))
    mean_experts = float(spec_experts.mean())
    return {
        "experts_per_layer_step": mean_experts,
        "experts_per_layer_step_p90": float(np.percentile(spec_experts, P90)),
        "expert_bytes_per_step": mean_experts * model.moe_layers * model.bytes_per_expert,
        "verify_ms": 1e3 * float(verify.mean()),
        "draft_ms": 1e3 * float(draft.mean()),
        "reject_ms": 1e3 * float(reject.mean()),
        "ar_ms": 1e3 * float(ar.mean()),
        "speedup": sd_rate / ar_rate,
        "alpha": equivalent_alpha(min(accept_length, num_draft_steps + 1), num_draft_steps),
    }


def first_mismatch(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first token where ``got`` differs from ``expected`` (a length
    difference counts at the shorter length), or None when they are equal."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def lossless_status(entry: dict) -> str:
    """ "yes" (every output equal), "tie" (diverged only at near ties) or "NO", for the
    tables of a run's ``lossless``/``mismatch_count`` fields (``OutputCheck.fields``)."""
    if entry["lossless"]:
        return "yes"
    return "tie" if entry["mismatch_count"] == 0 else "NO"
