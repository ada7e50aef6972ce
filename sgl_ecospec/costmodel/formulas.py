"""Closed-form pieces of the MoESD analysis (arXiv 2505.19645), as pure functions.

Every function takes Python floats or numpy arrays (broadcast together) and returns a float
for scalar inputs, else an array. Notation: E = routed experts per MoE layer, K = experts
per token (top-K), rho = K / E, t = tokens in one forward pass, alpha = per-token acceptance
rate, gamma = draft tokens verified per request.

Routing is assumed uniform and i.i.d. across tokens: real routers are skewed, so measured
unions of experts are smaller than ``expected_unique_experts`` (that gap is what EcoSpec
widens on purpose).
"""

import math

import numpy as np

# log(s) * knee above this overflows float64 in s**knee.
_MAX_LOG_FLOAT = math.log(np.finfo(np.float64).max)


def _array(name: str, value) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if np.isnan(arr).any():
        raise ValueError(f"{name} must not be NaN, got {value!r}")
    return arr


def _result(value: np.ndarray):
    return float(value) if np.ndim(value) == 0 else value


def _check_experts(num_experts, top_k) -> tuple[int, int]:
    for name, value in (("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    return int(num_experts), int(top_k)


def _check_rho(rho) -> np.ndarray:
    arr = _array("rho", rho)
    if ((arr <= 0) | (arr > 1)).any():
        raise ValueError(f"rho (= top_k / num_experts) must be in (0, 1], got {rho!r}")
    return arr


def check_gamma(gamma) -> np.ndarray:
    """``gamma`` as a float array; ValueError unless every value is an integer >= 1."""
    arr = _array("gamma", gamma)
    if (arr < 1).any() or (arr != np.round(arr)).any():
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    return arr


def expected_unique_experts(t, num_experts: int, top_k: int):
    """Expected number of distinct experts one MoE layer reads for ``t`` tokens.

    N(t) = E (1 - ((E - K) / E)^t), uniform i.i.d. routing.

    Args:
        t: tokens in the forward pass (batch x tokens per request), >= 0; float or array.
        num_experts: E, routed experts per layer (int >= 1).
        top_k: K, experts per token (int, 1 <= K <= E).

    Returns:
        Experts per layer, in [0, E]; same shape as ``t``.
    """
    e, k = _check_experts(num_experts, top_k)
    t = _array("t", t)
    if (t < 0).any():
        raise ValueError(f"t (tokens) must be >= 0, got {t!r}")
    if k == e:
        return _result(np.where(t > 0, float(e), 0.0))
    # -expm1(t log1p(-rho)) = 1 - (1 - rho)^t without cancellation for small t rho.
    return _result(e * -np.expm1(t * math.log1p(-k / e)))


def expected_busiest_rank_experts(t, num_experts: int, top_k: int, ep_size: int):
    """Expected distinct experts of one MoE layer on its busiest expert-parallel rank.

    The ``ep_size`` = R ranks hold E / R experts each (the first E mod R ranks one more when
    R does not divide E). Each expert is read with probability q = N(t) / E; taking experts
    as independent, a rank of m experts reads Binomial(m, q) of them and the busiest of the
    R ranks has E[max] = sum_{j >= 1} (1 - prod_r F_r(j - 1)), F_r the CDF of rank r's
    count. R = 1 gives N(t) exactly; the result lies in [N(t) / R, min(N(t), ceil(E / R))].
    Real uniform routing draws each token's K experts without replacement, so experts are
    not quite independent; against sampled routing the formula is within 2% (tested; e.g.
    2.51 against 2.53 for one token of E = 128, K = 8 on 8 ranks).

    Args:
        t: tokens in the forward pass, >= 0; float or array.
        num_experts: E (int >= 1).
        top_k: K (int, 1 <= K <= E).
        ep_size: R (int, 1 <= R <= E).

    Returns:
        Experts per layer on the busiest rank; same shape as ``t``.
    """
    e, k = _check_experts(num_experts, top_k)
    if (
        isinstance(ep_size, bool)
        or not isinstance(ep_size, int | np.integer)
        or not 1 <= ep_size <= e
    ):
        raise ValueError(f"ep_size must be an int in [1, num_experts={e}], got {ep_size!r}")
    unique = np.asarray(expected_unique_experts(t, e, k), dtype=np.float64)
    if ep_size == 1:
        return _result(unique)
    q = (unique / e)[..., None]
    larger = e % ep_size  # ranks holding one expert more than the others
    size = e // ep_size + (larger > 0)
    j = np.arange(size + 1, dtype=np.float64)
    all_below = np.ones(unique.shape + (size,))  # P(every rank holds < j experts), j = 1..
    for per_rank, ranks in ((e // ep_size, ep_size - larger), (e // ep_size + 1, larger)):
        if not ranks:
            continue
        comb = np.array([math.comb(per_rank, int(i)) for i in j], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            pmf = np.where(j <= per_rank, comb * q**j * (1.0 - q) ** (per_rank - j), 0.0)
        cdf = np.clip(np.cumsum(pmf, axis=-1), 0.0, 1.0)  # F(0) .. F(size)
        all_below = all_below * cdf[..., :-1] ** ranks
    return _result((1.0 - all_below).sum(-1))


def saturation_threshold(num_experts: int, top_k: int, tau: float = 0.95) -> int:
    """Tokens after which one layer is expected to read a fraction ``tau`` of its experts.

    T_thres = ceil(log_(1 - rho)(1 - tau)), rho = K / E: the smallest t with
    N(t) >= tau E. Beyond it, verifying more tokens adds almost no expert loads.

    Args:
        num_experts: E (int >= 1).
        top_k: K (int, 1 <= K <= E).
        tau: target fraction of experts, in (0, 1).

    Returns:
        Tokens (int >= 1): 47 for E = 128, K = 8 and 95 for E = 256, K = 8 at tau = 0.95.
    """
    e, k = _check_experts(num_experts, top_k)
    if not 0 < tau < 1:
        raise ValueError(f"tau must be in (0, 1), got {tau!r}")
    if k == e:
        return 1
    exact = math.log1p(-tau) / math.log1p(-k / e)
    # An exact integer must not round up one token because of float error.
    nearest = round(exact)
    return max(1, nearest if abs(exact - nearest) < 1e-9 else math.ceil(exact))


def tokens_per_expert(t, rho):
    """Mean tokens each active expert processes when ``t`` tokens are routed.

    T_exp(t; rho) = rho t / (1 - (1 - rho)^t) = t K / N(t): the arithmetic intensity of
    the expert GEMMs, in tokens per weight read.

    Args:
        t: tokens in the forward pass, > 0; float or array.
        rho: sparsity K / E, in (0, 1] (1 is a dense FFN).

    Returns:
        Tokens per active expert, >= 1 for t >= 1; same shape as the broadcast inputs.
    """
    t = _array("t", t)
    rho = _check_rho(rho)
    if (t <= 0).any():
        raise ValueError(f"t (tokens) must be > 0, got {t!r}")
    # -expm1(t log1p(-rho)) keeps precision for small rho * t; rho = 1 gives log1p(-1) = -inf.
    with np.errstate(divide="ignore"):
        union_fraction = -np.expm1(t * np.log1p(-rho))
    return _result(rho * t / union_fraction)


def roofline_transition(t, lam_rp, s):
    """MoESD's smooth roofline G(t; lambda RP, s), dimensionless.

    G = s^t for t <= lambda RP, else s^(lambda RP) (1 + ln(s) (t - lambda RP)): exponential
    growth up to the knee, then the tangent line, so G and dG/dt are continuous.

    Args:
        t: tokens (batch tokens, or tokens per expert), >= 0; float or array.
        lam_rp: the knee lambda * RP in tokens, >= 0 (RP = hardware ridge point in tokens).
        s: growth base, >= 1 (s = 1 gives G = 1 everywhere).

    Returns:
        G(t), >= 1; same shape as the broadcast inputs.
    """
    t = _array("t", t)
    lam_rp = _array("lam_rp", lam_rp)
    s = _array("s", s)
    if (t < 0).any():
        raise ValueError(f"t (tokens) must be >= 0, got {t!r}")
    if (lam_rp < 0).any():
        raise ValueError(f"lam_rp (tokens) must be >= 0, got {lam_rp!r}")
    if (s < 1).any():
        raise ValueError(f"s must be >= 1, got {s!r}")
    log_s = np.log(s)
    if (log_s * lam_rp > _MAX_LOG_FLOAT).any():
        raise ValueError(f"s^lam_rp overflows float64 (s={s!r}, lam_rp={lam_rp!r})")
    g = np.exp(np.minimum(t, lam_rp) * log_s) * (1.0 + log_s * np.maximum(t - lam_rp, 0.0))
    return _result(g)


def acceptance_factor(alpha, gamma):
    """MoESD's sigma: accepted tokens per round over the gamma + 1 the round could yield.

    sigma = [(1 - alpha^(gamma + 1)) / (1 - alpha)] / (gamma + 1); sigma(alpha = 1) = 1 and
    sigma(alpha = 0) = 1 / (gamma + 1).

    Args:
        alpha: per-token acceptance rate, in [0, 1]; float or array.
        gamma: draft tokens per round, integer >= 1; int or array.

    Returns:
        sigma, in [1 / (gamma + 1), 1]; same shape as the broadcast inputs.
    """
    alpha = _array("alpha", alpha)
    gamma = check_gamma(gamma)
    if ((alpha < 0) | (alpha > 1)).any():
        raise ValueError(f"alpha (acceptance rate) must be in [0, 1], got {alpha!r}")
    one_minus = 1.0 - alpha
    # expm1/log1p keep the ratio exact as alpha -> 1, where the plain form is 0/0.
    with np.errstate(divide="ignore", invalid="ignore"):
        geometric = -np.expm1((gamma + 1) * np.log1p(-one_minus)) / one_minus
    geometric = np.where(one_minus == 0, gamma + 1, geometric)
    return _result(geometric / (gamma + 1))


def sd_speedup(sigma, gamma, t_target_1, t_draft, t_target_gamma, t_reject):
    """Speculative-decoding speedup over autoregressive decoding at the same batch size.

    speedup = sigma (gamma + 1) T_T(B, 1) / (gamma T_D(B, 1) + T_T(B, gamma) + T_reject).

    Args:
        sigma: acceptance factor from ``acceptance_factor``, in (0, 1].
        gamma: draft tokens per round, integer >= 1.
        t_target_1: T_T(B, 1), seconds of one autoregressive target step, > 0.
        t_draft: T_D(B, 1), seconds of one draft step, >= 0.
        t_target_gamma: T_T(B, gamma), seconds of the verify pass, > 0.
        t_reject: seconds of the accept/reject step, >= 0.

    Returns:
        Speedup (> 1 means SD pays); same shape as the broadcast inputs.
    """
    sigma = _array("sigma", sigma)
    gamma = check_gamma(gamma)
    if ((sigma <= 0) | (sigma > 1)).any():
        raise ValueError(f"sigma must be in (0, 1], got {sigma!r}")
    times = {
        "t_target_1": (_array("t_target_1", t_target_1), True),
        "t_draft": (_array("t_draft", t_draft), False),
        "t_target_gamma": (_array("t_target_gamma", t_target_gamma), True),
        "t_reject": (_array("t_reject", t_reject), False),
    }
    for name, (value, strict) in times.items():
        if (value <= 0 if strict else value < 0).any():
            raise ValueError(f"{name} (seconds) must be {'>' if strict else '>='} 0, got {value!r}")
    t1, td, tg, tr = (value for value, _ in times.values())
    return _result(sigma * (gamma + 1) * t1 / (gamma * td + tg + tr))


def target_efficiency(t_target_1, t_target_gamma):
    """MoESD's target efficiency T_T(B, 1) / T_T(B, gamma).

    Near 1 while the verify pass is memory-bound and loads no more weights than one decode
    step; near 1 / gamma once it is compute-bound.

    Args:
        t_target_1: seconds of one autoregressive target step, > 0.
        t_target_gamma: seconds of the verify pass over gamma tokens per request, > 0.

    Returns:
        Dimensionless ratio; same shape as the broadcast inputs.
    """
    t1 = _array("t_target_1", t_target_1)
    tg = _array("t_target_gamma", t_target_gamma)
    if (t1 <= 0).any() or (tg <= 0).any():
        raise ValueError(
            f"target times (seconds) must be > 0, got t_target_1={t_target_1!r}, "
            f"t_target_gamma={t_target_gamma!r}"
        )
    return _result(t1 / tg)
