"""Tests of the MoESD cost model: closed forms against hand values, profiles against public
parameter counts, the step-time model, its fit, and the ``costmodel`` command."""

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_ecospec.costmodel import (
    EPS_FLOOR,
    MoESDParams,
    PerformanceModel,
    TimingPoint,
    acceptance_factor,
    adaptive_draft_steps,
    analytic_params,
    dense_load_time,
    expected_unique_experts,
    expert_load_time,
    fit_params,
    get_hardware,
    get_model,
    ridge_tokens,
    roofline_transition,
    saturation_threshold,
    sd_speedup,
    selection_cost,
    sglang_adaptive_config,
    target_efficiency,
    tokens_per_expert,
)
from sgl_ecospec.lab import cli

QWEN3 = get_model("qwen3-235b-a22b")
H200 = get_hardware("h200")


@pytest.fixture(scope="module")
def qwen3_prior():
    return analytic_params(QWEN3, H200)


# --- formulas ---------------------------------------------------------------------------


def test_unique_experts_hand_value():
    # 128 (1 - (120/128)^4) = 128 (1 - 0.772476) = 29.12
    assert expected_unique_experts(4, 128, 8) == pytest.approx(29.12, abs=0.01)


# METHOD.md section 3, printed to 3 significant figures: tolerance half a printed unit.
@pytest.mark.parametrize(
    ("num_experts", "top_k", "table"),
    [
        (128, 8, [(8, 0.05), (29.1, 0.05), (51.6, 0.05), (82.4, 0.05), (111.8, 0.05)]),
        (128, 4, [(4, 0.05), (15.3, 0.05), (28.7, 0.05), (51.0, 0.05), (81.7, 0.05)]),
        (256, 8, [(8, 0.05), (30.5, 0.05), (57.4, 0.05), (102, 0.5), (163, 0.5)]),
    ],
    ids=["qwen3-235b", "gpt-oss-120b", "deepseek-v3"],
)
def test_unique_experts_matches_method_table(num_experts, top_k, table):
    tokens = np.array([1, 4, 8, 16, 32])
    got = expected_unique_experts(tokens, num_experts, top_k)
    for value, (expected, tol) in zip(got, table, strict=True):
        assert abs(value - expected) <= tol


def test_unique_experts_limits():
    assert expected_unique_experts(0, 128, 8) == 0
    assert expected_unique_experts(1, 128, 8) == pytest.approx(8)
    assert expected_unique_experts(10_000, 128, 8) == pytest.approx(128)
    assert expected_unique_experts(3, 8, 8) == 8  # dense: every token reads every expert


@given(
    st.integers(1, 512),
    st.integers(1, 64).flatmap(lambda k: st.tuples(st.just(k), st.integers(k, 512))),
)
def test_unique_experts_and_tokens_per_expert_agree(t, k_e):
    top_k, num_experts = k_e
    n = expected_unique_experts(t, num_experts, top_k)
    n_next = expected_unique_experts(t + 1, num_experts, top_k)
    assert top_k - 1e-9 <= n <= min(num_experts, t * top_k) + 1e-9
    assert n_next >= n
    # T_exp = t K / N(t): the same union, counted from the other side.
    assert tokens_per_expert(t, top_k / num_experts) == pytest.approx(t * top_k / n)


def test_saturation_threshold():
    assert saturation_threshold(128, 8) == 47
    assert saturation_threshold(256, 8) == 95
    assert saturation_threshold(128, 4, tau=0.95) == 95
    assert saturation_threshold(8, 8) == 1
    # By definition the threshold is the first t with N(t) >= tau E.
    assert expected_unique_experts(47, 128, 8) >= 0.95 * 128 > expected_unique_experts(46, 128, 8)


def test_tokens_per_expert():
    for rho in (1 / 256, 1 / 32, 8 / 128, 0.5, 1.0):
        assert tokens_per_expert(1, rho) == pytest.approx(1.0)
    assert tokens_per_expert(37, 1.0) == pytest.approx(37)  # a dense FFN sees every token
    # sparser models spread the same tokens thinner
    assert tokens_per_expert(64, 8 / 256) < tokens_per_expert(64, 8 / 128)


def test_roofline_transition_continuity_and_slope():
    lam_rp, s = 100.0, 1.03
    at = s**lam_rp
    eps = 1e-6
    left, right = (
        roofline_transition(lam_rp - eps, lam_rp, s),
        roofline_transition(lam_rp + eps, lam_rp, s),
    )
    assert left == pytest.approx(at, rel=1e-6) and right == pytest.approx(at, rel=1e-6)
    slope = at * math.log(s)
    h = 1e-3
    left_slope = (
        roofline_transition(lam_rp, lam_rp, s) - roofline_transition(lam_rp - h, lam_rp, s)
    ) / h
    right_slope = (
        roofline_transition(lam_rp + h, lam_rp, s) - roofline_transition(lam_rp, lam_rp, s)
    ) / h
    assert left_slope == pytest.approx(slope, rel=1e-3)
    assert right_slope == pytest.approx(slope, rel=1e-6)
    # linear beyond the knee, exponential before it
    assert roofline_transition(150.0, lam_rp, s) == pytest.approx(at * (1 + math.log(s) * 50))
    assert roofline_transition(40.0, lam_rp, s) == pytest.approx(s**40)
    assert roofline_transition(np.array([0.0, 500.0]), lam_rp, 1.0).tolist() == [1.0, 1.0]


def test_acceptance_factor():
    assert acceptance_factor(0.0, 4) == pytest.approx(1 / 5)
    assert acceptance_factor(1.0, 4) == 1.0
    assert acceptance_factor(0.5, 2) == pytest.approx((1 + 0.5 + 0.25) / 3)
    # continuous at alpha -> 1 where the textbook form is 0/0
    assert acceptance_factor(1 - 1e-12, 4) == pytest.approx(1.0, abs=1e-10)
    got = acceptance_factor(np.array([0.0, 0.7, 1.0]), 1)
    np.testing.assert_allclose(got, [0.5, 0.85, 1.0])


def test_sd_speedup_hand_example():
    # 0.5 x 4 x 10 / (3 x 1 + 12 + 1) = 20 / 16
    assert sd_speedup(0.5, 3, 10.0, 1.0, 12.0, 1.0) == pytest.approx(1.25)
    assert target_efficiency(10.0, 12.0) == pytest.approx(10 / 12)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: expected_unique_experts(4, 0, 1), "num_experts must be >= 1"),
        (lambda: expected_unique_experts(4, 128, 129), "top_k must be in"),
        (lambda: expected_unique_experts(-1, 128, 8), "t .tokens. must be >= 0"),
        (lambda: expected_unique_experts(4, 128.0, 8), "num_experts must be an int"),
        (lambda: saturation_threshold(128, 8, tau=1.0), "tau must be in"),
        (lambda: tokens_per_expert(4, 0.0), "rho"),
        (lambda: roofline_transition(4, 10, 0.9), "s must be >= 1"),
        (lambda: roofline_transition(4, 2000, 2.0), "overflows"),
        (lambda: acceptance_factor(1.2, 4), "alpha"),
        (lambda: acceptance_factor(0.5, 0), "gamma must be an integer >= 1"),
        (lambda: acceptance_factor(0.5, 2.5), "gamma must be an integer >= 1"),
        (lambda: sd_speedup(0.5, 3, 0.0, 1.0, 1.0, 0.0), "t_target_1"),
        (lambda: sd_speedup(1.5, 3, 1.0, 1.0, 1.0, 0.0), "sigma"),
        (lambda: target_efficiency(1.0, -1.0), "must be > 0"),
    ],
)
def test_formula_input_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- profiles ---------------------------------------------------------------------------


def test_bytes_per_expert():
    assert QWEN3.bytes_per_expert == 3 * 4096 * 1536 * 2
    assert get_model("qwen3-30b-a3b").bytes_per_expert == 3 * 2048 * 768 * 2
    assert get_model("gpt-oss-120b").bytes_per_expert == pytest.approx(13.24e6, abs=0.005e6)
    assert get_model("deepseek-v3").bytes_per_expert == pytest.approx(44.04e6, abs=0.005e6)


# Published total parameter counts: an independent check of dense_params. Total = dense +
# input embedding + every routed expert.
@pytest.mark.parametrize(
    ("name", "total"),
    [
        ("qwen3-235b-a22b", 235e9),
        ("qwen3-30b-a3b", 30.5e9),
        ("gpt-oss-120b", 116.83e9),
        ("deepseek-v3", 671e9),
    ],
)
def test_dense_params_match_published_totals(name, total):
    m = get_model(name)
    routed = m.moe_layers * m.num_experts * m.expert_params
    assert m.dense_params + m.vocab_size * m.hidden + routed == pytest.approx(total, rel=0.01)


def test_derived_times_and_ridge_point():
    assert dense_load_time(QWEN3, H200) == pytest.approx(QWEN3.dense_params * 2 / 4.8e12)
    assert expert_load_time(QWEN3, H200) == pytest.approx(94 * 37_748_736 / 4.8e12)
    assert ridge_tokens(QWEN3, H200) == pytest.approx(989.4e12 / 4.8e12)  # bf16: 2 B / 2 FLOP
    assert ridge_tokens(get_model("deepseek-v3"), get_hardware("h100")) == pytest.approx(
        1978.9e12 / (2 * 3.35e12)
    )


def test_lookup_is_case_insensitive_and_lists_names():
    assert get_model(" Qwen3-235B-A22B ") is QWEN3
    assert get_hardware("H200") is H200
    eight = get_hardware("8xH200")
    assert eight.memory_bandwidth == pytest.approx(8 * 4.8e12)
    assert eight.peak_fp8_flops == pytest.approx(8 * 1978.9e12)
    with pytest.raises(ValueError, match="valid: qwen3-235b-a22b, qwen3-30b-a3b"):
        get_model("llama")
    with pytest.raises(ValueError, match="valid: h100, h200"):
        get_hardware("a100")


# --- performance model ------------------------------------------------------------------

TRUTH = MoESDParams(
    bias=1.5 * dense_load_time(QWEN3, H200),
    k1=2e-4,
    k2=1.3 * expert_load_time(QWEN3, H200),
    k3=3e-4,
    lam=0.5,
    s=1.02,
    draft_bias=4e-4,
    draft_k=5e-5,
    reject_bias=1e-4,
    reject_k=2e-6,
)


def _points_from(perf, batches, gammas, skew=1.0):
    """Points the model itself predicts; ``skew`` scales the verify unions (skewed routing)."""
    m = perf.model
    points = []
    for b in batches:
        points += [
            TimingPoint("ar", b, 1, perf.ar_time(b)),
            TimingPoint("draft", b, 1, perf.draft_time(b)),
            TimingPoint("reject", b, 1, perf.reject_time(b)),
        ]
        for g in gammas:
            n = max(m.top_k, skew * expected_unique_experts(b * g, m.num_experts, m.top_k))
            points.append(TimingPoint("verify", b, g, perf.verify_time(b, g, n), n))
    return points


def test_step_times_follow_the_formulas():
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    knee = 0.5 * ridge_tokens(QWEN3, H200)
    b, g = 16, 4
    n = expected_unique_experts(b * g, 128, 8)
    expected = (
        TRUTH.bias
        + TRUTH.k1 * roofline_transition(b * g, knee, TRUTH.s)
        + TRUTH.k2 * n
        + TRUTH.k3 * roofline_transition(b * g * 8 / n, knee, TRUTH.s)
    )
    assert perf.verify_time(b, g) == pytest.approx(expected)
    assert perf.verify_time(b, 1) == pytest.approx(perf.ar_time(b))
    assert perf.draft_time(b) == pytest.approx(4e-4 + 5e-5 * roofline_transition(b, knee, 1.02))
    assert perf.reject_time(b) == pytest.approx(1e-4 + 2e-6 * b)
    sigma = acceptance_factor(0.8, g)
    assert perf.sd_speedup(b, g, 0.8) == pytest.approx(
        sigma
        * (g + 1)
        * perf.ar_time(b)
        / (g * perf.draft_time(b) + perf.verify_time(b, g) + perf.reject_time(b))
    )
    batches = np.array([1, 8, 64])
    np.testing.assert_allclose(
        perf.verify_time(batches, 4), [perf.verify_time(x, 4) for x in batches]
    )


def test_fewer_unique_experts_make_verify_faster_and_speedup_higher():
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    uniform = expected_unique_experts(4, 128, 8)  # 29.1 at batch 1, gamma 4
    assert perf.verify_time(1, 4, uniform) == pytest.approx(perf.verify_time(1, 4))
    measured = np.array([29.1, 23.7, 20.5, 8.0])  # EAGLE-3 and EcoSpec unions from METHOD.md
    times = perf.verify_time(1, 4, measured)
    assert np.all(np.diff(times) < 0)
    assert perf.sd_speedup(1, 4, 0.7, 20.5) > perf.sd_speedup(1, 4, 0.7, 23.7)
    assert perf.target_efficiency(1, 4, 8.0) > perf.target_efficiency(1, 4)
    # A measured autoregressive union enters the baseline, not the verify pass.
    assert perf.target_efficiency(8, 4, 23.7, ar_unique_experts=40.0) == pytest.approx(
        perf.ar_time(8, 40.0) / perf.verify_time(8, 4, 23.7)
    )
    assert perf.ar_time(8, 40.0) < perf.ar_time(8)  # uniform N(8) = 51.6
    with pytest.raises(ValueError, match="unique_experts must lie in"):
        perf.verify_time(1, 4, 33)  # 4 tokens touch at most 32 experts
    with pytest.raises(ValueError, match="unique_experts must lie in"):
        perf.verify_time(64, 4, 129)


def test_target_efficiency_regimes(qwen3_prior):
    perf = PerformanceModel(QWEN3, H200, qwen3_prior.params)
    # Past saturation (64 >= 47 tokens) and memory-bound: verifying is nearly free.
    assert perf.target_efficiency(64, 2) > 0.95
    # Batch 1: each extra token brings new experts (expert scattering).
    assert perf.target_efficiency(1, 4) < 0.5
    # Compute-bound: efficiency falls toward 1 / gamma.
    assert perf.target_efficiency(512, 8) < perf.target_efficiency(64, 8) - 0.2
    assert perf.target_efficiency(1e6, 4) == pytest.approx(0.25, rel=0.02)


def test_fit_recovers_known_parameters():
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    points = _points_from(perf, (1, 2, 4, 8, 16, 32, 64, 128), (2, 4, 8), skew=0.8)
    fit = fit_params(points, QWEN3, H200)
    assert fit.rms_residual < 1e-6
    assert fit.fixed == ()
    for name, value in TRUTH.as_dict().items():
        assert getattr(fit.params, name) == pytest.approx(value, rel=0.03), name


def test_fit_with_21_points_and_no_draft_or_reject():
    perf = PerformanceModel(QWEN3, H200, TRUTH)
    points = [
        p
        for p in _points_from(perf, (1, 4, 16, 32, 64, 128, 256), (2, 4))
        if p.kind in ("ar", "verify")
    ]
    assert len(points) == 21
    fit = fit_params(points, QWEN3, H200)
    assert fit.fixed == ("draft_bias", "draft_k", "reject_bias", "reject_k")
    assert fit.params.draft_k == 0 and fit.params.reject_bias == 0
    assert fit.max_abs_residual < 1e-3
    for name in ("bias", "k2", "lam", "s"):
        assert getattr(fit.params, name) == pytest.approx(getattr(TRUTH, name), rel=0.03), name


def test_fit_respects_bounds(qwen3_prior):
    t_dense, t_expert = dense_load_time(QWEN3, H200), expert_load_time(QWEN3, H200)
    p = qwen3_prior.params
    assert t_dense * (1 - 1e-9) <= p.bias <= 5 * t_dense * (1 + 1e-9)
    assert t_expert * (1 - 1e-9) <= p.k2 <= 5 * t_expert * (1 + 1e-9)
    assert 0.2 <= p.lam <= 1 and 1 <= p.s <= 2
    assert min(p.k1, p.k3, p.draft_bias, p.draft_k, p.reject_bias, p.reject_k) >= 0
    # The roofline prior is the model's own family: it must fit it closely.
    assert qwen3_prior.max_abs_residual < 0.02
    # Expert loads 20x slower than the bandwidth allows: k2 pins at 5x its floor instead of
    # leaving the physically meaningful range, and the misfit shows in the residuals.
    slow = [
        TimingPoint("ar", b, 1, 20 * (t_dense + expected_unique_experts(b, 128, 8) * t_expert))
        for b in (1, 4, 16, 64)
    ]
    fit = fit_params(slow, QWEN3, H200)
    assert fit.params.k2 == pytest.approx(5 * t_expert)
    assert t_dense * (1 - 1e-9) <= fit.params.bias <= 5 * t_dense * (1 + 1e-9)
    assert fit.max_abs_residual > 0.1


def test_timing_point_and_fit_errors():
    with pytest.raises(ValueError, match="kind must be one of"):
        TimingPoint("prefill", 1, 1, 1.0)
    with pytest.raises(ValueError, match="gamma must be >= 1, and 1 unless"):
        TimingPoint("ar", 1, 4, 1.0)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        TimingPoint("verify", 1, 4, 0.0)
    with pytest.raises(ValueError, match="unique_experts applies to"):
        TimingPoint("draft", 1, 1, 1.0, unique_experts=8)
    with pytest.raises(ValueError, match="at least one 'ar' or 'verify'"):
        fit_params([TimingPoint("draft", 1, 1, 1e-3)], QWEN3, H200)
    with pytest.raises(ValueError, match="lam must be in"):
        MoESDParams(1, 1, 1, 1, 0.0, 1.5, 0, 0, 0, 0)


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


# --- CLI --------------------------------------------------------------------------------


def test_cli_table_json_and_plot(tmp_path, capsys):
    json_path, png_path = tmp_path / "out.json", tmp_path / "out.png"
    argv = ["costmodel", "--batch", "1,8,32", "--gamma", "2,4", "--accept-rate", "0.7"]
    assert cli.main(argv + ["--json", str(json_path), "--plot", str(png_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "gamma"])
    rows = [line.split() for line in lines[header + 1 :] if line.strip()]
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [
        (1, 2, 2),
        (1, 4, 4),
        (8, 2, 16),
        (8, 4, 32),
        (32, 2, 64),
        (32, 4, 128),
    ]
    assert "T_thres    47 tokens" in out and "not measurements" in out

    report = json.loads(json_path.read_text())
    assert report["saturation_threshold"] == 47
    assert len(report["rows"]) == 6
    row = report["rows"][1]  # batch 1, gamma 4
    assert row["unique_experts"] == pytest.approx(29.12, abs=0.01)
    assert row["sigma"] == pytest.approx(acceptance_factor(0.7, 4))
    assert float(rows[1][-1]) == pytest.approx(row["speedup"], abs=1e-3)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch", "1,x"], "--batch must be comma-separated positive ints, got '1,x'"),
        (["--gamma", "0"], "--gamma must be comma-separated positive ints, got '0'"),
        (["--accept-rate", "1.5"], "--accept-rate must be in [0, 1]"),
        (["--tau", "1"], "--tau must be in (0, 1)"),
        (["--model", "llama"], "unknown model 'llama'; valid: qwen3-235b-a22b"),
        (["--hardware", "tpu"], "unknown hardware 'tpu'; valid: h100, h200"),
    ],
)
def test_cli_bad_inputs(extra, message, capsys):
    assert cli.main(["costmodel", *extra]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
