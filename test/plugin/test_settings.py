"""EcoSpec's settings: defaults, environment and file overrides, errors that name the problem."""

import dataclasses
import json

import pytest
from sglang_ecospec.eps_table import BatchOptions
from sglang_ecospec.settings import EcoSpecSettings, EcoSpecSettingsError

from sgl_ecospec.ops.options import SERVED_MIN_SCORE, SelectionOptions
from sgl_ecospec.ops.selection import ADAPTIVE_EP_TOTAL_WEIGHT


def test_settings_defaults_and_env_overrides(tmp_path):
    assert EcoSpecSettings.from_env({}) == EcoSpecSettings()
    config = tmp_path / "ecospec.json"
    config.write_text(json.dumps({"eps": 0.5, "policy": "confidence", "log_interval": 7}))
    settings = EcoSpecSettings.from_env(
        {
            "SGLANG_ECOSPEC_CONFIG": str(config),
            "SGLANG_ECOSPEC_EPS": "0.25",  # the variable wins over the file
            "SGLANG_ECOSPEC_SHARE_BUFFER": "false",
            "SGLANG_ECOSPEC_PREDICTOR_FILE": "none",
            "OTHER": "ignored",
        }
    )
    assert settings.eps == 0.25 and settings.policy == "confidence"
    assert settings.share_buffer is False and settings.log_interval == 7
    assert settings.predictor_file is None


@pytest.mark.parametrize(
    "env, message",
    [
        ({"EPSILON": "1"}, "unknown EcoSpec setting SGLANG_ECOSPEC_EPSILON"),
        ({"EPS": "0"}, "eps must be"),
        ({"EPS": "nan"}, "eps must be"),
        ({"LEARN": "maybe"}, "not a valid bool"),
        ({"POLICY": "fastest"}, "policy must be one of"),
        ({"PREDICTOR": "oracle"}, "predictor must be one of"),
        ({"PREDICTOR_FILE": "/no/such/file"}, "does not exist"),
        ({"NUM_BUCKETS": "0"}, "num_buckets"),
        ({"CONFIG": "/no/such.json"}, "no such file"),
        ({"POLICY": "adaptive"}, "policy 'adaptive' sizes .* set eps=auto"),
        ({"EPS": "fast"}, "eps must be a finite number > 0 or 'auto'"),
        ({"EPS": "auto"}, "eps='auto' needs profile and hardware"),
        (
            {"EPS": "auto", "PROFILE": "qwen3-235b-a22b"},
            "eps='auto' needs hardware: hardware: its GPUs \\(one of h100, h200",
        ),
        (
            {"EPS": "auto", "PROFILE": "llama", "HARDWARE": "h200"},
            "unknown model 'llama'; valid: qwen3-235b-a22b, qwen3-30b-a3b",
        ),
        (
            {"EPS": "auto", "PROFILE": "qwen3-30b-a3b", "HARDWARE": "tpu"},
            "unknown hardware 'tpu'",
        ),
        (
            {"HARDWARE": "h200"},
            "hardware set but eps = 0.1: .* only with eps='auto'",
        ),
        ({"TOTAL_WEIGHT": "1.5"}, "total_weight must lie in"),
        (
            {"RECALL_WEIGHTED_COST": "1", "POLICY": "confidence"},
            "recall_weighted_cost weights EcoSpec's DeltaCost, but policy 'confidence'",
        ),
        ({"RECALL_WEIGHTED_COST": "sometimes"}, "not a valid bool"),
        ({"EP_COST": "2"}, "not a valid bool"),
        ({"CALIBRATE": "sometimes"}, "SGLANG_ECOSPEC_CALIBRATE='sometimes' is not a valid bool"),
        ({"CALIBRATE": "on"}, "calibrate=on fits the cost model that eps='auto' reads, but eps"),
        (
            {"CALIBRATE": "on", "EPS": "auto", "PROFILE": "/tmp/gpu.json"},
            "calibrate=on and the calibration profile file '/tmp/gpu.json': choose one",
        ),
        (
            {"CALIBRATE": "on", "EPS": "auto", "PROFILE": "qwen3-30b-a3b"},
            "eps='auto' needs hardware",
        ),
        (
            {"CALIBRATE_TOKENS": "1,2"},
            "calibrate_tokens set but calibrate is off: .* only with calibrate=on",
        ),
        (
            {"CALIBRATE": "on", "EPS": "auto", "CALIBRATE_BATCH_SIZES": "1,1"},
            "calibrate_batch_sizes must hold distinct comma-separated integers >= 1",
        ),
        (
            {"CALIBRATE": "on", "EPS": "auto", "CALIBRATE_UNIQUE_EXPERTS": "8,x"},
            "calibrate_unique_experts must hold distinct",
        ),
        ({"CALIBRATE": "on", "EPS": "auto", "CALIBRATE_REPEATS": "0"}, "calibrate_repeats"),
        ({"CALIBRATE": "on", "EPS": "auto", "CALIBRATE_TIMEOUT": "0"}, "calibrate_timeout"),
        ({"CALIBRATE": "on", "EPS": "auto", "CALIBRATE_TIMEOUT": "inf"}, "calibrate_timeout"),
    ],
)
def test_settings_errors_name_the_problem(env, message):
    """``env`` names the variables without their ``SGLANG_ECOSPEC_`` prefix."""
    with pytest.raises(EcoSpecSettingsError, match=message):
        EcoSpecSettings.from_env({f"SGLANG_ECOSPEC_{k}": v for k, v in env.items()})


def test_settings_eps_auto_and_ep_fields(tmp_path):
    settings = EcoSpecSettings.from_env(
        {
            "SGLANG_ECOSPEC_EPS": "auto",
            "SGLANG_ECOSPEC_PROFILE": "qwen3-30b-a3b",
            "SGLANG_ECOSPEC_HARDWARE": "8xh200",
            "SGLANG_ECOSPEC_EP_COST": "false",
            "SGLANG_ECOSPEC_TOTAL_WEIGHT": "0.25",
        }
    )
    assert settings.eps_auto and settings.hardware == "8xh200"
    adaptive = EcoSpecSettings.from_env(
        {
            "SGLANG_ECOSPEC_POLICY": "adaptive",
            "SGLANG_ECOSPEC_EPS": "auto",
            "SGLANG_ECOSPEC_PROFILE": "qwen3-30b-a3b",
            "SGLANG_ECOSPEC_HARDWARE": "h200",
        }
    )
    fields = adaptive.selection_fields()  # eps and the step cost come per batch size
    assert fields["policy"] == "adaptive" and "eps" not in fields and "step_cost" not in fields
    # Under EP "adaptive" charges only the busiest rank's rise unless told otherwise; the
    # other policies keep the op's 1 / R; a set total_weight wins for every policy.
    assert adaptive.selection_fields()["total_weight"] == ADAPTIVE_EP_TOTAL_WEIGHT == 0.0
    assert EcoSpecSettings().selection_fields()["total_weight"] is None
    set_weight = dataclasses.replace(adaptive, total_weight=0.5)
    assert set_weight.selection_fields()["total_weight"] == 0.5
    assert settings.ep_cost is False and settings.total_weight == 0.25
    assert not EcoSpecSettings().eps_auto and EcoSpecSettings().ep_cost
    config = tmp_path / "ecospec.json"
    config.write_text(json.dumps({"eps": "auto", "profile": "deepseek-v3", "hardware": "h100"}))
    assert EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)}).eps_auto
    config.write_text(json.dumps({"eps": 2}))  # a JSON int is a number
    assert EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)}).eps == 2
    config.write_text(json.dumps({"eps": [1]}))
    with pytest.raises(EcoSpecSettingsError, match="'eps' .* must be float or str"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)})


def test_settings_file_rejects_unknown_keys_and_wrong_types(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"epsilon": 1.0}))
    with pytest.raises(EcoSpecSettingsError, match="unknown EcoSpec settings"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)})
    config.write_text(json.dumps({"share_buffer": "yes"}))
    with pytest.raises(EcoSpecSettingsError, match="must be bool"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)})


def test_sglangs_copy_of_the_labs_sgl_variables_is_not_a_setting():
    # SGLang copies SGL_* variables to SGLANG_* at import; SGL_ECOSPEC_CACHE is the lab's.
    environ = {"SGL_ECOSPEC_CACHE": "/tmp/c", "SGLANG_ECOSPEC_CACHE": "/tmp/c"}
    assert EcoSpecSettings.from_env(environ) == EcoSpecSettings.from_env({})
    with pytest.raises(EcoSpecSettingsError, match="unknown EcoSpec setting SGLANG_ECOSPEC_CACHE"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CACHE": "/tmp/c"})


def test_settings_predictors_of_the_catalog_and_recall_weighted_cost():
    for name in ("online", "vocab", "context"):  # the library's catalog, fresh tables
        assert EcoSpecSettings.from_env({"SGLANG_ECOSPEC_PREDICTOR": name}).predictor == name
    settings = EcoSpecSettings.from_env(
        {"SGLANG_ECOSPEC_PREDICTOR": "context", "SGLANG_ECOSPEC_RECALL_WEIGHTED_COST": "true"}
    )
    assert settings.recall_weighted_cost is True
    # Unset: on with the policies that read a cost, off with confidence (SGLang's EAGLE-3).
    assert EcoSpecSettings().recall_weighted_cost is True
    assert EcoSpecSettings(policy="confidence").recall_weighted_cost is False
    off = EcoSpecSettings.from_env({"SGLANG_ECOSPEC_RECALL_WEIGHTED_COST": "off"})
    assert off.recall_weighted_cost is False


def test_settings_hold_their_checked_selection_options():
    settings = EcoSpecSettings.from_env({"SGLANG_ECOSPEC_EPS": "0.3"})
    assert settings.selection == SelectionOptions(
        policy="ecospec", eps=0.3, share_buffer=True, min_score=SERVED_MIN_SCORE
    )
    assert "selection" not in settings.to_dict() and settings.to_dict()["eps"] == 0.3
    with pytest.raises(EcoSpecSettingsError, match="unknown EcoSpec setting SGLANG_ECOSPEC_SEL"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_SELECTION": "x"})
    with pytest.raises(TypeError):
        EcoSpecSettings(selection=settings.selection)


def test_settings_round_sync():
    rounds = EcoSpecSettings.from_env({"SGLANG_ECOSPEC_ROUND_SYNC": "on"})
    assert rounds.selection.round_sync and rounds.selection.share_buffer
    with pytest.raises(EcoSpecSettingsError, match="round_sync=True needs share_buffer=True"):
        EcoSpecSettings.from_env(
            {"SGLANG_ECOSPEC_ROUND_SYNC": "on", "SGLANG_ECOSPEC_SHARE_BUFFER": "off"}
        )


def test_settings_min_score():
    assert EcoSpecSettings().selection_fields() == dict(
        policy="ecospec",
        share_buffer=True,
        round_sync=False,
        total_weight=None,
        min_score=SERVED_MIN_SCORE,
        eps=0.1,
    )
    assert EcoSpecSettings(policy="confidence").min_score == 0.0  # SGLang's selection
    assert EcoSpecSettings.from_env({"SGLANG_ECOSPEC_MIN_SCORE": "0"}).min_score == 0.0
    floored = EcoSpecSettings.from_env(
        {"SGLANG_ECOSPEC_POLICY": "confidence", "SGLANG_ECOSPEC_MIN_SCORE": "0.2"}
    )
    assert floored.min_score == 0.2
    settings = EcoSpecSettings.from_env({"SGLANG_ECOSPEC_MIN_SCORE": "0.05"})
    options = BatchOptions(settings, None)(8)
    assert options is settings.selection
    assert options.min_score == 0.05 and options.stops_short
    with pytest.raises(EcoSpecSettingsError, match=r"min_score must be >= 0, got -1.0$"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_MIN_SCORE": "-1"})


def test_settings_calibrate_at_startup(tmp_path):
    assert EcoSpecSettings().calibrate is False
    alone = EcoSpecSettings.from_env(
        {
            "SGLANG_ECOSPEC_EPS": "auto",
            "SGLANG_ECOSPEC_CALIBRATE": "on",
            "SGLANG_ECOSPEC_CALIBRATE_BATCH_SIZES": "1,2",
            "SGLANG_ECOSPEC_CALIBRATE_REPEATS": "1",
            "SGLANG_ECOSPEC_CALIBRATE_TIMEOUT": "600",
        }
    )  # no fallback prior: a failed calibration stops the start
    assert alone.calibrate is True and alone.profile is None and alone.hardware is None
    assert alone.calibrate_batch_sizes == "1,2" and alone.calibrate_repeats == 1
    assert alone.calibrate_timeout == 600.0 and alone.calibrate_tokens is None
    off = EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CALIBRATE": "off"})
    assert off.calibrate is False
    config = tmp_path / "ecospec.json"
    config.write_text(
        json.dumps(
            {"eps": "auto", "calibrate": True, "profile": "qwen3-30b-a3b", "hardware": "h200"}
        )
    )  # the prior as the fallback
    settings = EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)})
    assert settings.calibrate and settings.profile == "qwen3-30b-a3b"
    config.write_text(json.dumps({"eps": "auto", "calibrate": "on"}))
    with pytest.raises(EcoSpecSettingsError, match="'calibrate' .* must be bool"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)})
