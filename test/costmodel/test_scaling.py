"""Tests of the effective-token scaling of measured unique experts to a model profile."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sgl_ecospec.costmodel import expected_unique_experts, get_model
from sgl_ecospec.costmodel.scaling import effective_tokens, scale_unique_experts

QWEN3 = get_model("qwen3-235b-a22b")  # E = 128, K = 8
DEEPSEEK = get_model("deepseek-v3")  # E = 256, K = 8
TESTBED = {"num_experts": 16, "top_k": 2}


def test_hand_value():
    # 16 (1 - (14/16)^2) = 3.75 experts is uniform routing of 2 tokens: t_eff = 2, and
    # Qwen3 reads 128 (1 - (120/128)^2) = 15.5 experts for 2 tokens.
    assert effective_tokens(3.75, 16, 2) == pytest.approx(2.0)
    assert scale_unique_experts(3.75, **TESTBED, profile=QWEN3) == pytest.approx(15.5)


@pytest.mark.parametrize(("num_experts", "top_k"), [(16, 2), (64, 4), (128, 8), (7, 3)])
def test_identity_when_profile_has_the_testbed_shape(num_experts, top_k):
    profile = dataclasses.replace(QWEN3, num_experts=num_experts, top_k=top_k)
    measured = np.linspace(top_k, num_experts, 41)
    scaled = scale_unique_experts(measured, num_experts=num_experts, top_k=top_k, profile=profile)
    np.testing.assert_allclose(scaled, measured, rtol=1e-9)


@pytest.mark.parametrize("profile", [QWEN3, DEEPSEEK], ids=lambda p: p.name)
def test_uniform_expectation_maps_to_uniform_expectation(profile):
    tokens = np.arange(1, 65, dtype=np.float64)
    measured = expected_unique_experts(tokens, 16, 2)
    scaled = scale_unique_experts(measured, **TESTBED, profile=profile)
    expected = expected_unique_experts(tokens, profile.num_experts, profile.top_k)
    np.testing.assert_allclose(scaled, expected, rtol=1e-6)


def test_monotone_and_bounded():
    measured = np.linspace(2, 16, 500)
    scaled = scale_unique_experts(measured, **TESTBED, profile=QWEN3)
    assert np.all(np.diff(scaled) > 0)
    assert scaled[0] == QWEN3.top_k  # one token reads exactly K experts on both models
    assert scaled[-1] == QWEN3.num_experts  # a saturated testbed predicts saturation
    assert effective_tokens(2, 16, 2) == 1.0
    assert effective_tokens(16, 16, 2) == math.inf


@given(
    st.integers(2, 256).flatmap(
        lambda e: st.tuples(st.just(e), st.integers(1, e - 1), st.floats(0, 1))
    ),
    st.integers(1, 200),
)
def test_property_bounds_and_skew_carry_over(case, tokens):
    num_experts, top_k, fraction = case
    measured = top_k + fraction * (num_experts - top_k)
    scaled = scale_unique_experts(measured, num_experts=num_experts, top_k=top_k, profile=DEEPSEEK)
    assert DEEPSEEK.top_k <= scaled <= DEEPSEEK.num_experts
    # Fewer experts than uniform routing of T tokens on the testbed means fewer than uniform
    # routing of T tokens on the profile, and more means more. (A saturated testbed, u = E,
    # only bounds t_eff: it maps to E_p, see test_monotone_and_bounded.)
    assume(measured < num_experts)
    uniform_testbed = expected_unique_experts(tokens, num_experts, top_k)
    uniform_profile = expected_unique_experts(tokens, DEEPSEEK.num_experts, DEEPSEEK.top_k)
    if measured <= uniform_testbed:
        assert scaled <= uniform_profile * (1 + 1e-9)
    else:
        assert scaled >= uniform_profile * (1 - 1e-9)


def test_tokens_caps_spread_wider_than_uniform():
    # 2 tokens on 4 distinct experts (all different): more than uniform's 3.75, t_eff > 2,
    # and N_p(t_eff) = 16.6 would exceed what 2 Qwen3 tokens can read (2 x 8 = 16).
    uncapped = scale_unique_experts(4.0, **TESTBED, profile=QWEN3)
    assert uncapped > 16
    assert scale_unique_experts(4.0, **TESTBED, profile=QWEN3, tokens=2) == 16
    capped = scale_unique_experts(
        np.array([[4.0, 3.0]]), **TESTBED, profile=QWEN3, tokens=np.array([[2.0], [2.0]])
    )
    assert capped.shape == (2, 2) and capped.max() == 16


@pytest.mark.parametrize("bad", [1.9, 16.5, -1.0])
def test_values_outside_k_to_e_raise(bad):
    with pytest.raises(ValueError, match=r"unique_experts must lie in \[top_k=2, num_experts=16\]"):
        scale_unique_experts(bad, **TESTBED, profile=QWEN3)


def test_other_errors():
    with pytest.raises(ValueError, match="NaN"):
        effective_tokens(float("nan"), 16, 2)
    with pytest.raises(ValueError, match="carries no routing information"):
        effective_tokens(4, 4, 4)
    with pytest.raises(ValueError, match="top_k must be in"):
        effective_tokens(4, 4, 5)
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        scale_unique_experts(4.0, **TESTBED, profile=QWEN3, tokens=0)
