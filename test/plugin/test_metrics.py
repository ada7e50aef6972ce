"""EcoSpec's statistics in SGLang's decode log line and its Prometheus metrics."""

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import hooks, metrics, routing

from sgl_ecospec.predictors import OnlineExpertPredictor

LABELS = {"model_name": "tiny", "tp_rank": 0}


def sample(registry, name):
    """A series' value as /metrics shows it (label values are strings there)."""
    return registry.get_sample_value(name, {key: str(value) for key, value in LABELS.items()})


def fake_reporter(*, tick, metrics_enabled=True, accepted=9, forwards=4):
    """What report_decode_stats_hook reads of SGLang's SchedulerMetricsReporter."""
    return SimpleNamespace(
        decode_log_interval=2,
        forward_ct_decode=4 if tick else 5,
        is_stats_logging_rank=True,
        current_scheduler_metrics_enabled=metrics_enabled,
        spec_num_accept_tokens=accepted,
        spec_num_forward_ct=forwards,
        metrics_collector=SimpleNamespace(labels=LABELS) if metrics_enabled else None,
    )


def sglang_decode_line(reporter):
    """Stands in for SGLang's report_decode_stats: logs its line on its logger, resets its
    acceptance counters."""
    logging.getLogger(metrics.DECODE_LOGGER).info(
        "Decode batch, #running-req: 1, accept len: %.2f, #queue-req: 0"
        % (reporter.spec_num_accept_tokens / reporter.spec_num_forward_ct)
    )
    reporter.spec_num_accept_tokens = reporter.spec_num_forward_ct = 0
    return "reported"


@pytest.fixture
def decode_line_stats(monkeypatch):
    """An active window with two verify steps (unique experts 2 and 3, recall known), and a
    private Prometheus registry for EcoSpec's series."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    series = metrics.EcoSpecMetrics(LABELS, registry=registry)
    monkeypatch.setattr(metrics, "_metrics", series)
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=64)
    stats = routing.VerifyStats(8, "cpu", layer_ids=[0])
    window, reference = stats.window(), stats.window()
    stats.update(torch.tensor([[[0, 1]], [[1, 0]]]), predictor.predict_topk(torch.tensor([1, 2])))
    stats.update(torch.tensor([[[2, 5]]]), predictor.predict_topk(torch.tensor([3])))
    bindings = [metrics.slot.bind(window)]
    hooks.activate(bindings)
    try:
        yield window, registry, reference.read()
    finally:
        hooks.deactivate(bindings)


def test_decode_log_line_carries_ecospec_fields_and_metrics_update(decode_line_stats, caplog):
    window, registry, expected = decode_line_stats
    assert expected["unique_experts_per_layer"] == 2.0 and expected["verify_steps"] == 2
    reporter = fake_reporter(tick=True)
    with caplog.at_level(logging.INFO, logger=metrics.DECODE_LOGGER):
        assert metrics.report_decode_stats_hook(sglang_decode_line, reporter) == "reported"
    (line,) = [r.getMessage() for r in caplog.records if r.name == metrics.DECODE_LOGGER]
    recall = expected["predictor_recall"]
    assert line == (
        "Decode batch, #running-req: 1, accept len: 2.25, #queue-req: 0, "
        f"ecospec experts/layer/step: 2.00, predictor recall: {recall:.3f}"
    )
    assert sample(registry, "sglang:ecospec_unique_experts_per_layer_step") == 2.0
    assert sample(registry, "sglang:ecospec_predictor_recall") == pytest.approx(recall)
    # SGLang's acceptance counters over the same window: 9 tokens / 4 request-steps.
    assert sample(registry, "sglang:ecospec_accept_length") == 2.25
    assert sample(registry, "sglang:ecospec_verify_tokens_per_step") == 1.5
    assert sample(registry, "sglang:ecospec_verify_steps_total") == 2
    assert window.pending_steps == 0
    # Other records of that logger pass unchanged.
    with caplog.at_level(logging.INFO, logger=metrics.DECODE_LOGGER):
        logging.getLogger(metrics.DECODE_LOGGER).info("Prefill batch, #new-seq: 1")
    assert caplog.records[-1].getMessage() == "Prefill batch, #new-seq: 1"


def test_decode_log_hook_reads_nothing_between_log_lines(decode_line_stats, caplog):
    window, registry, _ = decode_line_stats
    calls = []
    with caplog.at_level(logging.INFO, logger=metrics.DECODE_LOGGER):
        # Not a log tick: SGLang's method only, the window is not read (no host sync).
        metrics.report_decode_stats_hook(lambda r: calls.append(r), fake_reporter(tick=False))
        assert len(calls) == 1 and window.pending_steps == 2
        # A log tick without --enable-metrics: fields in the line, no series touched.
        reporter = fake_reporter(tick=True, metrics_enabled=False)
        metrics.report_decode_stats_hook(sglang_decode_line, reporter)
    assert "ecospec experts/layer/step: 2.00" in caplog.records[-1].getMessage()
    assert sample(registry, "sglang:ecospec_verify_steps_total") == 0
    # No ECOSPEC worker in the process (EAGLE3 and the rest): SGLang's line unchanged.
    metrics.slot.activate(None)
    with caplog.at_level(logging.INFO, logger=metrics.DECODE_LOGGER):
        metrics.report_decode_stats_hook(sglang_decode_line, fake_reporter(tick=True))
    assert caplog.records[-1].getMessage().endswith("#queue-req: 0")


def test_uncaptured_verify_steps_reach_the_decode_line_and_metrics(decode_line_stats, caplog):
    window, registry, _ = decode_line_stats
    # A third step whose routing SGLang did not capture (rows left at -1).
    window.stats.update(torch.tensor([[[-1, -1]]]), torch.tensor([[[0, 1]]]))
    with caplog.at_level(logging.INFO):
        metrics.report_decode_stats_hook(sglang_decode_line, fake_reporter(tick=True))
    (line,) = [r.getMessage() for r in caplog.records if r.name == metrics.DECODE_LOGGER]
    assert line.endswith(", ecospec routing not captured: 1 steps")
    assert sample(registry, "sglang:ecospec_routing_capture_missed_steps_total") == 1
    assert any(r.levelno == logging.ERROR and r.name == routing.__name__ for r in caplog.records)


def test_report_hook_polls_the_ecospec_line_after_every_decode_batch():
    """The "EcoSpec:" line is logged from SGLang's per-batch report, on log ticks and between
    them, whether or not a decode window is active (``EcoSpecRuntime.poll_log``)."""
    polls = []
    bindings = [metrics.log_line_slot.bind(lambda: polls.append(1))]
    hooks.activate(bindings)
    try:
        for tick in (False, True, False):
            assert metrics.report_decode_stats_hook(lambda r: "ok", fake_reporter(tick=tick))
        assert len(polls) == 3
    finally:
        hooks.deactivate(bindings)
    metrics.report_decode_stats_hook(lambda r: "ok", fake_reporter(tick=True))
    assert len(polls) == 3 and metrics.log_line_slot.active() is None


def test_report_hook_is_applied_to_sglang_reporter():
    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter

    hooks.install(metrics.slot.hooks)
    method = SchedulerMetricsReporter.report_decode_stats
    assert hasattr(method, "__wrapped__") and method.__name__ == "report_decode_stats"
    assert metrics.window_accept_length(SimpleNamespace(spec_num_forward_ct=0)) is None


def test_metrics_are_multiprocess_safe(tmp_path):
    """In Prometheus' multiprocess mode (SGLang's) a scheduler process writes the series to
    PROMETHEUS_MULTIPROC_DIR and the HTTP server aggregates them: two records in a child
    process, read back the way /metrics reads them."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    child = (
        "from sglang_ecospec.metrics import EcoSpecMetrics\n"
        "m = EcoSpecMetrics({'model_name': 'tiny', 'tp_rank': 0})\n"
        "m.record({'unique_experts_per_layer': 6.5, 'predictor_recall': 0.5, "
        "'verify_tokens_per_step': 12.0, 'verify_steps': 3}, 2.0)\n"
        "m.record({'unique_experts_per_layer': 5.25, 'predictor_recall': 0.75, "
        "'verify_tokens_per_step': 10.0, 'verify_steps': 4}, None)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    text = generate_latest(registry).decode()
    assert sample(registry, "sglang:ecospec_unique_experts_per_layer_step") == 5.25  # latest
    assert sample(registry, "sglang:ecospec_predictor_recall") == 0.75
    assert sample(registry, "sglang:ecospec_accept_length") == 2.0  # the 2nd record had none
    assert sample(registry, "sglang:ecospec_verify_steps_total") == 7
    assert 'sglang:ecospec_verify_tokens_per_step{model_name="tiny",tp_rank="0"} 10.0' in text


def test_per_layer_recall_and_prediction_time_reach_the_metrics(monkeypatch):
    """Each MoE layer's recall over the window (labelled with the target's layer id) and the
    prediction time per draft step of the timed steps since the last read."""
    from prometheus_client import CollectorRegistry

    class Timer:  # metrics.PredictTimer's reading: (seconds, predictions timed) so far
        reading = (0.0, 0)

        def totals(self):
            return self.reading

    timer = Timer()
    stats = routing.VerifyStats(8, "cpu", layer_ids=[3, 7])
    window = stats.window(timer)
    # Two tokens, top-2 of MoE layers 3 and 7: layer 3 predicted 3 of 4 ids, layer 7 1 of 4.
    true = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    predicted = torch.tensor([[[0, 1], [2, 0]], [[4, 0], [1, 0]]])
    stats.update(true, predicted)
    timer.reading = (0.006, 3)  # three predictions timed, 6 ms
    summary = window.read()
    assert summary["predictor_recall_per_layer"] == {3: 0.75, 7: 0.25}
    assert summary["predictor_recall"] == 0.5
    assert summary["predict_ms_per_step"] == pytest.approx(2.0)
    registry = CollectorRegistry()
    series = metrics.EcoSpecMetrics(LABELS, registry=registry)
    series.record(summary, None)
    for layer, recall in ((3, 0.75), (7, 0.25)):
        labels = {**{k: str(v) for k, v in LABELS.items()}, "layer": str(layer)}
        name = "sglang:ecospec_predictor_recall_per_layer"
        assert registry.get_sample_value(name, labels) == recall
    assert sample(registry, "sglang:ecospec_predict_ms_per_step") == pytest.approx(2.0)
    assert metrics.predict_log_field(summary) == ", predict ms/step 2.000"
    # No prediction timed since (e.g. every step replayed from a CUDA graph): left as it was.
    stats.update(true, predicted)
    summary = window.read()
    assert summary["predict_ms_per_step"] is None and metrics.predict_log_field(summary) == ""
    series.record(summary, None)
    assert sample(registry, "sglang:ecospec_predict_ms_per_step") == pytest.approx(2.0)


def test_predict_timer_times_on_the_cpu_and_reads_cuda_events_without_waiting(monkeypatch):
    timer = metrics.PredictTimer("cpu")
    started = timer.start()
    timer.stop(started)
    seconds, timed = timer.totals()
    assert timed == 1 and seconds >= 0.0
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert timer.start() is None  # traced into a compiled graph: not timed
    monkeypatch.undo()

    class Event:  # torch.cuda.Event's part the timer uses; completes when told
        clock = 0.0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.done, self.at = False, None

        def record(self):
            Event.clock += 1.5
            self.at = Event.clock

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return end.at - self.at  # milliseconds

    capturing = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(capturing))
    timer = metrics.PredictTimer("cuda", max_pending=2)
    pairs = [timer.start() for _ in range(3)]
    assert pairs[2] is None  # two pairs in flight at most: the third step is not timed
    for pair in pairs:
        timer.stop(pair)
    assert timer.totals() == (0.0, 0)  # nothing completed: nothing read, nothing waited for
    pairs[0][1].done = True
    assert timer.totals() == (pytest.approx(1.5e-3 * 2), 1)  # 2 records apart: 3 ms
    capturing.append(True)  # a CUDA-graph capture: not timed
    assert timer.start() is None
    capturing.clear()
    assert timer.start() == pairs[0]  # the harvested pair is reused


def test_report_hook_counts_the_gates_steps_after_every_step_and_sets_gauges_on_ticks():
    calls = []

    class Gate:
        def count_steps(self, collector):
            calls.append(("count", collector.labels))

        def export(self, collector):
            calls.append(("export", collector.labels))

    metrics.gate_slot.activate(Gate())
    try:
        metrics.report_decode_stats_hook(lambda r: None, fake_reporter(tick=False))
        metrics.report_decode_stats_hook(lambda r: None, fake_reporter(tick=True))
        # Without --enable-metrics nothing is counted.
        metrics.report_decode_stats_hook(
            lambda r: None, fake_reporter(tick=False, metrics_enabled=False)
        )
    finally:
        metrics.gate_slot.activate(None)
    assert calls == [("count", LABELS), ("export", LABELS)]
