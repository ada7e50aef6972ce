"""Calibrated acceptance in the plugin (``sglang_ecospec.acceptance``, issue 15): selection
weighs the library calibrator's probabilities, the calibrator learns from SGLang's
``accept_index`` exactly as the library's ``observe`` does, the forecast acceptance length
(made before the step is learnt) reaches the "EcoSpec:" line, the decode log line and
/metrics, and the work stays on the device (no host sync, a bounded number of kernels, one
compiled draft-step graph)."""

import logging
from types import SimpleNamespace

import pytest
import torch
from _util import SYNC_OPS, compile_once, host_syncs
from sglang_ecospec import acceptance, metrics, routing, selection
from sglang_ecospec.settings import EcoSpecSettings

from plugin._helpers import PUBLISHED, cpu_runtime, sglang_draft_tree, spy_on_host_reads
from plugin.test_graph_safety import OpLog
from sgl_ecospec.acceptance import AcceptanceCalibrator, expected_accepted

TOPK, STEPS, NDT, BATCH = 2, 2, 3, 2  # 6 candidates, 2 verified per request
# The hand-built tree, per request (binary-exact edge probabilities): the root's children
# c0 (q 0.75) and c1 (0.25); c0's children c00 (0.625) and c01 (0.125), c1's c10 (0.5) and
# c11 (0.25). Candidates in SGLang's order [c0, c1, c00, c01, c10, c11].
SCORES = [0.75, 0.25, 0.46875, 0.09375, 0.125, 0.0625]
PARENTS = [-1, -1, 0, 0, 1, 1]
# The calibrated acceptance's part of after_verify at 2 draft steps: 10 aten ops of its own
# (accepted rows, forecast and measured totals) and 49 of the library's observe (masks, edges
# and cells of the tree, the counts; 4 more per further draft step); measured 59 on the CPU.
ACCEPTANCE_OPS = 60


def hand_tree(batch=BATCH):
    """score_list, token_list, parents_list of the tree above through SGLang's own
    ``select_top_k_tokens`` (as ``EagleDraftWorker.draft_forward`` builds them)."""
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    select = getattr(select_top_k_tokens, "__wrapped__", select_top_k_tokens)
    step_p = [torch.tensor([[0.75, 0.25]]), torch.tensor([[0.625, 0.125], [0.5, 0.25]])]
    step_ids = [torch.tensor([[11, 12]]), torch.tensor([[21, 22], [23, 24]])]
    lists, scores, hidden = ([], [], []), None, torch.zeros(batch, 4)
    for i, (p, ids) in enumerate(zip(step_p, step_ids, strict=True)):
        p, ids = p.repeat(batch, 1), ids.repeat(batch, 1)
        _, _, scores, info = select(i, p, ids, hidden, scores, TOPK)
        for store, item in zip(lists, info, strict=True):
            store.append(item)
        hidden = torch.zeros(batch * TOPK, 4)
    return lists


def make_runtime(**settings):
    """A runtime whose expert predictor stays cold (``learn`` off): every token is predicted
        the same experts, so DeltaCost is 0 everywhere and EcoSpec's P / (DeltaCost + eps) ranks
        by P alone, which makes the calibration's effect on the choice visible (the published rule:
    a score floor would drop the low-probability candidates it needs)."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    values = {"log_interval": 1, "num_buckets": 64, "learn": False, **PUBLISHED, **settings}
    return cpu_runtime(EcoSpecSettings(**values), config, TOPK, NDT, num_steps=STEPS)


def decode_step(runtime, accept_index, tree=None):
    """One decode step as SGLang runs it: seeds, the draft step's selection through the hook,
    the verify forward's routing through the capture hook, ``after_verify`` with SGLang's
    result, the batch's report. Returns the verified candidates ``[B, NDT-1]``."""
    tree = tree or hand_tree()
    batch = tree[0][0].shape[0]
    roots = torch.arange(batch) + 5
    runtime.before_decode(SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=roots))
    _, index, draft = selection.organize_hook(None, *tree, NDT)
    tokens = torch.cat([roots[:, None], draft], 1).flatten()
    runtime.before_verify()
    config = SimpleNamespace(allow_routed_experts_capture=True)
    for layer in (0, 1):
        routing.after_capture(None, config, layer, torch.stack([tokens % 8, (tokens + 1) % 8], 1))
    runtime.after_verify(SimpleNamespace(draft_token=tokens), accept_result(accept_index))
    runtime.poll_log()
    return index


def accept_result(rows):
    """SGLang's verify result as the plugin reads it: ``accept_index`` int32 ``[B, S+1]``,
    per request its accepted verify rows (root first, -1 padding), flat over the batch."""
    rows = torch.tensor(rows, dtype=torch.int32)
    offsets = torch.arange(rows.shape[0], dtype=torch.int32)[:, None] * NDT
    return SimpleNamespace(accept_index=torch.where(rows >= 0, rows + offsets, -1))


# Request 0 accepts its first verified candidate (row 1), request 1 none.
ACCEPTED = [[0, 1, -1], [0, -1, -1]]


def test_selection_weighs_the_library_calibrators_probabilities(monkeypatch):
    scores = torch.tensor([SCORES] * BATCH)
    parents = torch.tensor([PARENTS] * BATCH)
    seen = []
    real = selection.select_step

    def spy(predictor, tokens, step_scores, *args, **kwargs):
        seen.append(step_scores.clone())
        return real(predictor, tokens, step_scores, *args, **kwargs)

    monkeypatch.setattr(selection, "select_step", spy)
    plain = make_runtime(calibrated_acceptance=False)
    try:
        assert plain.acceptance is None and plain.selector.acceptance is None
        for _ in range(2):  # ranked by the draft's probabilities: c0 and c00
            assert decode_step(plain, ACCEPTED).tolist() == [[0, 2]] * BATCH
            assert torch.equal(seen[-1], scores)
        assert plain.summaries[0].keys().isdisjoint({"forecast_accept_length", "accept_length"})
    finally:
        plain.close()
    library = AcceptanceCalibrator(STEPS, num_bins=acceptance.AcceptanceTracker.NUM_BINS)
    runtime = make_runtime()
    try:
        assert runtime.selector.acceptance is runtime.acceptance
        for step in range(2):
            want = library.calibrate(scores, parents)
            got = decode_step(runtime, ACCEPTED)
            # select_step got the library's probabilities as they stood before this verify.
            assert torch.equal(seen[-1], want)
            # Once it has learnt that c00's depth is accepted far less often than the draft
            # promised, EcoSpec verifies c1 instead of c00.
            assert got.tolist() == ([[0, 2]] if step == 0 else [[0, 1]]) * BATCH
            library.observe(scores, parents, got, torch.tensor(ACCEPTED))
        assert torch.equal(runtime.acceptance.calibrator.accepted, library.accepted)
        assert torch.equal(runtime.acceptance.calibrator.promised, library.promised)
    finally:
        runtime.close()


def test_confidence_keeps_sglangs_ranking_and_still_forecasts():
    """policy=confidence is the arm that verifies EAGLE3's sets: calibration never changes
    its choice, but its calibrator learns and forecasts as under ecospec."""
    runtime = make_runtime(policy="confidence")
    try:
        for _ in range(2):
            assert decode_step(runtime, ACCEPTED).tolist() == [[0, 2]] * BATCH
        assert runtime.acceptance.calibrator.observe_calls == 2
        first, second = runtime.summaries
        assert first["forecast_accept_length"] == 1 + 0.75 + 0.46875
        assert second["forecast_accept_length"] < first["forecast_accept_length"]  # learnt
    finally:
        runtime.close()


def test_learns_the_accepted_nodes_from_sglangs_accept_index():
    runtime = make_runtime()
    try:
        selected = decode_step(runtime, ACCEPTED)
        assert selected.tolist() == [[0, 2]] * BATCH  # c0 (row 1) and c00 (row 2)
        tables = runtime.acceptance.calibrator
        # Tested nodes: c0 twice (depth 0, q 0.75: bin 7), accepted once; c00 once (depth 1,
        # q 0.625: bin 6), under request 0's accepted c0, rejected. Request 1's c00 had its
        # parent rejected: it tells nothing.
        want_accepted = torch.zeros(STEPS, 10)
        want_promised = torch.zeros(STEPS, 10)
        want_accepted[0, 7] = 1.0
        want_promised[0, 7] = 1.5
        want_promised[1, 6] = 0.625
        assert torch.equal(tables.accepted, want_accepted)
        assert torch.equal(tables.promised, want_promised)
        assert tables.observe_calls == 1
        # The library's own observe on the same verify result: the same tables.
        library = AcceptanceCalibrator(STEPS)
        rows = torch.tensor(ACCEPTED)
        scores, parents = torch.tensor([SCORES] * BATCH), torch.tensor([PARENTS] * BATCH)
        library.observe(scores, parents, selected, rows)
        assert torch.equal(library.accepted, tables.accepted)
        assert torch.equal(library.promised, tables.promised)
        # A result of another shape (another tree, a plain-decoding step, none) is not learnt.
        runtime.after_verify(SimpleNamespace(draft_token=torch.arange(2 * NDT)), None)
        wide = SimpleNamespace(accept_index=torch.zeros(2, STEPS + 2, dtype=torch.int32))
        runtime.after_verify(SimpleNamespace(draft_token=torch.arange(2 * NDT)), wide)
        assert tables.observe_calls == 1
    finally:
        runtime.close()


def test_forecast_and_measured_acceptance_reach_the_log_lines_and_metrics(caplog):
    from prometheus_client import CollectorRegistry

    runtime = make_runtime()
    try:
        with caplog.at_level(logging.INFO, logger="sglang_ecospec.runtime"):
            decode_step(runtime, ACCEPTED)
        first = runtime.summaries[0]
        # Made before the step was learnt: the cold calibrator's (the draft's) P(c0) + P(c00).
        assert first["forecast_accept_length"] == 1 + 0.75 + 0.46875
        assert first["accept_length"] == (2 + 1) / 2  # root + c0, root alone
        assert "acceptance length 1.500 (forecast 2.219)" in caplog.text
        # The next step's forecast reads what the first taught (the library's numbers).
        learnt = AcceptanceCalibrator(STEPS)
        learnt.accepted.copy_(runtime.acceptance.calibrator.accepted)
        learnt.promised.copy_(runtime.acceptance.calibrator.promised)
        probs = learnt.calibrate(torch.tensor([SCORES] * BATCH), torch.tensor([PARENTS] * BATCH))
        selected = decode_step(runtime, [[0, -1, -1], [0, 1, 2]])
        second = runtime.summaries[1]
        assert second["forecast_accept_length"] == pytest.approx(
            1 + expected_accepted(probs, selected).mean().item()
        )
        assert second["accept_length"] == 2.0
        # SGLang's decode log window spans both steps.
        window = runtime.decode_log_window.read()
        assert window["accept_length"] == 1.75
        assert window["forecast_accept_length"] == pytest.approx(
            (first["forecast_accept_length"] + second["forecast_accept_length"]) / 2
        )
    finally:
        runtime.close()
    fields = metrics.decode_log_fields(window)
    assert f", ecospec accept len: 1.75 (forecast {window['forecast_accept_length']:.2f})" in fields
    labels = {"model_name": "tiny", "tp_rank": "0"}
    registry = CollectorRegistry()
    metrics.EcoSpecMetrics(labels, registry=registry).record(window, 1.9)
    value = registry.get_sample_value
    assert value("sglang:ecospec_calibrated_accept_length", labels) == 1.75
    assert value("sglang:ecospec_forecast_accept_length", labels) == pytest.approx(
        window["forecast_accept_length"]
    )
    assert value("sglang:ecospec_accept_length", labels) == 1.9  # SGLang's, unchanged
    assert acceptance.window_summary([3.0, 2.0, 6.0], [3.0, 2.0, 6.0]) == {}


def test_after_verify_learns_on_the_device_without_host_sync(monkeypatch):
    runtime = make_runtime()
    reads = spy_on_host_reads(monkeypatch)
    try:
        tree = hand_tree()
        runtime.before_decode(
            SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=torch.tensor([5, 6]))
        )
        reads.clear()
        selection.organize_hook(None, *tree, NDT)
        assert reads == []
        result = accept_result(ACCEPTED)
        with OpLog() as log:
            runtime.acceptance.after_verify(result.accept_index)
        assert reads == [] and not SYNC_OPS & set(log.names()), log.names()
        assert len(log.ops) <= ACCEPTANCE_OPS, log.names()
        # Through the runtime, with its snapshot for the "EcoSpec:" line: still no host read.
        tokens = torch.arange(BATCH * NDT)
        runtime.before_verify()
        runtime.after_verify(SimpleNamespace(draft_token=tokens), result)
        assert reads == []
        assert runtime.acceptance.calibrator.observe_calls == 2
    finally:
        runtime.close()


def test_calibrated_selection_compiles_as_one_graph_without_host_sync():
    from sgl_ecospec.predictors import OnlineExpertPredictor

    batch, topk, steps, ndt = 3, 3, 3, 8

    def make_selector():
        tracker = acceptance.AcceptanceTracker(
            topk=topk, num_steps=steps, num_draft_tokens=ndt, max_batch=4, device="cpu"
        )
        # A warm calibrator: depth 1 accepted at half its promise.
        tracker.calibrator.accepted.copy_(torch.tensor([[40.0] * 10, [20.0] * 10, [5.0] * 10]))
        tracker.calibrator.promised.fill_(40.0)
        selector = selection.EcoSpecSelector(
            EcoSpecSettings(log_interval=0),
            OnlineExpertPredictor(2, 16, 2, num_buckets=64),
            topk=topk,
            num_draft_tokens=ndt,
            max_batch=4,
            device="cpu",
            acceptance=tracker,
        )
        selector.set_roots(torch.tensor([1, 2, 3]))
        selector.options_for(batch)
        return selector

    tree = sglang_draft_tree(batch, topk, steps, seed=4)
    eager = make_selector()
    want = eager.organize(*tree, ndt)
    selector = make_selector()

    def step(score_list, token_list, parents_list):
        return selector.organize(score_list, token_list, parents_list, ndt)

    compiled, recorder = compile_once(step, "aot_eager")
    got = compiled(*tree)
    assert len(recorder.graphs) == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for name in ("scores", "parents", "selected", "forecast"):
        assert torch.equal(getattr(selector.acceptance, name), getattr(eager.acceptance, name))
    assert host_syncs(step, *tree) == []
    # The graph reads the live tables: a change in place changes the forecast it records.
    before = selector.acceptance.forecast.clone()
    selector.acceptance.calibrator.accepted.mul_(0.5)
    compiled(*tree)
    assert len(recorder.graphs) == 1
    assert (selector.acceptance.forecast[:batch] < before[:batch]).all()


def test_another_tree_shape_is_selected_uncalibrated_and_warned_once(caplog):
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    runtime = EcoSpecRuntime(
        EcoSpecSettings(policy="confidence", log_interval=0, num_buckets=64),
        config,
        topk=TOPK,
        num_draft_tokens=NDT,
        num_steps=1,  # the tree below has 2 steps
        max_batch=4,
        device="cpu",
    )
    try:
        with caplog.at_level(logging.WARNING, logger="sglang_ecospec.acceptance"):
            for _ in range(2):
                _, index, _ = selection.organize_hook(None, *hand_tree(), NDT)
        assert index.tolist() == [[0, 2]] * BATCH  # the draft's own ranking
        assert caplog.text.count("calibrator was built for 2") == 1
        assert not runtime.acceptance.accepts(accept_result(ACCEPTED).accept_index, BATCH * NDT)
    finally:
        runtime.close()


def test_setting_defaults_on_and_parses():
    assert EcoSpecSettings().calibrated_acceptance is True
    env = {"SGLANG_ECOSPEC_CALIBRATED_ACCEPTANCE": "0"}
    assert EcoSpecSettings.from_env(env).calibrated_acceptance is False
