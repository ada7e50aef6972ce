"""The sweep's plan: prompts per batch size, the EP hardware, and the selection constants
each policy runs with at each batch size (``sgl-ecospec sweep``, docs/bench.md)."""

import math

from sgl_ecospec.costmodel.scaling import effective_tokens
from sgl_ecospec.lab.bench import ep_cost, peers
from sgl_ecospec.lab.bench.expert_exchange import ExpertExchange
from sgl_ecospec.lab.bench.runs import performance_model
from sgl_ecospec.lab.config import SWEEP_POLICIES as POLICIES
from sgl_ecospec.lab.config import SweepConfig
from sgl_ecospec.ops.selection import ADAPTIVE_EP_TOTAL_WEIGHT

__all__ = [
    "EP_SELECTED",
    "PAIRED_AGAINST",
    "POLICIES",
    "adaptive_fields",
    "ep_hardware",
    "expert_exchange",
    "prompts_per_batch_size",
    "runs_per_batch",
    "selection_configs",
    "selection_groups",
    "selection_record",
    "testbed_expert_weight",
]

# With --paired: the policy each run's steps also score (the one it is measured against).
PAIRED_AGAINST = {"ecospec": "confidence", "ecospec-ep": "ecospec", "adaptive": "evict"}
# Policies whose verify-set size follows the deployment's step cost, so that a server at EP R
# selects with EP R's cost model (the plugin's eps table, EVICT's profiled step time): the
# sweep runs them once per EP size and prices each EP size with its own run.
EP_SELECTED = ("evict", "adaptive")


def selection_groups(policy: str, keys) -> list[tuple[int | None, list]]:
    """The runs of ``policy`` at one batch size: (EP size it selects for, the (profile, EP
    size) keys priced with that run). Policies in :data:`EP_SELECTED` run once per EP size
    among ``keys``; the others once for every key (EP size None: selection at EP 1)."""
    keys = list(keys)
    if policy not in EP_SELECTED:
        return [(None, keys)]
    return [(r, [k for k in keys if k[1] == r]) for r in sorted({r for _, r in keys})]


def runs_per_batch(policies, ep_sizes) -> int:
    """Decoding runs per batch of prompts at one batch size: the greedy one, one per policy,
    one per EP size for the :data:`EP_SELECTED` ones (:func:`selection_groups`)."""
    keys = [(None, r) for r in set(ep_sizes)]
    return 1 + sum(len(selection_groups(p, keys)) for p in policies)


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


def selection_configs(
    cfg: SweepConfig, batch: int, root_union: float, testbed: dict, *, ep_size: int = 1
) -> dict:
    """``SpecConfig`` keyword arguments per policy at batch size ``batch``.

    Args:
        cfg: the sweep's configuration.
        batch: B.
        root_union: the greedy run's mean distinct experts per layer per step at B.
        testbed: ``{"num_layers", "num_experts", "top_k"}`` of the target.
        ep_size: the EP size the :data:`EP_SELECTED` policies select for. adaptive selects
            as the plugin does under EP (setting ``ep_cost``): eps and step cost from
            ``selection_cost(ep_size=)`` on that EP group's hardware, which price an expert
            at the busiest rank's pace, with the placement (contiguous ranks) and
            ``ADAPTIVE_EP_TOTAL_WEIGHT``, so that a candidate's DeltaCost counts the rise of
            the busiest rank only (the prior: the run measures the weight,
            :func:`expert_exchange`); evict's step seconds are that hardware's. The other policies
            do not depend on it (``ecospec`` selects at EP 1, ``ecospec-ep`` at the largest
            EP size).

    Returns:
        policy -> dict of ``SpecConfig`` fields (see the module docstring); those of the
        policies ``cfg`` does not run too.
    """
    from sgl_ecospec.costmodel import selection_cost

    profile = cfg.profiles[0]
    perf = performance_model(profile, cfg.hardware)
    perf_selected = performance_model(profile, ep_hardware(cfg.hardware, ep_size))
    budget, layers = cfg.budget, testbed["num_layers"]
    weight = _selection_weight(profile, cfg.hardware, batch, root_union, testbed)
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
            **adaptive_fields(
                profile,
                cfg.hardware,
                batch,
                budget,
                cfg.steps,
                root_union,
                testbed,
                ep_size=ep_size,
            ),
        },
        "evict": {
            **base,
            **peers.spec_fields("evict", perf_selected, batch, budget, cfg.steps, ep_size),
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


def adaptive_fields(
    profile: str,
    hardware: str,
    batch: int,
    budget: int,
    steps: int,
    root_union: float,
    testbed: dict,
    *,
    ep_size: int = 1,
) -> dict:
    """``adaptive``'s selection fields of ``SpecConfig`` at batch size ``batch`` (the sweep's
    and ``bench``'s): eps and the step account of ``selection_cost(ep_size=)`` on the EP
    group's hardware, the layer weights of :func:`testbed_expert_weight` (each testbed layer
    standing for moe_layers / L of the profile's), and under EP the placement with
    ``ADAPTIVE_EP_TOTAL_WEIGHT``.

    Args:
        profile, hardware: the priced model profile and the hardware of one GPU.
        batch, budget, steps: B, the candidates verified at most and the draft steps.
        root_union: the greedy run's mean distinct experts per layer per step at B.
        testbed: ``{"num_layers", "num_experts", "top_k"}`` of the target.
        ep_size: the EP size selection prices for.
    """
    from sgl_ecospec.costmodel import selection_cost

    perf = performance_model(profile, ep_hardware(hardware, ep_size))
    cost = selection_cost(perf, batch, budget + 1, draft_steps=steps, ep_size=ep_size)
    layers = testbed["num_layers"]
    weight = _selection_weight(profile, hardware, batch, root_union, testbed)
    fields = {
        "policy": "adaptive",
        "eps": cost.eps,
        "layer_weights": (perf.model.moe_layers / layers * weight,) * layers,
        "step_tokens": cost.step_tokens,
        "step_cost": cost.step_cost,
        "candidate_cost": cost.candidate_cost,
        "candidate_decay": cost.candidate_decay,
    }
    if ep_size > 1:
        placement = ep_cost.contiguous_expert_rank(testbed["num_experts"], ep_size)
        fields |= {
            "expert_rank": tuple(placement.tolist()),
            "num_ranks": ep_size,
            "total_weight": ADAPTIVE_EP_TOTAL_WEIGHT,
        }
    return fields


def _selection_weight(
    profile: str, hardware: str, batch: int, root_union: float, testbed: dict
) -> float:
    """``testbed_expert_weight`` for the profile selection prices with."""
    return testbed_expert_weight(
        root_union,
        batch,
        num_experts=testbed["num_experts"],
        top_k=testbed["top_k"],
        profile=performance_model(profile, hardware).model,
    )


def expert_exchange(
    profile: str,
    hardware: str,
    batch: int,
    root_union: float,
    testbed: dict,
    *,
    ep_size: int = 1,
    total_weight: float | None = None,
) -> ExpertExchange:
    """adaptive's prices of a testbed expert at batch size ``batch`` when it selects for EP
    ``ep_size`` (with ``total_weight``, as its ``SpecConfig``): measured on the run's own
    verify steps, in the loads of ``profile`` on ``hardware``, from the prior weight of
    :func:`adaptive_fields`; the prior counts for one step that adds a whole testbed layer's
    experts in every layer."""
    return ExpertExchange(
        num_experts=testbed["num_experts"],
        top_k=testbed["top_k"],
        profile=performance_model(profile, hardware).model,
        prior=_selection_weight(profile, hardware, batch, root_union, testbed),
        prior_experts=testbed["num_layers"] * testbed["num_experts"],
        ep_size=ep_size,
        total_weight=total_weight,
    )


def selection_record(kwargs: dict) -> dict:
    """The cost-model constants a run selected with (JSON-ready)."""
    names = (
        "eps",
        "step_tokens",
        "step_cost",
        "candidate_cost",
        "candidate_decay",
        "num_ranks",
        "total_weight",
        "evict_seconds",
    )
    record = {k: kwargs[k] for k in names if k in kwargs}
    if "layer_weights" in kwargs:
        record["layer_weight"] = kwargs["layer_weights"][0]
    return record
