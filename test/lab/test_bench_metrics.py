"""The benchmark's metrics (``lab.bench.metrics``) on hand-made steps, and their pricing by
the cost model."""

import pytest

from sgl_ecospec.costmodel import (
    PerformanceModel,
    acceptance_factor,
    analytic_params,
    expected_unique_experts,
    get_hardware,
    get_model,
    sd_speedup,
)
from sgl_ecospec.lab.bench import metrics
from sgl_ecospec.lab.engine.stats import StepStats as Step

QWEN3 = get_model("qwen3-235b-a22b")


@pytest.fixture(scope="module")
def perf():
    hardware = get_hardware("h200")
    return PerformanceModel(QWEN3, hardware, analytic_params(QWEN3, hardware).params)


# --- metrics ----------------------------------------------------------------------------


def test_acceptance_and_expert_statistics():
    steps = [
        Step(2, 10, [0, 2], [2, 4], recall=0.5),
        Step(1, 5, [1], [6, 8], recall=None),
    ]
    # (request, step) pairs: accepted 0, 2, 1 -> lengths 1, 3, 2.
    assert metrics.acceptance_length(steps) == 2.0
    summary = metrics.summarize(steps)
    assert summary == {
        "verify_steps": 2,
        "request_steps": 3,
        "tokens": 6,
        "accept_length": 2.0,
        "experts_per_layer_step": 5.0,
        "experts_per_layer_step_p90": pytest.approx(7.4),  # linear between 6 and 8
        "predictor_recall": 0.5,  # steps without recall are left out
    }
    assert metrics.summarize(steps[1:])["predictor_recall"] is None


def test_predicted_against_measured_acceptance():
    steps = [
        Step(2, 10, [0, 2], [2], predicted_accepted=[0.5, 1.5], predicted_accepted_raw=[2, 2]),
        Step(1, 5, [1], [2], predicted_accepted=[1.0], predicted_accepted_raw=[2.5]),
    ]
    # Measured: lengths 1, 3, 2 (mean 2); forecast 1.5, 2.5, 2 (mean 2) and 3, 3, 3.5.
    assert metrics.predicted_acceptance(steps) == pytest.approx(
        {
            "predicted_accept_length": 2.0,
            "predicted_accept_ratio": 1.0,
            "predicted_accept_length_raw": 1 + 6.5 / 3,
            "predicted_accept_ratio_raw": (1 + 6.5 / 3) / 2,
        }
    )
    unrecorded = metrics.predicted_acceptance([*steps, Step(1, 5, [0], [2])])
    assert set(unrecorded.values()) == {None}


def test_metric_errors():
    with pytest.raises(ValueError, match="no verify steps"):
        metrics.summarize([])
    with pytest.raises(ValueError, match="same number"):
        metrics.summarize([Step(1, 5, [0], [2, 2]), Step(1, 5, [0], [2])])
    with pytest.raises(ValueError, match="list no requests"):
        metrics.acceptance_length([Step(0, 0, [], [2])])


def test_uniform_experts_and_equivalent_alpha():
    steps = [Step(1, 5, [0], [2]), Step(2, 10, [0, 0], [2])]
    expected = (expected_unique_experts(5, 16, 2) + expected_unique_experts(10, 16, 2)) / 2
    assert metrics.uniform_experts(steps, 16, 2) == pytest.approx(expected)
    assert metrics.equivalent_alpha(1.0, 3) == pytest.approx(0.0, abs=1e-12)
    assert metrics.equivalent_alpha(4.0, 3) == pytest.approx(1.0, abs=1e-12)
    alpha = metrics.equivalent_alpha(2.5, 3)
    assert acceptance_factor(alpha, 3) * 4 == pytest.approx(2.5)
    with pytest.raises(ValueError, match=r"accept_length must be in \[1, num_draft_steps \+ 1"):
        metrics.equivalent_alpha(4.5, 3)


def test_predicted_cost_matches_moesd_speedup_on_identical_steps(perf):
    # Testbed E=16, K=2; batch 2, budget 4 (5 tokens per request); routing exactly uniform,
    # so the scaled unions are Qwen3's uniform N(10) and N(2).
    budget, steps_per_round, batch = 4, 3, 2
    tokens = batch * (budget + 1)
    spec = [Step(batch, tokens, [1, 2], [expected_unique_experts(tokens, 16, 2)] * 3)] * 4
    ar = [Step(batch, batch, [0, 0], [expected_unique_experts(batch, 16, 2)] * 3)] * 9
    cost = metrics.predicted_cost(
        spec, ar, perf, num_experts=16, top_k=2, num_draft_steps=steps_per_round
    )
    accept_length = 2.5
    want = sd_speedup(
        accept_length / (steps_per_round + 1),
        steps_per_round,
        perf.ar_time(batch),
        perf.draft_time(batch),
        perf.verify_time(batch, budget + 1),
        perf.reject_time(batch),
    )
    assert cost["speedup"] == pytest.approx(want, rel=1e-9)
    n_sd = expected_unique_experts(tokens, 128, 8)
    assert cost["experts_per_layer_step"] == pytest.approx(n_sd)
    assert cost["expert_bytes_per_step"] == pytest.approx(n_sd * 94 * QWEN3.bytes_per_expert)
    assert cost["verify_ms"] == pytest.approx(1e3 * perf.verify_time(batch, budget + 1))
    assert cost["ar_ms"] == pytest.approx(1e3 * perf.ar_time(batch))
    assert cost["draft_ms"] == pytest.approx(3e3 * perf.draft_time(batch))
    assert acceptance_factor(cost["alpha"], steps_per_round) * 4 == pytest.approx(2.5)


def test_fewer_experts_predict_a_faster_verify(perf):
    ar = [Step(1, 1, [0], [2, 2])] * 4
    wide = [Step(1, 5, [1], [8, 8])] * 4
    narrow = [Step(1, 5, [1], [4, 4])] * 4
    kw = {"num_experts": 16, "top_k": 2, "num_draft_steps": 3}
    cost_wide = metrics.predicted_cost(wide, ar, perf, **kw)
    cost_narrow = metrics.predicted_cost(narrow, ar, perf, **kw)
    assert cost_narrow["verify_ms"] < cost_wide["verify_ms"]
    assert cost_narrow["speedup"] > cost_wide["speedup"]
    assert cost_narrow["expert_bytes_per_step"] < cost_wide["expert_bytes_per_step"]


def test_first_mismatch():
    assert metrics.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_mismatch([1, 2, 3], [1, 2]) == 2
    assert metrics.first_mismatch([], [4]) == 0


# --- arguments --------------------------------------------------------------------------
