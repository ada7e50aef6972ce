"""Selection constants: eps, layer weights, the adaptive account (costmodel/selection_cost.py)."""

import dataclasses
import json
import math

import numpy as np
import pytest
from test_performance_model import TRUTH

from sgl_ecospec.costmodel import (
    EPS_FLOOR,
    PerformanceModel,
    adaptive_draft_steps,
    expected_unique_experts,
    get_hardware,
    get_model,
    ridge_tokens,
    selection_cost,
    sglang_adaptive_config,
)

QWEN3 = get_model("qwen3-235b-a22b")
H200 = get_hardware("h200")


# --- selection constants (eps, layer weights, the adaptive account) -----------------------


def test_token_time_is_the_compute_step_of_one_more_token():
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    knee, s = 0.5 * ridge_tokens(QWEN3, H200), TRUTH.s
    n = expected_unique_experts(200, 128, 8)
    # 200 tokens are past the knee (103): G's k1 term is linear there with slope
    # s^knee ln s; the per-expert tokens 200 x 8 / 128 are before it (G = s^t).
    expected = TRUTH.k1 * s**knee * math.log(s) + TRUTH.k3 * (
        s ** (201 * 8 / n) - s ** (200 * 8 / n)
    )
    assert perf.token_time(200) == pytest.approx(expected, rel=1e-9)
    # The experts stay loaded: the difference of two verify passes with the same union.
    assert perf.token_time(37, 100.0) == pytest.approx(
        perf.verify_time(1, 38, 100.0) - perf.verify_time(1, 37, 100.0)
    )
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        perf.token_time(0)


def test_selection_cost_derivation():
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    cost = selection_cost(perf, 16, 4, draft_steps=3)
    assert cost.expert_seconds == pytest.approx(TRUTH.k2 / 94)  # one expert in one layer
    assert cost.token_seconds == pytest.approx(perf.token_time(64))
    assert cost.eps == pytest.approx(cost.token_seconds / cost.expert_seconds)
    assert cost.eps > EPS_FLOOR
    assert cost.step_seconds == pytest.approx(
        perf.verify_time(16, 1) + 3 * perf.draft_time(16) + perf.reject_time(16)
    )
    assert cost.step_cost == pytest.approx(cost.step_seconds / (16 * cost.expert_seconds))
    assert cost.step_tokens == 1.0 and cost.layer_weights is None
    # Without drafting the step is the verify pass over the roots alone.
    assert selection_cost(perf, 16, 4).step_seconds == pytest.approx(perf.verify_time(16, 1))
    # EP 8: the busiest rank streams an expert at 1/8 of the group's bandwidth.
    ep = selection_cost(perf, 16, 4, draft_steps=3, ep_size=8)
    assert ep.expert_seconds == pytest.approx(8 * cost.expert_seconds)
    assert ep.eps == pytest.approx(cost.eps / 8)
    # Bitmaps over half of the 94 MoE layers: each stands for two.
    half = selection_cost(perf, 16, 4, layers=47)
    np.testing.assert_array_equal(half.layer_weights, np.full(47, 2.0))
    assert selection_cost(perf, 16, 4, layers=94).layer_weights is None
    # A measured (smaller) union gives each token fewer tokens per expert to compute.
    assert selection_cost(perf, 16, 4, unique_experts=40.0).token_seconds == pytest.approx(
        perf.token_time(64, 40.0)
    )


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_candidate_cost_is_the_step_time_of_each_more_candidate(batch):
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    cost = selection_cost(perf, batch, 6, draft_steps=3)
    # A request's k-th candidate adds eps + candidate_cost x decay^k expert loads: the step
    # time of B more tokens, shared by the B requests, exactly for the first two.
    for k in range(2):
        seconds = perf.verify_time(batch, 2 + k) - perf.verify_time(batch, 1 + k)
        expected = seconds / (batch * cost.expert_seconds)
        priced = cost.eps + cost.candidate_cost * cost.candidate_decay**k
        assert priced == pytest.approx(expected, rel=1e-9)
    # Memory-bound, the experts B more tokens add fall as uniform routing fills the union.
    if batch < 64:
        assert cost.candidate_decay == pytest.approx((1 - 8 / 128) ** batch, rel=0.05)
    assert 0 < cost.candidate_decay <= 1 and cost.candidate_cost > 0
    # One candidate per request leaves no second one to take the decay from.
    assert selection_cost(perf, batch, 2).candidate_decay == 1.0


def test_selection_cost_ranks_like_seconds():
    # The derivation: P / (DeltaCost + eps) orders nodes as their gain per second,
    # P / (token_seconds + DeltaCost x expert_seconds).
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    cost = selection_cost(perf, 64, 8)
    rng = np.random.default_rng(0)
    prob, delta = rng.random(200), rng.integers(0, 300, 200).astype(float)
    by_eps = prob / (delta + cost.eps)
    by_seconds = prob / (cost.token_seconds + delta * cost.expert_seconds)
    np.testing.assert_allclose(by_eps / by_seconds, cost.expert_seconds, rtol=1e-12)


def test_selection_cost_eps_floor():
    # s = 1: G is flat, so one more token costs no compute at all in the model.
    flat = PerformanceModel(QWEN3, H200, dataclasses.replace(TRUTH, s=1.0))
    cost = selection_cost(flat, 4, 4)
    assert cost.token_seconds == 0.0 and cost.eps == EPS_FLOOR


def test_selection_cost_drives_the_adaptive_policy():

    from sgl_ecospec import select_verify_set
    from sgl_ecospec.synthetic import random_draft_tree

    perf = PerformanceModel(QWEN3, H200, TRUTH)
    tree = random_draft_tree(2, 30, 94, 128, 8, seed=4)
    taken = []
    for batch in (1, 64):
        cost = selection_cost(perf, batch, 8, draft_steps=3)
        out = select_verify_set(
            tree.scores,
            tree.parents,
            tree.node_experts,
            7,
            root_experts=tree.root_experts,
            policy="adaptive",
            eps=cost.eps,
            step_tokens=cost.step_tokens,
            step_cost=cost.step_cost,
        )
        taken.append(int((out >= 0).sum()))
    # At batch 1 each request carries a whole step's fixed cost, so even a costly node
    # pays; at batch 64 that cost is shared and only cheap, likely nodes do.
    assert taken[0] > taken[1]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda perf: selection_cost(perf, 0, 4), "batch must be >= 1"),
        (lambda perf: selection_cost(perf, 4, 0), "verify_tokens must be >= 1"),
        (lambda perf: selection_cost(perf, 4, 4, draft_steps=-1), "draft_steps must be >= 0"),
        (lambda perf: selection_cost(perf, 4, 4, layers=95), "exceeds the model's 94"),
        (lambda perf: selection_cost(perf, 4, 4, ep_size=0), "ep_size must be >= 1"),
        (lambda perf: adaptive_draft_steps(perf, [4], 0.5, 0), "max_steps must be >= 1"),
        (lambda perf: adaptive_draft_steps(perf, [0], 0.5, 4), "batch must be >= 1"),
        (lambda perf: sglang_adaptive_config({}), "at least one batch-size bucket"),
        (lambda perf: sglang_adaptive_config({8: -1}), r"steps\[8\] must be >= 0"),
    ],
)
def test_selection_cost_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(PerformanceModel(QWEN3, H200, TRUTH))
    no_k2 = PerformanceModel(QWEN3, H200, dataclasses.replace(TRUTH, k2=0.0))
    with pytest.raises(ValueError, match="k2"):
        selection_cost(no_k2, 4, 4)


def test_adaptive_draft_steps_maximise_predicted_throughput():
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    batches = [1, 4, 16, 64, 256]
    for alpha in (0.0, 0.5, 0.9):
        steps = adaptive_draft_steps(perf, batches, alpha, 6)
        for b in batches:
            # Tokens per second of k drafts, written out: sum of alpha^j, j = 0..k.
            rates = [1 / perf.ar_time(b)] + [
                sum(alpha**j for j in range(k + 1))
                / (k * perf.draft_time(b) + perf.verify_time(b, k + 1) + perf.reject_time(b))
                for k in range(1, 7)
            ]
            assert rates[steps[b]] == pytest.approx(max(rates), rel=1e-12)
    # Drafts that are never accepted never pay; at alpha 0.5 speculation pays only once
    # the batch's experts are loaded anyway (MoESD), so small batches verify none.
    assert set(adaptive_draft_steps(perf, batches, 0.0, 6).values()) == {0}
    half = adaptive_draft_steps(perf, batches, 0.5, 6)
    assert half[1] == half[4] == 0 and half[16] > 0 and half[64] > 0


def test_sglang_adaptive_config_loads_in_sglang(tmp_path):
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    config = sglang_adaptive_config({16: 5, 1: 0, 64: 2})
    assert config == {
        "1": {"candidate_steps": [0]},
        "16": {"candidate_steps": [0, 1, 2, 3, 4, 5]},
        "64": {"candidate_steps": [0, 1, 2]},
    }
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(config))
    params = AdaptiveSpeculativeParams(initial_steps=2, cfg_path=str(path))
    assert params.candidate_steps == [0, 1, 2, 3, 4, 5]
    # SGLang routes each batch to the bucket with the largest key <= its size: batches
    # below 16 never draft; the others start at the server's 2 steps.
    assert [params.get_steps_for_batch(b) for b in (1, 8, 15, 16, 40, 64, 500)] == [
        0,
        0,
        0,
        2,
        2,
        2,
        2,
    ]
