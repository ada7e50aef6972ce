"""Calibration: the grid, the fit of timed points, the profile file (costmodel/calibration.py)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from sgl_ecospec.costmodel import (
    HardwareProfile,
    ModelProfile,
    MoESDParams,
    PerformanceModel,
    expert_load_time,
    fit_params,
    ridge_tokens,
)
from sgl_ecospec.costmodel.calibration import (
    FORMAT,
    CalibrationFileError,
    CalibrationGrid,
    CalibrationProfile,
    ForwardTiming,
    calibrate,
    measure_hardware,
    time_grid,
)
from sgl_ecospec.costmodel.prefill import PrefillLine

# The small testbed's shape in float32, and a 2-core CPU (20 GB/s, 100 GFLOP/s fp32).
MODEL = ModelProfile(
    name="testbed-small",
    moe_layers=8,
    num_experts=64,
    top_k=8,
    hidden=576,
    moe_intermediate=4,
    bytes_per_expert=3 * 576 * 4 * 4,
    dense_params=60e6,
    bytes_per_dense_param=4,
    compute_dtype="fp32",
    vocab_size=49152,
)
CPU = HardwareProfile("cpu", 20e9, 100e9, 100e9, 100e9)
# Overheads far above the load times, as on a real stack: bias 60x T_dense, k2 30x T_expert.
TRUTH = MoESDParams(
    bias=0.012,
    k1=4e-4,
    k2=0.25e-3,
    k3=1e-4,
    lam=0.5,
    s=1.08,
    draft_bias=2e-3,
    draft_k=3e-4,
    reject_bias=1e-4,
    reject_k=5e-5,
)
GRID = CalibrationGrid((1, 2, 4, 8), (1, 2, 4, 8), (8, 16, 32, 64), repeats=3)


def synthetic_points(truth: MoESDParams, noise: float, seed: int = 0):
    """The grid timed on the model ``truth`` with multiplicative Gaussian noise."""
    perf = PerformanceModel(MODEL, CPU, truth)
    rng = np.random.default_rng(seed)

    def jitter(seconds):
        return float(seconds) * (1 + noise * rng.standard_normal())

    def time_target(batch, tokens, unique):
        return ForwardTiming(jitter(perf.verify_time(batch, tokens, unique)), float(unique))

    points = time_grid(
        GRID,
        MODEL.num_experts,
        MODEL.top_k,
        time_target,
        time_draft=lambda b: jitter(perf.draft_time(b)),
        time_reject=lambda b: jitter(perf.reject_time(b)),
    )
    return perf, points


def test_grid_clamps_unique_experts_to_what_the_tokens_can_touch():
    grid = CalibrationGrid((1, 2), (1, 4), (4, 16, 32), repeats=1)
    points = grid.target_points(num_experts=32, top_k=8)
    # 1 token touches exactly K = 8; 4 tokens up to 32 (all); 8 tokens: 8, 16, 32.
    assert points == [
        (1, 1, 8),
        (1, 4, 8),
        (1, 4, 16),
        (1, 4, 32),
        (2, 1, 8),
        (2, 1, 16),
        (2, 4, 8),
        (2, 4, 16),
        (2, 4, 32),
    ]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_sizes": ()}, "batch_sizes is empty"),
        ({"tokens_per_request": (0, 1)}, "tokens_per_request must hold integers >= 1"),
        ({"unique_experts": (8, 8)}, "unique_experts repeats a value"),
        ({"repeats": 0}, "repeats must be an integer >= 1"),
        ({"prefill_tokens": (32, 32)}, "prefill_tokens repeats a value"),
    ],
)
def test_grid_rejects_bad_values(kwargs, message):
    values = {"batch_sizes": (1,), "tokens_per_request": (1,), "unique_experts": (8,)}
    with pytest.raises(ValueError, match=message):
        CalibrationGrid(**{**values, **kwargs})


def test_grid_rejects_more_unique_experts_than_the_model_has():
    with pytest.raises(ValueError, match=r"unique_experts \[99\] exceed the model's 64 experts"):
        CalibrationGrid((1,), (1,), (8, 99)).target_points(64, 8)


def test_time_grid_kinds_and_progress():
    seen = []
    points = time_grid(
        CalibrationGrid((1, 2), (1, 2), (8,), repeats=1),
        64,
        8,
        lambda b, t, u: ForwardTiming(1e-3 * b * t, float(u)),
        time_reject=lambda b: 1e-5 * b,
        progress=lambda done, total, point: seen.append((done, total, point.kind)),
    )
    assert [(p.kind, p.batch, p.gamma) for p in points] == [
        ("ar", 1, 1),
        ("verify", 1, 2),
        ("ar", 2, 1),
        ("verify", 2, 2),
        ("reject", 1, 1),
        ("reject", 2, 1),
    ]
    assert seen[-1] == (6, 6, "reject") and [s[0] for s in seen] == list(range(1, 7))
    assert points[1].seconds == pytest.approx(2e-3) and points[1].unique_experts == 8.0


def test_fit_recovers_known_parameters_from_exact_timings():
    _, points = synthetic_points(TRUTH, noise=0.0)
    profile = calibrate(points, MODEL, CPU, device="test cpu", dtype="float32", grid=GRID)
    for name, value in TRUTH.as_dict().items():
        assert getattr(profile.params, name) == pytest.approx(value, rel=1e-3), name
    assert profile.fixed == () and profile.rms_residual < 1e-6


def test_fit_of_noisy_timings_predicts_the_truth():
    truth_perf, points = synthetic_points(TRUTH, noise=0.01)
    profile = calibrate(points, MODEL, CPU, device="test cpu", dtype="float32", grid=GRID)
    # With 1% noise the fixed cost splits freely between bias and the constant parts of
    # k1 G and k3 G (G >= 1), but the unique-expert term is pinned by the forced unions.
    assert profile.params.k2 == pytest.approx(TRUTH.k2, rel=0.05)
    assert profile.params.reject_k == pytest.approx(TRUTH.reject_k, rel=0.1)
    # Residuals at the noise level, and predictions off the grid's points close to the truth.
    assert profile.rms_residual < 0.02 and profile.max_abs_residual < 0.05
    perf = profile.performance_model()
    for batch, gamma, unique in [(3, 3, 20.0), (6, 5, 48.0), (8, 8, 64.0)]:
        assert perf.verify_time(batch, gamma, unique) == pytest.approx(
            truth_perf.verify_time(batch, gamma, unique), rel=0.03
        )
    assert perf.draft_time(6) == pytest.approx(truth_perf.draft_time(6), rel=0.03)
    # The roofline's load-time bounds cannot fit this stack: k2 pinned at 5 T_expert.
    bounded = fit_params(points, MODEL, CPU)
    assert bounded.params.k2 == pytest.approx(5 * expert_load_time(MODEL, CPU))
    assert bounded.rms_residual > 5 * profile.rms_residual


def test_fit_without_draft_or_reject_points_holds_them_at_zero():
    _, points = synthetic_points(TRUTH, noise=0.0)
    target_only = [p for p in points if p.kind in ("ar", "verify")]
    profile = calibrate(target_only, MODEL, CPU, device="cpu", dtype="float32", grid=GRID)
    assert set(profile.fixed) == {"draft_bias", "draft_k", "reject_bias", "reject_k"}
    assert profile.params.draft_bias == 0 and profile.rms_residual < 1e-3


def test_fp32_ridge_point_uses_four_bytes_per_weight():
    assert ridge_tokens(MODEL, CPU) == pytest.approx(100e9 * 4 / (2 * 20e9))
    no_fp32 = HardwareProfile("gpu", 1e12, 1e15, 2e15)
    with pytest.raises(ValueError, match="no fp32 peak"):
        ridge_tokens(MODEL, no_fp32)


@pytest.fixture(scope="module")
def profile():
    _, points = synthetic_points(TRUTH, noise=0.01)
    return calibrate(
        points, MODEL, CPU, device="test cpu", dtype="float32", grid=GRID, command="test"
    )


def test_profile_file_round_trip(profile, tmp_path):
    path = profile.save(tmp_path / "sub" / "cpu.json")
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["device"] == "test cpu"
    assert data["torch_version"] == torch.__version__
    assert data["grid"]["batch_sizes"] == [1, 2, 4, 8]
    assert data["rms_residual"] == pytest.approx(profile.rms_residual)
    assert [p["residual"] for p in data["points"]] == pytest.approx(list(profile.residuals()))
    loaded = CalibrationProfile.load(path)
    assert loaded == profile
    assert loaded.performance_model().verify_time(4, 4, 20.0) == pytest.approx(
        profile.performance_model().verify_time(4, 4, 20.0)
    )
    assert "residual rms" in loaded.summary() and "k2" in loaded.summary()
    assert data["prefill"] is None and loaded.prefill is None


def test_profile_file_carries_the_prefill_line(profile, tmp_path):
    line = PrefillLine.fit([32, 128], [1.2, 1.7])
    grid = dataclasses.replace(profile.grid, prefill_tokens=(32, 128))
    with_line = dataclasses.replace(profile, grid=grid, prefill=line)
    loaded = CalibrationProfile.load(with_line.save(tmp_path / "p.json"))
    assert loaded == with_line and loaded.grid.prefill_tokens == (32, 128)
    # A profile written before the prefill line: no such field, no grid entry.
    data = profile.to_json()
    del data["prefill"], data["grid"]["prefill_tokens"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = CalibrationProfile.load(tmp_path / "old.json")
    assert old.prefill is None and old.grid.prefill_tokens == ()


def _corrupt(data: dict, change) -> dict:
    data = json.loads(json.dumps(data))
    change(data)
    return data


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(format="sgl-ecospec-predictor/1"), "not an sgl-ecospec calibration"),
        (lambda d: d.pop("params"), "corrupt: missing field 'params'"),
        (lambda d: d["params"].update(k2=-1.0), "corrupt: MoESDParams.k2 must be finite and >= 0"),
        (lambda d: d["params"].pop("lam"), "corrupt: params must have exactly"),
        (lambda d: d["model"].update(top_k=0), "corrupt: testbed-small: top_k must be"),
        (lambda d: d.update(points=[]), "corrupt: no timed points"),
        (lambda d: d["points"][0].update(seconds=0), "corrupt: TimingPoint.seconds must be > 0"),
        (lambda d: d["grid"].update(repeats=0), "corrupt: repeats must be"),
        (lambda d: d.update(fixed=["k9"]), r"corrupt: fixed names unknown parameters \['k9'\]"),
        (
            lambda d: d.update(
                prefill={"tokens": [8], "seconds": [0.0], "base": 0, "per_token": 0}
            ),
            "corrupt: prefill points need tokens >= 1 and seconds > 0",
        ),
    ],
)
def test_profile_file_errors_name_the_problem(profile, tmp_path, change, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_corrupt(profile.to_json(), change)))
    with pytest.raises(CalibrationFileError, match=message) as info:
        CalibrationProfile.load(path)
    assert "sgl-ecospec calibrate --out FILE" in str(info.value)


def test_profile_file_missing_or_not_json(tmp_path):
    with pytest.raises(CalibrationFileError, match="no such file"):
        CalibrationProfile.load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CalibrationFileError, match="is not a JSON file"):
        CalibrationProfile.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(CalibrationFileError, match="format tag None"):
        CalibrationProfile.load(bad)


def test_measure_hardware_on_the_cpu():
    hardware = measure_hardware(torch.device("cpu"), torch.float32, "cpu")
    # Any machine this runs on copies faster than 100 MB/s and multiplies faster than
    # 100 MFLOP/s; the fp32 peak is set (the testbed runs in float32 here).
    assert hardware.memory_bandwidth > 1e8 and hardware.peak_fp32_flops > 1e8
    assert hardware.peak_flops("fp32") == hardware.peak_fp32_flops
