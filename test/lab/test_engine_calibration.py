"""The offline engine's calibrated acceptance (``SpecConfig.calibrated_acceptance``,
``lab.engine.calibration``) on the tiny models: lossless, every step's predicted accepted
tokens recorded (raw and calibrated), one calibrator learning across calls."""

import pytest
from _models import random_prompts, tiny_engine_fixture

from sgl_ecospec.acceptance import AcceptanceCalibrator
from sgl_ecospec.lab.bench import metrics
from sgl_ecospec.lab.engine import ENGINE_SELECTION, SpecConfig

MAX_NEW = 24


PROMPTS = random_prompts(3, seed=1)


engine = tiny_engine_fixture("calibration", PROMPTS, MAX_NEW + 8)


@pytest.fixture(scope="module")
def greedy(engine):
    return engine.generate_greedy(PROMPTS, MAX_NEW).outputs


@pytest.mark.parametrize("policy", ["confidence", "ecospec"])
def test_calibrated_selection_is_lossless_and_records_predictions(engine, greedy, policy):
    spec = SpecConfig(
        topk=4,
        num_steps=3,
        budget=4,
        calibrated_acceptance=True,
        selection=ENGINE_SELECTION.replace(policy=policy),
    )
    calibrator = AcceptanceCalibrator(spec.num_steps)
    result = engine.generate_speculative(PROMPTS, MAX_NEW, spec, calibrator=calibrator)
    assert result.outputs == greedy
    for step in result.steps:
        assert len(step.predicted_accepted) == len(step.predicted_accepted_raw) == step.batch_size
        assert all(0 <= p <= spec.budget + 1e-6 for p in step.predicted_accepted)
        assert all(0 <= p <= spec.budget + 1e-6 for p in step.predicted_accepted_raw)
    # The first step ran on a cold calibrator: its forecast is the draft's own.
    first = result.steps[0]
    assert first.predicted_accepted == pytest.approx(first.predicted_accepted_raw, rel=1e-5)
    # The calibrator learnt from every step, in place, and its forecasts moved off the raw.
    assert calibrator.observe_calls == len(result.steps)
    assert calibrator.promised.sum() > 0
    later = [s for s in result.steps[1:] if s.predicted_accepted != s.predicted_accepted_raw]
    assert later
    summary = metrics.predicted_acceptance(result.steps)
    measured = metrics.acceptance_length(result.steps)
    assert summary["predicted_accept_ratio"] == pytest.approx(
        summary["predicted_accept_length"] / measured
    )


def test_calibration_changes_selection_only(engine, greedy):
    # A calibrator told that likely depth-0 edges (q >= 0.5) are almost never accepted:
    # calibrated selection then skips the draft's favourite first token, which the fitted
    # draft usually gets right, so fewer drafts are accepted; the output stays the same.
    plain, calibrated = (
        SpecConfig(topk=4, num_steps=3, budget=4, calibrated_acceptance=flag)
        for flag in (False, True)
    )
    runs = {}
    for spec in (plain, calibrated):
        calibrator = AcceptanceCalibrator(3)
        calibrator.accepted[0, 5:].fill_(0.0)
        calibrator.promised[0, 5:].fill_(100.0)  # q above 0.5 at depth 0: ratio ~ 0.01
        runs[spec.calibrated_acceptance] = engine.generate_speculative(
            PROMPTS[:1], MAX_NEW, spec, calibrator=calibrator
        )
    assert runs[False].outputs == runs[True].outputs == greedy[:1]
    lengths = {k: metrics.acceptance_length(r.steps) for k, r in runs.items()}
    assert lengths[True] < lengths[False]


def test_fresh_calibrator_per_call_and_errors(engine, greedy):
    result = engine.generate_speculative(PROMPTS[:1], 8, SpecConfig())
    assert result.outputs[0] == greedy[0][:8]
    assert all(s.predicted_accepted is not None for s in result.steps)
    with pytest.raises(ValueError, match="build it with AcceptanceCalibrator\\(3\\)"):
        engine.generate_speculative(
            PROMPTS[:1], 4, SpecConfig(num_steps=3), calibrator=AcceptanceCalibrator(2)
        )
    with pytest.raises(TypeError, match="calibrator must be an AcceptanceCalibrator"):
        engine.generate_speculative(PROMPTS[:1], 4, SpecConfig(), calibrator="calibrated")
    with pytest.raises(TypeError, match="calibrated_acceptance must be a bool"):
        SpecConfig(calibrated_acceptance=1)
