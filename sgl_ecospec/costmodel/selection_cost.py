"""EcoSpec's selection constants from the fitted MoESD model (see docs/costmodel.md).

EcoSpec ranks a candidate by S = P / (DeltaCost + eps). Read in seconds, verifying the node
costs token_seconds (its compute) plus DeltaCost x expert_seconds (the expert loads it adds),
and gains P expected tokens, so its gain per second is

    P / (token_seconds + DeltaCost x expert_seconds)
        = (1 / expert_seconds) x P / (DeltaCost + token_seconds / expert_seconds),

which ranks nodes exactly as S does with eps = token_seconds / expert_seconds: per-token
compute time over per-expert load time. ``selection_cost`` takes both times from a fitted
``PerformanceModel``, and with them the adaptive policy's account of the step.

``adaptive_draft_steps`` applies the same throughput rule per batch-size bucket, the way
SGLang's adaptive speculative parameters pick draft steps per bucket;
``sglang_adaptive_config`` writes the result as SGLang's ``--speculative-adaptive-config``.
"""

import dataclasses
from collections.abc import Iterable

import numpy as np

from sgl_ecospec.costmodel import formulas
from sgl_ecospec.costmodel.expert_parallel import uniform_ep_verify_time
from sgl_ecospec.costmodel.performance import PerformanceModel

# Below the roofline knee the fitted compute terms barely grow with tokens (G = s^t with s
# near 1), so token_seconds can round to 0; select_verify_set needs eps > 0 to keep fully
# covered nodes ranked by P (P / eps) rather than all tied at infinity.
EPS_FLOOR = 1e-3


@dataclasses.dataclass(frozen=True)
class SelectionCost:
    """The arguments of ``select_verify_set`` that the cost model decides, and the times
    they come from.

    Attributes:
        eps: token_seconds / expert_seconds (at least ``EPS_FLOOR``), in expert loads:
            ``select_verify_set(eps=)``.
        layer_weights: float64, shape ``[L]``, or None (all ones): ``layer_weights=``.
        step_tokens: expected tokens one request's step yields before any candidate (the
            bonus token): ``step_tokens=``.
        step_cost: one request's share of the step's time before any candidate, in expert
            loads, step_seconds / (batch x expert_seconds): ``step_cost=``.
        candidate_cost: what a request's first candidate adds beyond eps, in expert loads:
            ``candidate_cost=``.
        candidate_decay: in [0, 1], how much less each later candidate of a request adds
            (the ratio of the second's to the first's): ``candidate_decay=``.
        token_seconds: seconds one more verified token adds (compute only).
        expert_seconds: seconds of one more expert in one MoE layer (on one rank with EP).
        step_seconds: predicted seconds of the step before any candidate: the draft steps,
            the verify pass over the roots, and accept/reject.
    """

    eps: float
    layer_weights: np.ndarray | None
    step_tokens: float
    step_cost: float
    candidate_cost: float
    candidate_decay: float
    token_seconds: float
    expert_seconds: float
    step_seconds: float


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def selection_cost(
    perf: PerformanceModel,
    batch: int,
    verify_tokens: int,
    *,
    draft_steps: int = 0,
    unique_experts: float | None = None,
    layers: int | None = None,
    ep_size: int = 1,
) -> SelectionCost:
    """eps, layer weights and the adaptive account for one batch size.

    Derivation (units: DeltaCost counts experts per layer, summed over the bitmaps'
    layers):
    - expert_seconds = ep_size x k2 / moe_layers. k2 is the seconds of one more unique
      expert per layer, i.e. loaded in every MoE layer, so one layer's share is
      k2 / moe_layers. With EP the busiest rank sets the pace and streams the expert alone,
      at 1 / ep_size of the group's bandwidth: ``perf.hardware`` must then be the whole EP
      group (e.g. "8xh200" for EP 8), as the fit's bounds assume.
    - token_seconds = ``perf.token_time(batch x verify_tokens, unique_experts)``: the
      compute of one more token in a pass of that size, its experts already loaded.
    - eps = token_seconds / expert_seconds (module docstring), at least ``EPS_FLOOR``.
    - layer_weights: the fitted model has one k2 for every MoE layer, so all layers weigh
      the same; when the bitmaps cover only ``layers`` of the moe_layers (a predictor on a
      subset), each stands for moe_layers / layers of them.
    - step_seconds = draft_steps x draft_time(B) + V(B, 1) + reject_time(B) (the last
      only when drafting), and step_cost = step_seconds / (B x expert_seconds): each
      request's share, in expert loads. V is the verify pass with uniform routing under
      EP (``expert_parallel.uniform_ep_verify_time``; ``verify_time`` at ep_size 1): its
      experts load at the busiest rank's pace, about 2.5 x 8 instead of 8 for one token
      of Qwen3-235B at EP 8, so the union's k2 N alone would price the roots' share too
      low and make "adaptive" decline candidates that pay (docs/RESULTS.md, run 11).
    - candidate_cost, candidate_decay: with uniform routing, every request's k-th candidate
      adds e_k = (V(B, 2 + k) - V(B, 1 + k)) / (B x expert_seconds):
      its compute (eps) and the experts that B more tokens add to the pass, which fall
      geometrically, by (1 - K / E)^B per candidate, as the pass's union fills.
      candidate_cost = e_0 - eps and candidate_decay = (e_1 - eps) / (e_0 - eps) (1 when
      ``verify_tokens`` < 3 gives no second candidate). Selection that charges one eps per
      candidate instead prices a set's first candidates as its last: on the full testbed at
      batch 16 "adaptive" then verified twice as many candidates as EVICT, which charges
      the step time per candidate count, and lost to it (docs/RESULTS.md, sweep run 10).

    Args:
        perf: the fitted model (``fit_params``) or the analytic prior.
        batch: B, requests in the step, >= 1.
        verify_tokens: tokens verified per request, root included (SGLang's
            speculative_num_draft_tokens), >= 1: where the compute slope is taken.
        draft_steps: draft forward passes per step (SGLang's speculative_num_steps), >= 0.
        unique_experts: distinct experts per layer of the verify pass (measured), or None
            for the uniform-routing N(B x verify_tokens).
        layers: MoE layers the expert bitmaps cover (L of ``node_experts``), or None for
            all of the model's.
        ep_size: expert-parallel ranks, >= 1 (1: no EP).

    Returns:
        The constants and the times behind them.
    """
    batch = _check_int("batch", batch, 1)
    verify_tokens = _check_int("verify_tokens", verify_tokens, 1)
    draft_steps = _check_int("draft_steps", draft_steps, 0)
    ep_size = _check_int("ep_size", ep_size, 1)
    moe_layers = perf.model.moe_layers
    if layers is not None:
        layers = _check_int("layers", layers, 1)
        if layers > moe_layers:
            raise ValueError(
                f"layers = {layers} exceeds the model's {moe_layers} MoE layers ({perf.model.name})"
            )
    expert_seconds = ep_size * perf.params.k2 / moe_layers
    if not expert_seconds > 0:
        raise ValueError("the model's k2 (seconds per expert) is 0: eps has no unit")
    token_seconds = float(perf.token_time(batch * verify_tokens, unique_experts))

    def verify(gamma: int) -> float:
        return float(uniform_ep_verify_time(perf, batch, gamma, ep_size))

    step_seconds = verify(1)
    if draft_steps:
        step_seconds += draft_steps * float(perf.draft_time(batch)) + float(perf.reject_time(batch))
    weights = None
    if layers is not None and layers != moe_layers:
        weights = np.full(layers, moe_layers / layers)
    eps = max(token_seconds / expert_seconds, EPS_FLOOR)
    first, second = (
        max(verify(2 + k) - verify(1 + k), 0.0) / (batch * expert_seconds) - eps for k in range(2)
    )
    first = max(first, 0.0)
    decay = min(max(second / first, 0.0), 1.0) if first > 0 and verify_tokens >= 3 else 1.0
    return SelectionCost(
        eps=eps,
        layer_weights=weights,
        step_tokens=1.0,
        step_cost=step_seconds / (batch * expert_seconds),
        candidate_cost=first,
        candidate_decay=decay,
        token_seconds=token_seconds,
        expert_seconds=expert_seconds,
        step_seconds=step_seconds,
    )


def adaptive_draft_steps(
    perf: PerformanceModel,
    batches: Iterable[int],
    accept_rate: float,
    max_steps: int,
) -> dict[int, int]:
    """Draft tokens per request for each batch size, by predicted throughput.

    A chain of k drafts (SGLang's topk 1, speculative_num_steps = k) yields
    1 + alpha + ... + alpha^k expected tokens per request for
    k x draft_time(B) + verify_time(B, k + 1) + reject_time(B) seconds (the pass verifies
    the k drafts and the bonus position); no drafting yields 1 token per ar_time(B). The
    adaptive rule adds a draft while its expected tokens per second beat the step's rate
    so far; with the fixed cost of turning drafting on, the direct form of that rule is
    the k of highest predicted tokens per second, 0 when none beats decoding without
    drafts. Ties go to the smaller k. Uniform routing (``verify_time``'s default), so the
    expert loads are an upper bound on skewed routing's.

    Args:
        perf: the fitted model.
        batches: batch sizes (>= 1), e.g. the lower bounds of SGLang's buckets.
        accept_rate: per-token acceptance rate alpha, in [0, 1].
        max_steps: largest k to consider, >= 1.

    Returns:
        batch size -> draft steps (0 = do not speculate at that batch size).
    """
    max_steps = _check_int("max_steps", max_steps, 1)
    drafts = np.arange(1, max_steps + 1)
    # sigma (k + 1) = 1 + alpha + ... + alpha^k, the expected tokens of a chain of k drafts.
    tokens = formulas.acceptance_factor(accept_rate, drafts) * (drafts + 1)
    steps = {}
    for batch in batches:
        batch = _check_int("batch", batch, 1)
        seconds = (
            drafts * perf.draft_time(batch)
            + perf.verify_time(batch, drafts + 1)
            + perf.reject_time(batch)
        )
        rates = np.concatenate([[1.0 / perf.ar_time(batch)], tokens / seconds])
        # argmax takes the first of equal rates: the fewest drafts.
        steps[batch] = int(np.argmax(rates))
    return steps


def sglang_adaptive_config(steps: dict[int, int]) -> dict[str, dict[str, list[int]]]:
    """SGLang's ``--speculative-adaptive-config`` JSON from ``adaptive_draft_steps``.

    SGLang routes a batch to the bucket with the largest key <= its size and lets an
    acceptance-length EMA choose among the bucket's ``candidate_steps``. Each bucket gets
    0..k: the cost model's k is the ceiling, the measured acceptance may go lower, and a
    bucket with k = 0 never drafts.

    Args:
        steps: batch size -> draft steps, as ``adaptive_draft_steps`` returns.

    Returns:
        {"<batch size>": {"candidate_steps": [0, ..., k]}}; write it with ``json.dump``.
    """
    if not steps:
        raise ValueError("steps is empty: SGLang needs at least one batch-size bucket")
    config = {}
    for batch, k in sorted(steps.items()):
        _check_int("batch size", batch, 1)
        _check_int(f"steps[{batch}]", k, 0)
        config[str(batch)] = {"candidate_steps": list(range(k + 1))}
    return config
