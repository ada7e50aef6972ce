"""Closed forms of the MoESD cost model (sgl_ecospec/costmodel/formulas.py) against hand values."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_ecospec.costmodel import (
    acceptance_factor,
    expected_unique_experts,
    get_hardware,
    get_model,
    roofline_transition,
    saturation_threshold,
    sd_speedup,
    target_efficiency,
    tokens_per_expert,
)

QWEN3 = get_model("qwen3-235b-a22b")
H200 = get_hardware("h200")


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
