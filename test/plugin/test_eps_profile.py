"""SGLANG_ECOSPEC_PROFILE=FILE: a calibration profile as the server's cost model (settings,
eps table, the log line naming the model), and the prior as the named fallback."""

import json
import logging

import numpy as np
import pytest
from sglang_ecospec import eps_table
from sglang_ecospec.settings import EcoSpecSettings, EcoSpecSettingsError

from sgl_ecospec.costmodel import PerformanceModel, TimingPoint, get_model, selection_cost
from sgl_ecospec.costmodel.calibration import CalibrationGrid, calibrate
from sgl_ecospec.costmodel.profiles import HardwareProfile

QWEN3_30B = get_model("qwen3-30b-a3b")  # 48 MoE layers x 128 experts, top-8
SERVED = {"moe_layers": 48, "num_experts": 128, "top_k": 8}
DEVICE = HardwareProfile("measured test", 3.0e12, 600e12, 600e12)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    """A calibration profile of Qwen3-30B-A3B on a made-up device: step times with a large
    fixed overhead and a unique-expert term, fitted."""
    grid = CalibrationGrid((1, 4, 16), (1, 4, 8), (8, 32, 128), repeats=1)
    points = []
    for batch, tokens, unique in grid.target_points(128, 8):
        seconds = 4e-3 + 2e-6 * batch * tokens + 30e-6 * unique
        kind = "ar" if tokens == 1 else "verify"
        points.append(TimingPoint(kind, batch, tokens, seconds, float(unique)))
    profile = calibrate(points, QWEN3_30B, DEVICE, device="test gpu", dtype="bfloat16", grid=grid)
    return profile, profile.save(tmp_path_factory.mktemp("profile") / "gpu.json")


def _settings(**env):
    return EcoSpecSettings.from_env({f"SGLANG_ECOSPEC_{k}": v for k, v in env.items()})


def test_settings_accept_a_calibration_profile_file(profile_file):
    _, path = profile_file
    settings = _settings(EPS="auto", PROFILE=str(path))
    assert settings.eps_auto and settings.profile == str(path) and settings.hardware is None


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "profile: calibration profile .*missing.json'?: no such file; write one with "),
        ("{oops", "is not a JSON file"),
        ('{"format": "other"}', "not an sgl-ecospec calibration profile: format tag 'other'"),
    ],
)
def test_settings_reject_a_missing_or_wrong_profile_file(tmp_path, content, message):
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(EcoSpecSettingsError, match=message):
        _settings(EPS="auto", PROFILE=str(path))


def test_settings_reject_hardware_with_a_profile_file(profile_file):
    _, path = profile_file
    with pytest.raises(EcoSpecSettingsError, match="carries the device it was timed on"):
        _settings(EPS="auto", PROFILE=str(path), HARDWARE="h200")


def test_settings_unknown_name_mentions_the_file_form():
    with pytest.raises(EcoSpecSettingsError, match="unknown model 'llama'.*calibration profile"):
        _settings(EPS="auto", PROFILE="llama", HARDWARE="h200")


def _table(profile, hardware, ep_size=1):
    return eps_table.cost_model_eps_table(
        profile, hardware, verify_tokens=8, max_batch=16, ep_size=ep_size, **SERVED
    )


def test_eps_from_the_profile_is_the_calibrated_models_and_not_the_priors(profile_file, caplog):
    profile, path = profile_file
    with caplog.at_level(logging.INFO, logger="sglang_ecospec.eps_table"):
        calibrated = _table(str(path), None)
    assert "ECOSPEC cost model: calibrated profile" in caplog.text
    assert str(path) in caplog.text and "residual rms" in caplog.text
    perf = PerformanceModel(profile.model, profile.hardware, profile.params)
    expected = [selection_cost(perf, b, 8, layers=48).eps for b in calibrated.batches]
    assert calibrated.eps == pytest.approx(expected)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_ecospec.eps_table"):
        prior = _table("qwen3-30b-a3b", "h200")
    assert "cost model: prior (fallback; no calibrated profile)" in caplog.text
    assert "qwen3-30b-a3b on h200" in caplog.text
    assert prior.batches == calibrated.batches == (1, 2, 4, 8, 16)
    assert not np.allclose(prior.eps, calibrated.eps, rtol=0.05)


def test_a_profile_file_prices_ep_from_its_own_device(profile_file):
    _, path = profile_file
    # One device's seconds per expert: the busiest EP rank's pace, no hardware to cover.
    assert _table(str(path), None, ep_size=8).eps == _table(str(path), None).eps
    eps_table.check_hardware_covers(None, 8)


def test_a_profile_file_of_another_model_is_refused(profile_file, tmp_path):
    profile, _ = profile_file
    data = profile.to_json()
    data["model"]["moe_layers"] = 94
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="has 94 MoE layers x 128 experts .* the served model 48"):
        _table(str(other), None)
