"""Calibration at startup (setting ``calibrate``): the cache key, reuse without a second
child, the ranks (one calibrates per node, the others wait), the child's failure falling
back to the prior with a warning, the runtime's eps table from either, and one real child on
the small testbed."""

import fcntl
import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from sglang_ecospec import eps_table, startup_calibration
from sglang_ecospec.settings import EcoSpecSettings
from sglang_ecospec.startup_calibration import (
    CalibrationFailed,
    ChildResult,
    ServedModel,
)

from sgl_ecospec.costmodel import TimingPoint, get_model
from sgl_ecospec.costmodel.calibration import CalibrationGrid, CalibrationProfile, calibrate
from sgl_ecospec.costmodel.profiles import HardwareProfile

QWEN3_30B = get_model("qwen3-30b-a3b")  # 48 MoE layers x 128 experts, top-8
SERVED = {"moe_layers": 48, "num_experts": 128, "top_k": 8}
LOGGER = "sglang_ecospec.startup_calibration"


@pytest.fixture(scope="module")
def fitted() -> CalibrationProfile:
    """A calibration profile of Qwen3-30B-A3B on a made-up device (what the fake child
    writes)."""
    grid = CalibrationGrid((1, 4), (1, 4), (8, 32), repeats=1)
    points = []
    for batch, tokens, unique in grid.target_points(128, 8):
        seconds = 4e-3 + 2e-6 * batch * tokens + 30e-6 * unique
        points.append(
            TimingPoint("ar" if tokens == 1 else "verify", batch, tokens, seconds, unique)
        )
    device = HardwareProfile("measured test", 3.0e12, 600e12, 600e12)
    return calibrate(points, QWEN3_30B, device, device="test gpu", dtype="bfloat16", grid=grid)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGL_ECOSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration"


@pytest.fixture
def served(tmp_path) -> ServedModel:
    """A served model directory holding only its config (the fake child reads nothing)."""
    target = tmp_path / "Qwen3-30B-A3B"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_experts": 128}))
    return ServedModel(str(target), None, torch.bfloat16, torch.device("cpu"))


def fake_child(profile: CalibrationProfile | None, calls: list, returncode=0, stderr=""):
    """A ``run_child`` that records its argv and writes ``profile`` to its --out file."""

    def run(argv, timeout):
        calls.append(argv)
        if profile is not None:
            profile.save(argv[argv.index("--out") + 1])
        return ChildResult(returncode, "calibration: fit table\nresiduals: rms 1.0%", stderr)

    return run


def on(**fields) -> EcoSpecSettings:
    return EcoSpecSettings(eps="auto", calibrate=True, **fields)


def test_the_cache_file_is_keyed_by_model_device_dtype_and_grid(served, cache):
    path = startup_calibration.cache_file(served, on())
    assert path.parent == cache and path.name.startswith("qwen3-30b-a3b-cpu-")
    assert startup_calibration.cache_file(served, on()) == path  # the same start again
    others = [
        startup_calibration.cache_file(served, on(calibrate_batch_sizes="1,2")),
        startup_calibration.cache_file(
            ServedModel(served.model_path, None, torch.float32, served.device), on()
        ),
        startup_calibration.cache_file(
            ServedModel(served.model_path, served.model_path, served.dtype, served.device), on()
        ),
    ]
    Path(served.model_path, "config.json").write_text("{}")
    others.append(startup_calibration.cache_file(served, on()))  # config.json changed
    assert len({path, *others}) == 5
    with pytest.raises(CalibrationFailed, match="no local checkpoint directory"):
        startup_calibration.cache_file(
            ServedModel("Qwen/Qwen3-30B-A3B", None, torch.bfloat16, served.device), on()
        )


def test_the_served_model_comes_from_sglangs_server_arguments():
    from types import SimpleNamespace

    args = SimpleNamespace(model_path="/m", speculative_draft_model_path="/d")
    served = ServedModel.from_server(args, torch.bfloat16, "cpu")
    assert served == ServedModel("/m", "/d", torch.bfloat16, torch.device("cpu"))


def test_the_child_is_the_calibrate_command_on_the_served_model(served, tmp_path):
    settings = on(
        calibrate_batch_sizes="1, 2",
        calibrate_tokens="1,2",
        calibrate_unique_experts="8",
        calibrate_repeats=1,
    )
    argv = startup_calibration.calibrate_command(served, settings, tmp_path / "out.json")
    assert argv[1:3] == ["-m", "sglang_ecospec.calibration_child"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags == {
        "--target": served.model_path,
        "--draft": "none",
        "--device": "cpu",
        "--dtype": "bfloat16",
        "--threads": str(torch.get_num_threads()),
        "--prefill-tokens": "none",  # the server prices no prefill
        "--batch-sizes": "1,2",
        "--tokens": "1,2",
        "--unique-experts": "8",
        "--repeats": "1",
        "--out": str(tmp_path / "out.json"),
    }
    half = ServedModel(served.model_path, None, torch.float16, served.device)
    assert "bfloat16" in startup_calibration.calibrate_command(half, on(), tmp_path / "o")
    double = ServedModel(served.model_path, None, torch.float64, served.device)
    with pytest.raises(CalibrationFailed, match="dtype torch.float64 is none the calibrator"):
        startup_calibration.calibrate_command(double, on(), tmp_path / "o")


def test_a_second_start_reuses_the_profile_without_a_child(
    served, cache, fitted, monkeypatch, caplog
):
    calls = []
    monkeypatch.setattr(startup_calibration, "run_child", fake_child(fitted, calls))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        profile, hardware = startup_calibration.cost_profile(on(), served)
    assert hardware is None and len(calls) == 1
    assert profile == str(startup_calibration.cache_file(served, on()))
    assert sorted(p.name for p in cache.iterdir()) == [
        f"{startup_calibration.cache_file(served, on()).stem}.{suffix}"
        for suffix in ("json", "lock")
    ]  # the child's partial file moved into place
    assert "calibrating the cost model of" in caplog.text and "on cpu" in caplog.text
    assert "calibrated the cost model on cpu" in caplog.text and "residual rms" in caplog.text
    assert "ECOSPEC calibration fit:\ncalibration: fit table" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = startup_calibration.cost_profile(on(), served)
        table = eps_table.cost_model_eps_table(
            again[0], again[1], verify_tokens=8, max_batch=4, **SERVED
        )
    assert again == (profile, None) and len(calls) == 1
    assert f"reusing calibrated profile {profile} (qwen3-30b-a3b (bfloat16)" in caplog.text
    assert f"ECOSPEC cost model: calibrated profile {profile}" in caplog.text
    assert table.batches == (1, 2, 4)


@pytest.mark.parametrize(
    "returncode, ended",
    [(2, "exited with status 2 after"), (None, r"was stopped after 1800 s \(calibrate_timeout\)")],
)
def test_a_failed_child_falls_back_to_the_prior_with_a_warning(
    served, cache, monkeypatch, caplog, returncode, ended
):
    calls = []
    stderr = "\n".join(f"line {i}" for i in range(30)) + "\nValueError: no MoE router"
    monkeypatch.setattr(
        startup_calibration, "run_child", fake_child(None, calls, returncode, stderr)
    )
    settings = on(profile="qwen3-30b-a3b", hardware="h200")
    with caplog.at_level(logging.INFO):
        profile, hardware = startup_calibration.cost_profile(settings, served)
        eps_table.cost_model_eps_table(profile, hardware, verify_tokens=8, max_batch=4, **SERVED)
    assert (profile, hardware) == ("qwen3-30b-a3b", "h200")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert re.search(f"the calibration child {ended}", warnings[0])
    assert "line 16" in warnings[0] and "line 15" not in warnings[0]  # the last 15 lines
    assert "ValueError: no MoE router" in warnings[0]
    assert "falls back to the prior (qwen3-30b-a3b on h200)" in warnings[0]
    assert f"sgl-ecospec calibrate --target {served.model_path} --draft none" in warnings[0]
    assert "SGLANG_ECOSPEC_PROFILE=FILE and SGLANG_ECOSPEC_CALIBRATE=off" in warnings[0]
    assert "ECOSPEC cost model: prior (fallback; no calibrated profile)" in caplog.text
    assert not list(cache.glob("*.json")) and not list(cache.glob("*.tmp"))
    # The next start tries again: a failure of an earlier start is no answer.
    startup_calibration.cost_profile(settings, served)
    assert len(calls) == 2


def test_a_failure_without_a_prior_stops_the_start_saying_what_to_do(served, cache, monkeypatch):
    monkeypatch.setattr(startup_calibration, "run_child", fake_child(None, [], 1, "boom"))
    with pytest.raises(ValueError, match="(?s)no fallback prior is set: .*boom") as info:
        startup_calibration.cost_profile(on(), served)
    assert "SGLANG_ECOSPEC_PROFILE=FILE" in str(info.value)
    assert "SGLANG_ECOSPEC_HARDWARE" in str(info.value)


class FakeGroup:
    """What leads_calibration reads of SGLang's GroupCoordinator."""

    def __init__(self, rank, world_size):
        self.rank_in_group, self.world_size, self.cpu_group = rank, world_size, None


def test_the_lowest_rank_on_each_host_leads(monkeypatch):
    hosts = ["node-a", "node-a", "node-b", "node-b"]

    def all_gather_object(out, mine, group):
        out[:] = hosts

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    leads = []
    for rank in range(4):
        monkeypatch.setattr(startup_calibration.socket, "gethostname", lambda r=rank: hosts[r])
        leads.append(startup_calibration.leads_calibration(FakeGroup(rank, 4)))
    assert leads == [True, False, True, False]
    assert startup_calibration.leads_calibration(None)


def test_a_waiting_rank_takes_the_leaders_profile_or_its_failure(
    served, cache, fitted, monkeypatch
):
    monkeypatch.setattr(startup_calibration, "leads_calibration", lambda group: False)
    monkeypatch.setattr(startup_calibration, "POLL_SECONDS", 0.05)
    path = startup_calibration.cache_file(served, on())
    cache.mkdir(parents=True)
    failed = path.with_suffix(".failed")
    failed.write_text(json.dumps({"time": 0.0, "error": "an earlier start's"}))  # ignored
    writer = threading.Timer(0.3, fitted.save, [path])
    writer.start()
    assert startup_calibration.calibrated_profile(on(), served) == path
    writer.join()
    path.unlink()
    writer = threading.Timer(
        0.3, lambda: failed.write_text(json.dumps({"time": time.time(), "error": "OOM"}))
    )
    writer.start()
    with pytest.raises(CalibrationFailed, match="calibrating rank failed: OOM"):
        startup_calibration.calibrated_profile(on(), served)
    writer.join()
    monkeypatch.setattr(startup_calibration, "WAIT_MARGIN_SECONDS", 0.0)
    with pytest.raises(CalibrationFailed, match="after 0 s of waiting"):
        startup_calibration.calibrated_profile(on(calibrate_timeout=0.1), served)


def test_a_second_process_waits_for_the_lock_and_finds_the_profile(
    served, cache, fitted, monkeypatch
):
    calls = []
    monkeypatch.setattr(startup_calibration, "run_child", fake_child(fitted, calls))
    monkeypatch.setattr(startup_calibration, "POLL_SECONDS", 0.05)
    path = startup_calibration.cache_file(served, on())
    cache.mkdir(parents=True)
    with open(path.with_suffix(".lock"), "a") as held:  # another process calibrating
        fcntl.flock(held, fcntl.LOCK_EX)
        result = []
        waiter = threading.Thread(
            target=lambda: result.append(startup_calibration.calibrated_profile(on(), served))
        )
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive()
        fitted.save(path)
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(5)
    assert result == [path] and calls == []


def test_the_runtime_prices_with_the_calibrated_model_or_the_fallback(
    served, cache, fitted, monkeypatch
):
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8)

    def eps(settings):
        runtime = EcoSpecRuntime(
            settings,
            config,
            topk=4,
            num_draft_tokens=6,
            max_batch=4,
            device="cpu",
            served_model=served,
        )
        runtime.close()
        return runtime.selector.eps_table.eps

    fields = {"num_buckets": 64, "log_interval": 0}
    monkeypatch.setattr(startup_calibration, "run_child", fake_child(None, [], 1, "boom"))
    prior = eps(on(profile="qwen3-30b-a3b", hardware="h200", **fields))
    assert prior == eps(EcoSpecSettings(eps="auto", profile="qwen3-30b-a3b", hardware="h200"))
    monkeypatch.setattr(startup_calibration, "run_child", fake_child(fitted, []))
    calibrated = eps(on(profile="qwen3-30b-a3b", hardware="h200", **fields))
    path = startup_calibration.cache_file(served, on())
    assert calibrated == eps(EcoSpecSettings(eps="auto", profile=str(path), **fields))
    assert calibrated != prior
    with pytest.raises(ValueError, match="calibrate needs the served model"):
        EcoSpecRuntime(on(), config, topk=4, num_draft_tokens=6, max_batch=4, device="cpu")


@pytest.mark.slow  # builds the small testbed when it is not cached (minutes); else ~15 s
def test_a_real_child_calibrates_the_small_testbed(tmp_path, monkeypatch, caplog):
    from sgl_ecospec.lab.config import testbed_models

    target, draft = testbed_models(small=True)  # from the lab's cache, before it moves
    cache = tmp_path / "calibration"
    monkeypatch.setenv("SGL_ECOSPEC_CACHE", str(tmp_path))
    served = ServedModel(target, draft, torch.float32, torch.device("cpu"))
    settings = on(
        calibrate_batch_sizes="1,2",
        calibrate_tokens="1,2",
        calibrate_unique_experts="8,16",
        calibrate_repeats=1,
    )
    started = time.perf_counter()
    with caplog.at_level(logging.INFO):
        profile, hardware = startup_calibration.cost_profile(settings, served)
        seconds = time.perf_counter() - started
        table = eps_table.cost_model_eps_table(
            profile, hardware, moe_layers=8, num_experts=64, top_k=8, verify_tokens=6, max_batch=2
        )
    print(f"real startup calibration of the small testbed: {seconds:.1f} s")
    assert hardware is None and profile.startswith(str(cache))
    loaded = CalibrationProfile.load(profile)
    assert loaded.model.moe_layers == 8 and loaded.fixed == ()  # draft timed too
    assert loaded.grid.batch_sizes == (1, 2) and loaded.grid.repeats == 1
    assert "calibrated the cost model on cpu" in caplog.text
    assert "ECOSPEC calibration fit:\ncalibration: " in caplog.text
    assert table.batches == (1, 2) and all(e > 0 for e in table.eps)
