"""The step-time model and its fit (sgl_ecospec/costmodel/performance.py)."""

import numpy as np
import pytest

from sgl_ecospec.costmodel import (
    MoESDParams,
    PerformanceModel,
    TimingPoint,
    acceptance_factor,
    analytic_params,
    dense_load_time,
    expected_unique_experts,
    expert_load_time,
    fit_params,
    get_hardware,
    get_model,
    ridge_tokens,
    roofline_transition,
)

QWEN3 = get_model("qwen3-235b-a22b")
H200 = get_hardware("h200")


@pytest.fixture(scope="module")
def qwen3_prior():
    return analytic_params(QWEN3, H200)


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
