"""The verify pass under expert parallelism: the busiest rank's expected experts and the
EP pass time (costmodel/formulas.py, costmodel/expert_parallel.py)."""

import numpy as np
import pytest
from test_performance_model import TRUTH

from sgl_ecospec.costmodel import (
    PerformanceModel,
    expected_unique_experts,
    get_hardware,
    get_model,
    selection_cost,
)
from sgl_ecospec.costmodel.expert_parallel import ep_pass_time, uniform_ep_verify_time
from sgl_ecospec.costmodel.formulas import expected_busiest_rank_experts

QWEN3 = get_model("qwen3-235b-a22b")


def sampled_busiest(tokens: int, experts: int, top_k: int, ranks: int, draws: int) -> float:
    """Mean busiest-rank experts of sampled uniform routing (K distinct experts a token)."""
    rng = np.random.default_rng(tokens * 1000 + experts)
    picks = rng.random((draws, tokens, experts)).argsort(-1)[..., :top_k]
    used = np.zeros((draws, experts), dtype=bool)
    np.put_along_axis(used, picks.reshape(draws, -1), True, axis=1)
    sizes = [experts // ranks + (r < experts % ranks) for r in range(ranks)]
    starts = np.cumsum([0] + sizes[:-1])
    return float(np.add.reduceat(used, starts, axis=1).max(-1).mean())


@pytest.mark.parametrize(
    "tokens, experts, top_k, ranks",
    [
        (1, 64, 8, 8),
        (2, 64, 8, 8),
        (1, 128, 8, 8),
        (4, 128, 8, 8),
        (16, 256, 8, 8),
        (3, 128, 8, 4),
        (2, 60, 4, 8),
    ],
)
def test_busiest_rank_matches_sampled_routing(tokens, experts, top_k, ranks):
    expected = expected_busiest_rank_experts(tokens, experts, top_k, ranks)
    assert expected == pytest.approx(sampled_busiest(tokens, experts, top_k, ranks, 4000), rel=0.02)


def test_busiest_rank_bounds_and_edges():
    tokens = np.array([0.0, 0.5, 1.0, 2.0, 7.0, 40.0, 1e4])
    union = expected_unique_experts(tokens, 128, 8)
    # One rank holds the whole union, bit for bit.
    np.testing.assert_array_equal(expected_busiest_rank_experts(tokens, 128, 8, 1), union)
    busiest = expected_busiest_rank_experts(tokens, 128, 8, 8)
    assert (busiest >= union / 8 - 1e-12).all() and (busiest <= np.minimum(union, 16) + 1e-12).all()
    assert (np.diff(busiest) > 0).all() and busiest[0] == 0.0
    assert busiest[-1] == pytest.approx(16.0)  # saturated: every rank full
    # One token's 8 experts on 8 ranks of 16: the busiest holds about 2.5 of them.
    assert expected_busiest_rank_experts(1, 128, 8, 8) == pytest.approx(2.51, abs=0.01)
    # Ranks of unequal sizes (60 experts on 8 ranks: four of 8, four of 7).
    uneven = expected_busiest_rank_experts(tokens, 60, 4, 8)
    union60 = expected_unique_experts(tokens, 60, 4)
    assert (uneven >= union60 / 8 - 1e-12).all() and (uneven <= np.minimum(union60, 8) + 1e-9).all()
    assert uneven[-1] == pytest.approx(8.0)
    assert expected_busiest_rank_experts(64, 128, 8, 128) == pytest.approx(1.0, abs=1e-3)
    for bad in (0, 129, 2.0):
        with pytest.raises(ValueError, match=r"ep_size must be an int in \[1, num_experts=128\]"):
            expected_busiest_rank_experts(1, 128, 8, bad)


def test_ep_pass_time_prices_the_busiest_rank():
    perf = PerformanceModel(QWEN3, get_hardware("8xh200"), TRUTH)
    tokens, unique = np.array([8.0, 40.0]), np.array([40.0, 90.0])
    plain = perf.verify_time(1, tokens, unique)
    np.testing.assert_allclose(ep_pass_time(perf, tokens, unique, unique, 1), plain)
    # A perfectly balanced layer costs what the plain model says.
    np.testing.assert_allclose(ep_pass_time(perf, tokens, unique, unique / 8, 8), plain)
    # Each expert the busiest rank holds above its even share costs R x k2.
    skewed = ep_pass_time(perf, tokens, unique, unique / 8 + 2, 8)
    np.testing.assert_allclose(skewed - plain, 2 * 8 * perf.params.k2)
    with pytest.raises(ValueError, match="ep_size must be an int >= 1"):
        ep_pass_time(perf, tokens, unique, unique, 0)


def test_uniform_ep_verify_time():
    perf = PerformanceModel(QWEN3, get_hardware("8xh200"), TRUTH)
    assert uniform_ep_verify_time(perf, 4, 3, 1) == perf.verify_time(4, 3)
    busiest = expected_busiest_rank_experts(12, 128, 8, 8)
    union = expected_unique_experts(12, 128, 8)
    assert uniform_ep_verify_time(perf, 4, 3, 8) == pytest.approx(
        perf.verify_time(4, 3) + perf.params.k2 * (8 * busiest - union)
    )
    times = uniform_ep_verify_time(perf, 1, np.arange(1, 6), 8)
    assert (np.diff(times) > 0).all() and (times > perf.verify_time(1, np.arange(1, 6))).all()


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_selection_cost_under_ep_prices_the_roots_at_the_busiest_rank(batch):
    perf = PerformanceModel(QWEN3, get_hardware("8xh200"), TRUTH)
    cost = selection_cost(perf, batch, 5, draft_steps=3, ep_size=8)
    roots = uniform_ep_verify_time(perf, batch, 1, 8)
    assert cost.step_seconds == pytest.approx(
        roots + 3 * perf.draft_time(batch) + perf.reject_time(batch)
    )
    assert cost.step_seconds > selection_cost(perf, batch, 5, draft_steps=3).step_seconds
    # The k-th candidate per request: the EP step time of B more tokens, for k = 0 and 1.
    for k in range(2):
        seconds = uniform_ep_verify_time(perf, batch, 2 + k, 8) - uniform_ep_verify_time(
            perf, batch, 1 + k, 8
        )
        priced = cost.eps + cost.candidate_cost * cost.candidate_decay**k
        assert priced == pytest.approx(seconds / (batch * cost.expert_seconds), rel=1e-9)
