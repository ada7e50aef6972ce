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


def stub_eagle_worker(monkeypatch, events):
    """SGLang's EAGLEWorkerV2 reduced to what EcoSpecWorker reads and calls (topk 2, 3 steps,
    4 draft tokens, no draft model), its pool allocation logged in ``events``; at most 4
    running requests (SGLang's bound: 5 request rows with the reserved slot 0)."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang_ecospec import deployment, ep_placement, memory

    def init(self, server_args, gpu_id, nccl_port, target_worker):
        self.topk, self.speculative_num_steps, self.speculative_num_draft_tokens = 2, 3, 4
        self.device, self._target_worker = "cpu", target_worker
        self._draft_worker = SimpleNamespace(
            parallel_layout=None, _draft_extend_for_prefill=lambda *args, **kwargs: None
        )

    def alloc(self, memory_pool_config=None, req_to_token_pool=None, **kwargs):
        events.append("draft KV pool")

    monkeypatch.setattr(EAGLEWorkerV2, "__init__", init)
    monkeypatch.setattr(EAGLEWorkerV2, "alloc_memory_pool", alloc)
    monkeypatch.setattr(EAGLEWorkerV2, "init_hicache_draft_plan", lambda self: None)
    monkeypatch.setattr(EAGLEWorkerV2, "preloaded_weights_bytes", 0)
    monkeypatch.setattr(deployment, "check_startup", lambda server_args: None)
    monkeypatch.setattr(ep_placement, "sglang_layout", ep_placement.EPLayout)
    monkeypatch.setattr(memory, "max_batch_bound", lambda: 5)


def test_runtime_is_built_and_reserved_before_sglang_sizes_the_kv_pool(monkeypatch, caplog):
    """Finding 7: SGLang's own Scheduler.init_model_worker (model loading, graphs stubbed)
    creates the ECOSPEC worker, then sizes the target KV pool from the free memory: by then
    the runtime's tensors exist and its per-step memory is reserved; the reservation is freed
    once the pools are allocated, before any graph is captured. Then the worker counts, on
    the device, a verify forward in which some MoE layer's routing was not captured, and
    leaves the utility gate's narrow verifies uncounted."""
    import logging
    from types import MethodType

    import torch
    from sglang.srt.managers import scheduler as scheduler_module
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_ecospec import algorithm, routing
    from transformers import Qwen2MoeConfig

    events = []
    stub_eagle_worker(monkeypatch, events)
    monkeypatch.setattr(
        scheduler_module, "get_model", lambda: SimpleNamespace(is_startup_weight_load_overlap=0)
    )
    monkeypatch.setattr(scheduler_module, "get_device", lambda: SimpleNamespace(gpu_id=0))
    monkeypatch.setattr(
        scheduler_module.kv_cache_builder, "resolve_decode_retraction_backup", lambda **k: None
    )
    algorithm.register_algorithm()

    class GraphsNext(Exception):
        """Raised where SGLang goes on to attention backends and CUDA graphs."""

    def stop():
        raise GraphsNext

    def size_target_kv_pool(draft_parallel_layout=None):
        worker = scheduler.draft_worker  # SGLang's _profile_available_bytes measures now
        events.append(
            ("target KV pool", worker.ecospec is not None, worker.ecospec_reservation.held)
        )

    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    runner = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config),
        model=None,
        memory_pool_config=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        account_preloaded_weights=lambda nbytes: None,
    )
    scheduler = SimpleNamespace(
        spec_algorithm=SpeculativeAlgorithm.from_string("ECOSPEC"),
        server_args=SimpleNamespace(disable_overlap_schedule=False),
        nccl_port=0,
        enable_unified_memory=False,
        tp_worker=SimpleNamespace(
            model_runner=runner,
            preloaded_weights_bytes=0,
            alloc_memory_pool=size_target_kv_pool,
            get_memory_pool=lambda: (None, None),
        ),
        init_tp_model_worker=lambda: events.append("target loaded"),
        init_all_attention_backends=stop,
    )
    for name in ("maybe_init_draft_worker", "init_memory_pools", "init_target_memory_pool"):
        setattr(scheduler, name, MethodType(getattr(Scheduler, name), scheduler))
    with caplog.at_level(logging.INFO, logger=algorithm.__name__), pytest.raises(GraphsNext):
        Scheduler.init_model_worker(scheduler)
    worker = scheduler.draft_worker
    try:
        assert events == ["target loaded", ("target KV pool", True, True), "draft KV pool"]
        assert not worker.ecospec_reservation.held and worker.ecospec.selector.max_batch == 5
        (line,) = [r.getMessage() for r in caplog.records if "ECOSPEC reserves" in r.getMessage()]
        usage = worker.ecospec.memory
        assert f"ECOSPEC reserves {usage.total / 2**20:.1f} MiB: predictor" in line
        assert "buffers" in line and "per-step temporaries" in line
        assert "before the KV pool is sized" in line

        captured_layers = []

        def sglang_verify(self, batch):
            for layer in captured_layers:
                capture_config = SimpleNamespace(allow_routed_experts_capture=True)
                routing.after_capture(None, capture_config, layer, torch.zeros(4, 2).long())
            return "verified"

        monkeypatch.setattr(EAGLEWorkerV2, "verify", sglang_verify)
        batch = SimpleNamespace(spec_info=SimpleNamespace(draft_token=torch.arange(4)))
        for layers in ([0, 1], [1], [0, 1]):
            captured_layers[:] = layers
            assert worker.verify(batch) == "verified"
        # An idle verify (no tokens) is not a verify step.
        captured_layers[:] = []
        worker.verify(SimpleNamespace(spec_info=SimpleNamespace(draft_token=torch.empty(0))))
        # Nor is one of the gate's narrow level (2 draft tokens: SGLang's own chain).
        configured = worker.speculative_num_draft_tokens
        assert configured == worker.ecospec.selector.num_draft_tokens != 2
        worker.speculative_num_draft_tokens = 2
        captured_layers[:] = [0, 1]
        assert worker.verify(batch) == "verified"
        worker.speculative_num_draft_tokens = configured
        summary = worker.ecospec.decode_log_window.read()
        assert summary["verify_steps"] == 3 and summary["capture_missed_steps"] == 1
    finally:
        worker.ecospec.close()


def test_plain_decoding_steps_verify_one_node_as_a_chain(monkeypatch):
    """The gate's plain steps (0 draft steps) verify one node per request: SGLang runs them as
    for topk 1 (no compaction of the accepted path, which is a KV move over every layer), and
    the worker's topk is back afterwards; speculative steps keep the configured topk."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang_ecospec import algorithm

    seen = []

    def verify(self, batch, *args, **kwargs):
        seen.append(self.topk)
        if batch.fails:
            raise RuntimeError("verify failed")
        return "verified"

    monkeypatch.setattr(EAGLEWorkerV2, "verify", verify)
    worker = object.__new__(algorithm.worker_class())
    worker.topk, worker.ecospec = 4, None
    worker.speculative_num_steps = 0
    batch = SimpleNamespace(spec_info=None, req_pool_indices=None, fails=False)
    assert worker.verify(batch) == "verified" and seen == [1] and worker.topk == 4
    with pytest.raises(RuntimeError, match="verify failed"):
        worker.verify(SimpleNamespace(spec_info=None, req_pool_indices=None, fails=True))
    assert worker.topk == 4
    worker.speculative_num_steps = 3
    assert worker.verify(batch) == "verified" and seen[-1] == 4
