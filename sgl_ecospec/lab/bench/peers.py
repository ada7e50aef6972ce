"""The peers of ``../shared/docs/PEERS.md`` as benchmark policies (docs/bench.md, "Peers"):
``evict``'s step seconds and the utility gate of ``cascade`` (and ``adaptive``).

- ``evict``: per step, confidence's choice cut to the prefix of its order that maximises
  expected tokens per predicted step time (``lab/engine/evict.py``). The step time depends
  on the number of verified tokens only: :func:`evict_step_seconds` prices a step in which
  every request verifies its root and k candidates, k = 0..budget, with the profile's
  uniform routing (no expert awareness; under EP its expected busiest rank, as a time
  profiled per token count on the EP deployment would show), plus the step's fixed part
  (drafting, accept/reject), so that the ratio is tokens per second of the step.
- ``cascade``: confidence selection behind the utility gate: speculate only where
  confidence's predicted speedup over no speculation is above 1 (:func:`utility_gate`, the
  rule ``adaptive``'s gate uses too); where closed the run is plain decoding (speedup 1).
  In the offline tools the gate is decided per batch size (``sweep``) or per run
  (``bench``, one batch size) from the prediction for confidence's run at that batch size:
  that run is the probe. The prediction does not change within a run, so there is no
  re-probing inside one; the server's gate (``sgl_ecospec.gate``) measures and re-probes.
  Where the gate is open, cascade decodes exactly as confidence does, so the tools reuse
  confidence's run instead of decoding it twice.
"""

from sgl_ecospec.costmodel.expert_parallel import uniform_ep_verify_time
from sgl_ecospec.costmodel.performance import PerformanceModel
from sgl_ecospec.lab.bench import metrics

EVICT, CASCADE = "evict", "cascade"


def evict_step_seconds(
    perf: PerformanceModel, batch: int, budget: int, draft_steps: int, ep_size: int = 1
) -> tuple[float, ...]:
    """Predicted seconds of a step in which each of ``batch`` requests verifies its root and
    k candidates, for k = 0..``budget``: ``draft_steps`` x draft_time(B) + reject_time(B) +
    the verify pass over B (1 + k) tokens with uniform routing under EP ``ep_size``
    (``uniform_ep_verify_time``; ``perf`` on the EP group's hardware) for
    ``SpecConfig.evict_seconds``."""
    fixed = draft_steps * float(perf.draft_time(batch)) + float(perf.reject_time(batch))
    return tuple(
        fixed + float(uniform_ep_verify_time(perf, batch, 1 + k, ep_size))
        for k in range(budget + 1)
    )


def spec_fields(
    policy: str, perf: PerformanceModel, batch: int, budget: int, steps: int, ep_size: int = 1
) -> dict:
    """The ``SpecConfig`` fields that pick a bench policy's selection: cascade decodes with
    confidence selection; evict adds its step seconds at batch size ``batch`` (under EP
    ``ep_size``, ``perf`` on the EP group's hardware)."""
    if policy == CASCADE:
        return {"policy": "confidence"}
    if policy == EVICT:
        seconds = evict_step_seconds(perf, batch, budget, steps, ep_size)
        return {"policy": EVICT, "evict_seconds": seconds}
    return {"policy": policy}


def utility_gate(confidence_rows: dict) -> dict:
    """key -> whether a gated policy may speculate there: where confidence selection, at the
    same batch size, is predicted faster than no speculation (``row["speedup"] > 1``).

    Args:
        confidence_rows: key (e.g. (profile, EP size)) -> a priced row with ``speedup``.
    """
    return {key: row["speedup"] > 1.0 for key, row in confidence_rows.items()}


def run_order(policies) -> list[str]:
    """``policies`` with cascade after the others: it reuses confidence's run."""
    return sorted(policies, key=lambda p: p == CASCADE)


def decoded_runs(runs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The (budget, policy) runs that decode: cascade at a budget where confidence runs
    reuses that run."""
    return [(b, p) for b, p in runs if not (p == CASCADE and (b, "confidence") in runs)]


def confidence_run(sweep: list[dict], budget: int) -> dict | None:
    """Confidence's priced run at ``budget`` among the bench's finished runs, or None."""
    return next((r for r in sweep if r["policy"] == "confidence" and r["budget"] == budget), None)


def cascade_entry(confidence: dict, greedy_steps, perf: PerformanceModel, *, num_experts, top_k):
    """cascade's bench entry from confidence's priced run at the same budget and batch size.

    The gate is open where that run's predicted speedup is above 1: the entry is the run's,
    relabelled. Closed, the run is plain decoding: the greedy run's measured figures and
    speedup 1. Either way ``speculates`` says which, and ``gate`` holds confidence's
    predicted speedup that decided it.

    Args:
        confidence: a priced run of ``bench`` (``predicted`` set) with confidence selection.
        greedy_steps: the greedy run's steps (the plain decoding).
        perf: the profile's performance model.
        num_experts, top_k: the testbed's E and K.
    """
    speedup = confidence["predicted"]["speedup"]
    is_open = utility_gate({"run": {"speedup": speedup}})["run"]
    gate = {"open": is_open, "confidence_speedup": speedup}
    if is_open:
        return {**confidence, "policy": CASCADE, "speculates": True, "gate": gate}
    shape = {"num_experts": num_experts, "top_k": top_k}
    ar = metrics.predicted_ar(greedy_steps, perf, **shape)
    model = perf.model
    return {
        "policy": CASCADE,
        "budget": confidence["budget"],
        "speculates": False,
        "gate": gate,
        **metrics.summarize(greedy_steps),
        "uniform_experts_per_layer_step": metrics.uniform_experts(greedy_steps, **shape),
        "lossless": True,
        "near_ties": 0,
        "mismatch_count": 0,
        "mismatches": [],
        "wall_seconds": confidence["wall_seconds"],  # the probe: confidence's run
        "per_dataset": {},
        "predicted": {
            "experts_per_layer_step": ar["experts_per_layer_step"],
            "experts_per_layer_step_p90": None,
            "expert_bytes_per_step": ar["experts_per_layer_step"]
            * model.moe_layers
            * model.bytes_per_expert,
            "verify_ms": ar["ar_ms"],
            "draft_ms": 0.0,
            "reject_ms": 0.0,
            "ar_ms": ar["ar_ms"],
            "speedup": 1.0,
            "alpha": 0.0,
        },
    }


def gate_note(entry: dict) -> str | None:
    """The line printed under a cascade row: whether its gate let it speculate."""
    gate = entry.get("gate")
    if entry["policy"] != CASCADE or gate is None:
        return None
    verdict = "open: confidence's run" if gate["open"] else "closed: plain decoding"
    return (
        f"  cascade budget {entry['budget']}: gate {verdict} (confidence's predicted speedup "
        f"{gate['confidence_speedup']:.3f})"
    )
