"""The sweep's plan: prompts per batch size, the EP hardware, and the selection constants
each policy runs with at each batch size (``sgl-ecospec sweep``, docs/bench.md)."""

import math

from sgl_ecospec.costmodel.scaling import effective_tokens
from sgl_ecospec.lab.bench import ep_cost, peers
from sgl_ecospec.lab.bench.runs import performance_model
from sgl_ecospec.lab.config import SWEEP_POLICIES as POLICIES
from sgl_ecospec.lab.config import SweepConfig

__all__ = [
    "PAIRED_AGAINST",
    "POLICIES",
    "ep_hardware",
    "prompts_per_batch_size",
    "selection_configs",
    "selection_record",
    "testbed_expert_weight",
]

# With --paired: the policy each run's steps also score (the one it is measured against).
PAIRED_AGAINST = {"ecospec": "confidence", "ecospec-ep": "ecospec", "adaptive": "evict"}


def prompts_per_batch_size(batch: int, num_prompts: int) -> int:
    """Prompts decoded at batch size ``batch``: at least ``num_prompts``, in whole batches."""
    return batch * math.ceil(max(num_prompts, batch) / batch)


def ep_hardware(hardware: str, ep_size: int) -> str:
    """The hardware profile of an EP group: ``hardware`` itself for 1, else ``<R>x...``."""
    return hardware if ep_size == 1 else f"{ep_size}x{hardware}"


def testbed_expert_weight(
    root_union: float, batch: int, *, num_experts: int, top_k: int, profile
) -> float:
    """Profile experts one testbed expert stands for where selection prices its candidates.

    The pricing maps a testbed union u to the profile's through the effective tokens
    (``scale_unique_experts``: u_p = N_p(t_eff(u))), so one more testbed expert at the
    roots' union costs dN_p / dN_t = N_p'(t0) / N_t'(t0), the ratio of the two
    uniform-routing curves' slopes at the roots' effective tokens t0. That is the exchange
    rate of the candidates' marginal experts. A secant (to 2 t0, or over a whole verify
    pass) overprices them, about twice at batch 32 on Qwen3, because the testbed saturates
    sooner than a larger profile and the ratio grows with the tokens. The weight is 1 when
    the profile has the testbed's shape.

    Args:
        root_union: the testbed's distinct experts per layer of a greedy step at ``batch``
            (in [K_t, E_t]).
        batch: B (>= 1), requests in the step.
        num_experts, top_k: E_t, K_t.
        profile: the model profile (``num_experts``, ``top_k``).
    """
    t0 = min(float(effective_tokens(root_union, num_experts, top_k)), float(batch))
    testbed = _union_slope(t0, num_experts, top_k)
    # A testbed saturated at the roots adds no experts (DeltaCost 0), so any weight does.
    return _union_slope(t0, profile.num_experts, profile.top_k) / max(testbed, 1e-300)


def _union_slope(t: float, num_experts: int, top_k: int) -> float:
    """dN/dt of the uniform-routing union N(t) = E (1 - (1 - K/E)^t)."""
    log_miss = math.log1p(-top_k / num_experts)
    return -num_experts * log_miss * math.exp(t * log_miss)


def selection_configs(cfg: SweepConfig, batch: int, root_union: float, testbed: dict) -> dict:
    """``SpecConfig`` keyword arguments per policy at batch size ``batch``.

    Args:
        cfg: the sweep's configuration.
        batch: B.
        root_union: the greedy run's mean distinct experts per layer per step at B.
        testbed: ``{"num_layers", "num_experts", "top_k"}`` of the target.

    Returns:
        policy -> dict of ``SpecConfig`` fields (see the module docstring); those of the
        policies ``cfg`` does not run too.
    """
    from sgl_ecospec.costmodel import selection_cost

    perf = performance_model(cfg.profiles[0], cfg.hardware)
    budget, layers = cfg.budget, testbed["num_layers"]
    weight = testbed_expert_weight(
        root_union,
        batch,
        num_experts=testbed["num_experts"],
        top_k=testbed["top_k"],
        profile=perf.model,
    )
    weights = (perf.model.moe_layers / layers * weight,) * layers
    base = {
        "topk": cfg.topk,
        "num_steps": cfg.steps,
        "budget": budget,
        "share_buffer": cfg.share_buffer,
    }
    # The expert-aware policies' cost trusts only what the predictor knows (--recall-weighted-cost).
    trust = {"recall_weighted_cost": cfg.recall_weighted_cost}
    cost = selection_cost(perf, batch, budget + 1, draft_steps=cfg.steps)
    configs = {
        "confidence": {**base, "policy": "confidence"},
        "ecospec": {
            **base,
            **trust,
            "policy": "ecospec",
            "eps": cost.eps,
            "layer_weights": weights,
        },
        "adaptive": {
            **base,
            **trust,
            "policy": "adaptive",
            "eps": cost.eps,
            "layer_weights": weights,
            "step_tokens": cost.step_tokens,
            "step_cost": cost.step_cost,
        },
        "evict": {
            **base,
            **peers.spec_fields("evict", perf, batch, budget, cfg.steps),
        },
        # Where its gate is open cascade decodes as confidence does (sweep_run reuses that run).
        "cascade": {**base, **peers.spec_fields("cascade", perf, batch, budget, cfg.steps)},
    }
    ranks = max(cfg.ep_sizes)
    if ranks > 1:
        perf_ep = performance_model(cfg.profiles[0], ep_hardware(cfg.hardware, ranks))
        cost_ep = selection_cost(perf_ep, batch, budget + 1, ep_size=ranks)
        placement = ep_cost.contiguous_expert_rank(testbed["num_experts"], ranks)
        configs["ecospec-ep"] = {
            **configs["ecospec"],
            "eps": cost_ep.eps,
            "expert_rank": tuple(placement.tolist()),
            "num_ranks": ranks,
        }
    return configs


def selection_record(kwargs: dict) -> dict:
    """The cost-model constants a run selected with (JSON-ready)."""
    names = ("eps", "step_tokens", "step_cost", "num_ranks", "evict_seconds")
    record = {k: kwargs[k] for k in names if k in kwargs}
    if "layer_weights" in kwargs:
        record["layer_weight"] = kwargs["layer_weights"][0]
    return record
