"""The utility gate in the server: SGLang's adaptive-controller protocol over the gate (step
counts 0, 1 and S), the pairing of timed steps with their results, the per-bucket metrics and
log line, the layouts it refuses, its settings, and two gloo ranks running rank 0's level."""

import logging
import multiprocessing
import os
import socket
import traceback
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry
from sglang_ecospec import gate as plugin_gate
from sglang_ecospec.settings import EcoSpecSettings, EcoSpecSettingsError

from sgl_ecospec.gate import GateOptions
from sgl_ecospec.gate_state import BucketState, LevelFigures

OPTIONS = GateOptions(probe_interval=30, max_probe_interval=30, probe_steps=3, min_samples=3)


def run_levels(policy, steps, batch_size, figures):
    """Drives ``policy`` as SGLang's worker and scheduler do: steps, then their results
    (one step behind, as with the overlap scheduler); ``figures`` maps a step count to its
    (seconds, accepted drafts per request). Returns the step counts chosen."""
    chosen, results = [], []
    for _ in range(steps):
        num_steps = policy.get_steps_for_batch(batch_size)
        chosen.append(num_steps)
        seconds, accepted = figures[num_steps]
        policy._pending.append((batch_size, policy._level, seconds, policy._stale))  # CPU timer
        results.append([accepted] * batch_size)
        if len(results) > 1:
            policy.on_verify_complete(results.pop(0), batch_size)
    for result in results:
        policy.on_verify_complete(result, batch_size)
    return chosen


def run_steps(policy, steps, batch_size, spec_seconds, plain_seconds, accepted):
    """:func:`run_levels` with every speculative level alike."""
    figures = {level: (spec_seconds, accepted) for level in policy.levels}
    figures[0] = (plain_seconds, 0)
    return run_levels(policy, steps, batch_size, figures)


def test_policy_speaks_sglangs_adaptive_protocol():
    policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu")
    assert policy.candidate_steps == [0, 3]  # plain decoding, the configured tree
    narrow = plugin_gate.GatePolicy(3, OPTIONS, "cpu", narrow=True)
    assert narrow.candidate_steps == [0, 1, 3]  # and the narrow level
    assert plugin_gate.GatePolicy(1, OPTIONS, "cpu", narrow=True).candidate_steps == [0, 1]
    assert policy.cuda_graph_bs_for_step(0) is None
    policy.set_cuda_graph_bs([1, 2, 4])
    assert policy.get_steps_for_batch(2) == 3
    with pytest.raises(ValueError, match="num-steps"):
        plugin_gate.GatePolicy(0, OPTIONS, "cpu")


def test_policy_turns_speculation_off_where_it_loses(caplog):
    policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu")
    with caplog.at_level(logging.INFO, logger=plugin_gate.__name__):
        # 0.5 accepted drafts per step at 3x the time of a plain step: utility 0.5.
        chosen = run_steps(policy, 120, 1, 0.3, 0.1, accepted=0.5)
    # Results arrive one step late, so speculation runs one step more before the probe.
    assert chosen[:4] == [3, 3, 3, 3] and chosen[4:8] == [0, 0, 0, 0]
    assert chosen[-60:].count(0) >= 50
    state = policy.gate.state(1)
    assert not state.open and state.utility == pytest.approx(0.5)
    assert "batch sizes 1 decode plainly" in caplog.text and "utility 0.50" in caplog.text


def test_policy_runs_the_narrow_level_where_only_it_pays(caplog):
    policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu", narrow=True)
    # The tree: 0.8 accepted drafts at 3x a plain step (utility 0.6); one drafted token: 0.4
    # at 1.1x (utility 1.27).
    figures = {0: (0.1, 0), 1: (0.11, 0.4), 3: (0.3, 0.8)}
    with caplog.at_level(logging.INFO, logger=plugin_gate.__name__):
        chosen = run_levels(policy, 200, 16, figures)
    # The tree first, then the narrow level and plain decoding, two measured steps each at
    # batch size 16 (+1 each: the switch step; results arrive one step late, so each runs one
    # step more before the next).
    assert chosen[:13] == [3] * 3 + [1] * 5 + [0] * 5
    state = policy.gate.state(16)
    assert state.level == 1 and state.utility == pytest.approx(1.4 * 0.1 / 0.11)
    assert chosen[-60:].count(1) >= 44  # the other two probed every 30 steps
    assert "batch sizes 9-16 speculate (1 draft step)" in caplog.text
    assert "3 draft steps 1.80 tokens/request/step at 300.0 ms (utility 0.60)" in caplog.text


def test_the_log_says_what_a_bucket_has_not_measured():
    nan = float("nan")
    state = BucketState(
        level=3,
        plain_time=0.4128,
        speculative=(
            LevelFigures(1, nan, 1.39, nan),  # tokens inherited, step not timed
            LevelFigures(2, 0.5, nan, nan),  # timed by a probe, acceptance not measured
            LevelFigures(3, 0.652, 1.61, 1.02),
        ),
    )
    line = plugin_gate.describe(2, state)
    assert "nan" not in line
    assert (
        "batch sizes 2 speculate (3 draft steps): speculation 1 draft step 1.39 "
        "tokens/request/step, not yet timed here, 2 draft steps at 500.0 ms, utility not yet "
        "measured, 3 draft steps 1.61 tokens/request/step at 652.0 ms (utility 1.02); plain "
        "decoding 412.8 ms/step"
    ) in line
    blank = BucketState(level=0, plain_time=0.4, speculative=(LevelFigures(1, nan, nan, nan),))
    assert "1 draft step not yet measured here;" in plugin_gate.describe(1, blank)


def test_policy_keeps_speculating_where_it_pays():
    policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu")
    chosen = run_steps(policy, 120, 8, 0.12, 0.1, accepted=1.5)  # utility 2.08
    assert policy.gate.state(8).open
    assert chosen[-60:].count(3) >= 50


def test_results_pair_with_their_steps_in_order():
    policy = plugin_gate.GatePolicy(2, OPTIONS, "cpu")
    policy.on_verify_complete([1, 1], 2)  # no step pending: ignored
    policy.get_steps_for_batch(2)
    policy.step_finished(2, policy.step_started())
    policy.step_finished(0, policy.step_started())  # an empty batch is not queued
    assert len(policy._pending) == 1
    policy.on_verify_complete([1, 3], 2)
    assert not policy._pending
    assert policy.gate.state(2).best.tokens == pytest.approx(3.0)


def test_metrics_per_bucket():
    registry = CollectorRegistry()
    policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu")
    run_steps(policy, 40, 1, 0.3, 0.1, accepted=0.5)
    run_steps(policy, 40, 3, 0.1, 0.1, accepted=2.0)
    policy.metrics = plugin_gate.GateMetrics({"model_name": "m"}, registry=registry)
    policy.export(SimpleNamespace(labels={"model_name": "m"}))

    def value(name, sizes):
        labels = {"model_name": "m", "batch_sizes": sizes}
        return registry.get_sample_value(name, labels)

    assert value("sglang:ecospec_gate_open", "1") == 0.0
    assert value("sglang:ecospec_gate_open", "3-4") == 1.0
    assert value("sglang:ecospec_gate_utility", "1") == pytest.approx(0.5)
    # Once exported, a bucket's change reaches its gauge at once, before the next export.
    run_steps(policy, 120, 3, 0.3, 0.1, accepted=0.2)  # speculation now loses at 3-4
    assert not policy.gate.is_open(3)
    assert value("sglang:ecospec_gate_open", "3-4") == 0.0


def test_steps_are_counted_per_level():
    registry = CollectorRegistry()
    policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu", narrow=True)
    kinds = {level: plugin_gate.step_kind(level, 3) for level in policy.levels}
    assert kinds == {0: "plain", 1: "narrow", 3: "tree"}
    assert plugin_gate.step_kind(1, 1) == "tree"  # one configured step is the tree

    def step(level):
        policy._level = level
        policy.step_finished(16, policy.step_started())

    for level in (3, 3, 1, 0, 0, 0):
        step(level)
    step(0)
    policy.step_finished(0, policy.step_started())  # an empty batch is no step
    # Counted on the host until the first count (after any decode step), which adds them.
    policy.metrics = plugin_gate.GateMetrics({"model_name": "m"}, registry=registry)
    policy.count_steps(SimpleNamespace(labels={"model_name": "m"}))

    def value(kind):
        return registry.get_sample_value(
            f"sglang:ecospec_gate_{kind}_steps_total", {"model_name": "m"}
        )

    assert (value("plain"), value("narrow"), value("tree")) == (4.0, 1.0, 2.0)
    step(1)  # after it, every step reaches its counter at once
    policy.export(SimpleNamespace(labels={"model_name": "m"}))  # nothing counted twice
    assert (value("plain"), value("narrow"), value("tree")) == (4.0, 2.0, 2.0)


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("enable_dp_attention", True, "--enable-dp-attention"),
        ("attn_dp_size", 2, "--attn-dp-size"),
        ("enable_two_batch_overlap", True, "--enable-two-batch-overlap"),
        ("pp_size", 2, "--pp-size"),
    ],
)
def test_unsupported_layouts_are_named(flag, value, words):
    args = SimpleNamespace(**{flag: value})
    assert words in plugin_gate.unsupported_reason(args)
    assert plugin_gate.unsupported_reason(SimpleNamespace()) is None


def fake_worker(hidden_size=16):
    """What :func:`plugin_gate.install` touches of an ``EAGLEWorkerV2``; the draft prefill
    records its calls."""
    calls = []
    runner = SimpleNamespace(
        model_config=SimpleNamespace(spec_hidden_size=hidden_size, dtype=torch.bfloat16),
        spec_algorithm=SimpleNamespace(is_standalone=lambda: False),
    )
    draft = SimpleNamespace(
        draft_runner=runner,
        _draft_extend_for_prefill=lambda *args, **kwargs: calls.append(args) or "drafted",
    )
    worker = SimpleNamespace(
        speculative_num_steps=3,
        device="cpu",
        adaptive_controller=None,
        topk=4,
        draft_worker=draft,
    )
    return worker, calls


def test_draft_prefill_is_skipped_where_the_batch_it_joins_decodes_plainly():
    worker, calls = fake_worker()
    policy = plugin_gate.install(worker, OPTIONS)
    prefill = worker.draft_worker._draft_extend_for_prefill
    next_tokens = torch.tensor([5, 7, 9])
    # Before any decision the draft runs (a fresh bucket measures speculation first).
    assert prefill("batch", "hidden", next_tokens) == "drafted" and len(calls) == 1
    run_steps(policy, 40, 1, spec_seconds=0.3, plain_seconds=0.1, accepted=0.2)
    assert not policy.gate.is_open(1)
    stub = prefill("batch", "hidden", next_tokens)
    assert len(calls) == 1  # the draft model did not run
    assert torch.equal(stub.bonus_tokens, next_tokens)
    assert stub.topk_p.shape == (3, 4) and stub.topk_index.shape == (3, 4)
    assert stub.hidden_states.shape == (3, 16) and stub.hidden_states.dtype == torch.bfloat16
    # A bucket where speculation pays needs current draft states again.
    run_steps(policy, 200, 8, spec_seconds=0.11, plain_seconds=0.1, accepted=1.5)
    assert policy.gate.is_open(8)
    # 8 decoding + 3 joining: a fresh 9-16 bucket starts from 5-8's, which speculates.
    assert prefill("batch", "hidden", next_tokens) == "drafted" and len(calls) == 2
    # Back at batch size 1, a request joining makes a batch of 2, nearest to closed 1.
    run_steps(policy, 5, 1, spec_seconds=0.3, plain_seconds=0.1, accepted=0.2)
    assert prefill("batch", "hidden", torch.tensor([4])).bonus_tokens.tolist() == [4]
    assert len(calls) == 2 and policy.gate.buckets() == [1, 8]


def test_install_sets_the_controller_and_skips_the_draft_extend(monkeypatch):
    monkeypatch.delenv(plugin_gate.SKIP_DRAFT_EXTEND_ENV, raising=False)
    worker, _ = fake_worker()
    policy = plugin_gate.install(worker, OPTIONS)
    assert worker.adaptive_controller.params is policy
    assert worker.adaptive_controller.candidate_steps == [0, 3]
    assert plugin_gate.install(worker, OPTIONS, narrow=True).levels == [0, 1, 3]
    assert os.environ[plugin_gate.SKIP_DRAFT_EXTEND_ENV] == "1"
    # An operator's own choice stands.
    monkeypatch.setenv(plugin_gate.SKIP_DRAFT_EXTEND_ENV, "0")
    plugin_gate.install(worker, OPTIONS)
    assert os.environ[plugin_gate.SKIP_DRAFT_EXTEND_ENV] == "0"


def test_settings():
    settings = EcoSpecSettings.from_env({})
    assert settings.gate and settings.gate_narrow and settings.gate_options() == GateOptions()
    env = {
        "SGLANG_ECOSPEC_GATE": "0",
        "SGLANG_ECOSPEC_GATE_PROBE_INTERVAL": "32",
        "SGLANG_ECOSPEC_GATE_NARROW": "0",
    }
    settings = EcoSpecSettings.from_env(env)
    assert not settings.gate and settings.gate_options().probe_interval == 32
    assert not settings.gate_narrow
    with pytest.raises(EcoSpecSettingsError, match="gate_probe_steps must be an int >= 2"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_GATE_PROBE_STEPS": "1"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, port, queue):
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        group = SimpleNamespace(ranks=[0, 1], cpu_group=torch.distributed.group.WORLD)
        policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu", group=group)
        # Rank 1 measures speculation as a loss, rank 0 as a gain: both follow rank 0.
        spec_seconds = 0.1 if rank == 0 else 0.5
        chosen = run_steps(policy, 60, 1, spec_seconds, 0.1, accepted=1.0)
        queue.put((rank, (chosen, policy.draft_prefill_needed(1)), None))
        torch.distributed.destroy_process_group()
    except Exception:
        queue.put((rank, None, traceback.format_exc()))


def test_two_ranks_run_rank0s_level():
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_rank_main, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, chosen, error = queue.get(timeout=120)
        assert error is None, error
        results[rank] = chosen
    for p in procs:
        p.join(timeout=30)
    assert results[0] == results[1]
    chosen, draft_prefill_needed = results[0]
    assert sum(c != 0 for c in chosen[-30:]) >= 25  # rank 0's verdict: speculation pays
    assert draft_prefill_needed  # rank 1 alone would skip it
