"""What the server adds to each step over the calibrated forward (``bench_serving
--server-step``): measured from a plain server's run, priced into every step."""

import json
from pathlib import Path

import pytest

from sgl_ecospec.costmodel import get_hardware, get_model
from sgl_ecospec.costmodel.performance import MoESDParams, PerformanceModel
from sgl_ecospec.lab.serving import bench_serving, predicted
from sgl_ecospec.lab.serving.server_step import ServerStep

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "docs" / "results" / "cpu" / "2026-12-04-bandwidth-calibration.json"


def _phase(algorithm, concurrency, tpot, accept=None):
    return {
        "algorithm": algorithm,
        "concurrency": concurrency,
        "mean_tpot_ms": tpot,
        "accept_length": accept,
        "experts_per_layer_step": None,
        "mean_input_len": 50.0,
    }


def _pricing():
    params = MoESDParams(  # no compute terms: each step is bias + k2 x experts
        bias=0.1, k1=0.0, k2=0.001, k3=0.0, lam=1.0, s=1.0,
        draft_bias=0.01, draft_k=0.0, reject_bias=0.002, reject_k=0.0,
    )  # fmt: skip
    perf = PerformanceModel(get_model("qwen3-30b-a3b"), get_hardware("h200"), params)
    return predicted.Pricing(perf)


def _write_run(path, cfg, runs):
    path.write_text(json.dumps({"config": cfg, "runs": runs}))
    return str(path)


def test_figures_are_the_plain_servers_measured_step_over_the_forwards(tmp_path):
    pricing = _pricing()
    cfg = {"num_prompts": 4, "num_steps": 3, "num_draft_tokens": 5, "output_len": 10}
    ar = {b: 1000 * float(pricing.perf.ar_time(b)) for b in (1, 4)}
    runs = [
        _phase("none", 4, ar[4] + 30.0),  # one wave: the TPOT is the step
        _phase("eagle3", 4, 500.0, accept=2.0),  # not a plain server's: ignored
        _phase("none", 8, ar[4] + 50.0),  # concurrency 8 of 4 prompts: batch 4 again
        _phase("none", 1, None),  # no TPOT measured: ignored
    ]
    path = _write_run(tmp_path / "plain.json", cfg, runs)
    step = ServerStep.from_run(
        path, lambda record, c: predicted.predicted_tpot_ms(record, c, pricing)
    )
    assert step.batch_sizes == (4,)
    assert step.seconds == pytest.approx((0.040,))  # the median of 30 and 50 ms
    assert step.source == path
    # A phase with prefills between its steps: they are the forward's, not the server's.
    stall = predicted.predicted_tpot_ms(_phase("none", 2, 1.0), cfg, pricing) - 1000 * float(
        pricing.perf.ar_time(2)
    )
    assert stall > 0
    runs[3] = _phase("none", 2, 1000 * float(pricing.perf.ar_time(2)) + stall - 5.0)
    _write_run(tmp_path / "plain.json", cfg, runs)
    step = ServerStep.from_run(
        path, lambda record, c: predicted.predicted_tpot_ms(record, c, pricing)
    )
    assert step.batch_sizes == (2, 4)
    assert step.seconds == pytest.approx((-0.005, 0.040))
    # Linear between the measured batch sizes, the nearest figure outside them.
    assert step.at(3) == pytest.approx(0.0175)
    assert step.at(1) == pytest.approx(-0.005) and step.at(16) == pytest.approx(0.040)


def test_every_priced_step_costs_the_servers_figure_at_its_batch_size():
    pricing = _pricing()._replace(server_step=ServerStep((1, 4), (0.010, 0.040), "run.json"))
    forward = _pricing()
    cfg = {"num_prompts": 4, "num_steps": 3, "num_draft_tokens": 5, "output_len": 10}
    plain = _phase("none", 4, 100.0)
    assert predicted.predicted_tpot_ms(plain, cfg, pricing) == pytest.approx(
        predicted.predicted_tpot_ms(plain, cfg, forward) + 40.0
    )
    # A speculative step makes 2 tokens per request: the figure is spread over both.
    spec = _phase("eagle3", 4, 100.0, accept=2.0)
    assert predicted.predicted_tpot_ms(spec, cfg, pricing) == pytest.approx(
        predicted.predicted_tpot_ms(spec, cfg, forward) + 20.0
    )
    # Concurrency 2 of 4 prompts: batch 2, between the measured 1 and 4.
    two = _phase("none", 2, 100.0)
    assert predicted.predicted_tpot_ms(two, cfg, pricing) == pytest.approx(
        predicted.predicted_tpot_ms(two, cfg, forward) + 20.0
    )
    assert "B=1 +10.0 ms, B=4 +40.0 ms" in predicted.describe(pricing)


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "not a bench_serving run"),
        ('{"runs": []}', "not a bench_serving run"),
        ('{"config": {"num_prompts": 4}, "runs": []}', "no phase of the plain server"),
        ('{"config": {}, "runs": [{"algorithm": "none", "mean_tpot_ms": 5}]}', "not a bench"),
    ],
)
def test_a_run_without_plain_phases_is_refused_with_how_to_write_one(tmp_path, content, message):
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        ServerStep.from_run(str(path), lambda record, cfg: 1.0)
    assert "--algorithms none" in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ValueError, match="no such file|not a bench_serving run"):
        ServerStep.from_run(str(tmp_path / "missing.json"), lambda record, cfg: 1.0)


def test_bad_figures_are_refused():
    with pytest.raises(ValueError, match="one figure per batch size"):
        ServerStep((1, 2), (0.1,), "x")
    with pytest.raises(ValueError, match="ascending, distinct"):
        ServerStep((4, 2), (0.1, 0.2), "x")


def test_predict_from_prices_with_the_servers_step(tmp_path, capsys):
    cfg = {"num_prompts": 1, "num_steps": 3, "num_draft_tokens": 5, "output_len": 32}
    plain = _write_run(tmp_path / "plain.json", cfg, [_phase("none", 1, 190.8)])
    checked = _write_run(
        tmp_path / "run.json",
        cfg,
        [_phase("none", 1, 200.0), _phase("eagle3", 1, 230.4, accept=1.817)],
    )
    args = ["--predict-from", checked, "--profile", str(PROFILE)]
    assert bench_serving.main(args) == 0
    before = capsys.readouterr().out.splitlines()
    assert bench_serving.main([*args, "--server-step", plain]) == 0
    after = capsys.readouterr().out.splitlines()
    # The profile's plain step at batch 1 is 170.8 ms: the plain run measured 20.0 ms more.
    assert before[2].split()[-2] == "170.8" and after[2].split()[-2] == "190.8"
    assert "B=1 +20.0 ms" in after[0]
    eagle3 = float(before[3].split()[-2]), float(after[3].split()[-2])
    assert eagle3[1] == pytest.approx(eagle3[0] + 20.0 / 1.817, abs=0.1)
    assert bench_serving.main(["--predict-from", checked, "--profile", str(PROFILE),
                               "--server-step", str(tmp_path / "none.json")]) == 2  # fmt: skip
    assert "--server-step" in capsys.readouterr().err
    assert bench_serving.main(["--server-step", plain]) == 2
    assert "--server-step needs --profile" in capsys.readouterr().err
