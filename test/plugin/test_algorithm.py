"""ECOSPEC's registration with SGLang: the entry point, the algorithm, the launcher's checks,
and the cost model's adaptive config as SGLang reads it."""

import json
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest


def test_entry_point_is_installed():
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("ecospec") == "sglang_ecospec:register"


def test_ecospec_is_a_registered_eagle3_like_algorithm():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_ecospec import algorithm

    algorithm.register_algorithm()
    algorithm.register_algorithm()  # idempotent
    algo = SpeculativeAlgorithm.from_string("ecospec")
    assert isinstance(algo, algorithm.EcoSpecAlgo) and algo.name == "ECOSPEC"
    eagle3 = SpeculativeAlgorithm.EAGLE3
    for method in [
        name for name in vars(SpeculativeAlgorithm) if name.startswith(("is_", "supports_"))
    ] + [
        "need_topk",
        "carries_draft_hidden_states",
        "has_draft_kv",
    ]:
        assert getattr(algo, method)() == getattr(eagle3, method)(), method


def test_validate_server_args_reports_bad_settings(monkeypatch):
    from sglang_ecospec import algorithm

    args = SimpleNamespace(speculative_draft_model_path="/d", speculative_eagle_topk=4, ep_size=8)
    algorithm.validate_server_args(args)
    monkeypatch.setenv("SGLANG_ECOSPEC_EPS", "-1")
    with pytest.raises(ValueError, match="ECOSPEC: eps must be"):
        algorithm.validate_server_args(args)
    monkeypatch.setenv("SGLANG_ECOSPEC_EPS", "auto")
    monkeypatch.setenv("SGLANG_ECOSPEC_PROFILE", "qwen3-235b-a22b")
    monkeypatch.setenv("SGLANG_ECOSPEC_HARDWARE", "h200")
    with pytest.raises(ValueError, match="HARDWARE: .*EP group of 8 ranks"):
        algorithm.validate_server_args(args)
    monkeypatch.setenv("SGLANG_ECOSPEC_HARDWARE", "8xh200")
    algorithm.validate_server_args(args)
    for name in ("EPS", "PROFILE", "HARDWARE"):
        monkeypatch.delenv(f"SGLANG_ECOSPEC_{name}")
    with pytest.raises(ValueError, match="speculative-draft-model-path"):
        algorithm.validate_server_args(
            SimpleNamespace(speculative_draft_model_path=None, speculative_eagle_topk=4, ep_size=1)
        )


def test_costmodel_adaptive_config_loads_in_sglang(tmp_path, capsys):
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    from sgl_ecospec.costmodel import (
        PerformanceModel,
        adaptive_draft_steps,
        analytic_params,
        get_hardware,
        get_model,
    )
    from sgl_ecospec.lab import cli

    config, report = tmp_path / "adaptive.json", tmp_path / "report.json"
    argv = ["costmodel", "--batch", "1,16,128", "--gamma", "2", "--accept-rate", "0.8"]
    argv += ["--adaptive-config", str(config), "--max-draft-steps", "5", "--json", str(report)]
    assert cli.main(argv) == 0
    model, hardware = get_model("qwen3-235b-a22b"), get_hardware("h200")
    perf = PerformanceModel(model, hardware, analytic_params(model, hardware).params)
    steps = adaptive_draft_steps(perf, [1, 16, 128], 0.8, 5)
    buckets = json.loads(report.read_text())["adaptive"]["buckets"]
    assert [(b["batch"], b["draft_steps"], b["num_draft_tokens"]) for b in buckets] == [
        (batch, k, k + 1) for batch, k in sorted(steps.items())
    ]
    out = capsys.readouterr().out
    for batch, k in steps.items():
        assert f"{batch:>6d} {k:>12d} {k + 1:>17d}" in out
    params = AdaptiveSpeculativeParams(initial_steps=0, cfg_path=str(config))
    for batch, k in steps.items():  # SGLang routes each bucket to its own candidate steps
        assert params._route(batch).candidate_steps == list(range(k + 1))
    assert cli.main(["costmodel", "--adaptive-config", str(config), "--max-draft-steps", "0"]) == 2
    assert "--max-draft-steps must be an int >= 1" in capsys.readouterr().err


def test_worker_counts_verify_steps_whose_routing_was_not_captured(monkeypatch):
    """The worker clears the capture flags before SGLang's verify and counts, on the device,
    a verify forward in which some MoE layer's routing was not captured."""
    import torch
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang_ecospec import algorithm, routing

    capture = routing.RoutingCapture([0, 1], top_k=1, max_tokens=4, device="cpu")
    captured_layers = []

    def sglang_verify(self, batch):
        for layer in captured_layers:
            capture.capture(layer, torch.zeros(4, 1, dtype=torch.long))
        return "verified"

    monkeypatch.setattr(EAGLEWorkerV2, "verify", sglang_verify)
    worker = algorithm.worker_class().__new__(algorithm.worker_class())
    learnt = []
    worker.ecospec = SimpleNamespace(
        capture=capture, stats=routing.VerifyStats(8, "cpu"), after_verify=learnt.append
    )
    batch = SimpleNamespace(spec_info=SimpleNamespace(draft_token=torch.arange(4)))
    for layers in ([0, 1], [1], [0, 1]):
        captured_layers[:] = layers
        assert worker.verify(batch) == "verified"
    assert worker.ecospec.stats.totals[2].item() == 1 and len(learnt) == 3
    # An idle verify (no tokens) is not a missed capture.
    captured_layers[:] = []
    worker.verify(SimpleNamespace(spec_info=SimpleNamespace(draft_token=torch.empty(0))))
    assert worker.ecospec.stats.totals[2].item() == 1
