"""Carrying unique-expert counts measured on a small testbed over to a real model's shape.

The testbed (E_t experts per layer, top-K_t) is far smaller than the models the cost model
prices (Qwen3-235B: E = 128, K = 8), so a union of experts measured on it cannot be used
as is. The effective-token method maps it:

1. Effective tokens: t_eff solves N_t(t_eff) = measured, where N_t(t) =
   E_t (1 - (1 - K_t / E_t)^t) is the uniform-routing expectation
   (``formulas.expected_unique_experts``); in closed form
   t_eff = ln(1 - measured / E_t) / ln(1 - K_t / E_t).
2. Prediction: N_p(t_eff) with the profile's E_p and K_p.

A verify pass over T tokens whose routing is skewed or overlapping touches fewer experts
than uniform routing would, so t_eff < T: the pass "looks like" t_eff independent tokens.
The method assumes the real model's routing is as redundant as the testbed's in that sense
and keeps t_eff. Properties: identity when (E_p, K_p) = (E_t, K_t); monotone; the uniform
expectation N_t(T) maps to N_p(T); K_t maps to K_p (one token touches exactly K experts);
E_t maps to E_p (a saturated testbed only bounds t_eff from below, so the prediction is an
upper bound).
"""

import math

import numpy as np

from sgl_ecospec.costmodel import formulas


def effective_tokens(unique_experts, num_experts: int, top_k: int):
    """Tokens t_eff whose uniform-routing expectation equals the measured union.

    t_eff = ln(1 - u / E) / ln(1 - K / E), the inverse of ``expected_unique_experts``.

    Args:
        unique_experts: u, distinct experts one layer read in one pass, in [K, E]; float or
            array.
        num_experts: E of the model the union was measured on (int >= 2).
        top_k: K of that model (int, 1 <= K < E).

    Returns:
        t_eff >= 1 (inf where u = E); same shape as ``unique_experts``.

    Raises:
        ValueError: u outside [K, E] (a per-layer union of a pass with at least one token
            lies there; anything else is not such a union, e.g. a count per token or an
            average that includes layers no token reached), or K = E (every token reads
            every expert, so the union says nothing about routing).
    """
    e, k = formulas._check_experts(num_experts, top_k)
    if k == e:
        raise ValueError(
            f"top_k = num_experts = {e}: every token reads every expert, so a measured union "
            "carries no routing information to scale"
        )
    u = formulas._array("unique_experts", unique_experts)
    tol = 1e-9 * e
    if ((u < k - tol) | (u > e + tol)).any():
        bad = u[(u < k - tol) | (u > e + tol)].ravel()
        raise ValueError(
            f"unique_experts must lie in [top_k={k}, num_experts={e}] (one layer's union of "
            f"experts over a pass of >= 1 token), got {bad[:5].tolist()}"
        )
    u = np.clip(u, k, e)
    with np.errstate(divide="ignore"):
        t = np.log1p(-u / e) / math.log1p(-k / e)
    # u = K is exactly one token; keep float error from putting t_eff below it.
    return formulas._result(np.maximum(t, 1.0))


def scale_unique_experts(unique_experts, *, num_experts: int, top_k: int, profile, tokens=None):
    """Predicts the profile's union from one measured on a testbed (effective-token method).

    u_p = N_p(t_eff), t_eff = ``effective_tokens(u, E_t, K_t)``, N_p the uniform-routing
    expectation with the profile's E_p and K_p (see the module docstring).

    Args:
        unique_experts: u, measured distinct experts per layer per pass on the testbed, in
            [K_t, E_t]; float or array.
        num_experts: E_t, the testbed's experts per layer.
        top_k: K_t, the testbed's experts per token.
        profile: anything with ``num_experts`` and ``top_k`` (a ``ModelProfile``).
        tokens: tokens in each measured pass (broadcast with ``u``), or None. When given,
            the result is capped at tokens x K_p: routing that spread wider than uniform
            (u > N_t(tokens), possible by chance in small passes) gives t_eff > tokens,
            and no pass of that many tokens can read more than tokens x K_p experts.

    Returns:
        Predicted distinct experts per layer for the profile, in [K_p, E_p]; same shape as
        the broadcast inputs.
    """
    t_eff = effective_tokens(unique_experts, num_experts, top_k)
    e_p, k_p = formulas._check_experts(profile.num_experts, profile.top_k)
    u_p = np.asarray(formulas.expected_unique_experts(t_eff, e_p, k_p), dtype=np.float64)
    if tokens is not None:
        tokens = formulas._array("tokens", tokens)
        if (tokens < 1).any():
            raise ValueError(f"tokens must be >= 1, got {tokens!r}")
        u_p = np.minimum(u_p, tokens * k_p)
    return formulas._result(np.clip(u_p, k_p, e_p))
