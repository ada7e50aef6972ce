"""EcoSpec's statistics in SGLang's decode log line and on the server's /metrics endpoint.

Every ``--decode-log-interval`` decode batches SGLang's scheduler calls
``SchedulerMetricsReporter.report_decode_stats``, which logs the "Decode batch. ..." line
(with SGLang's own ``accept len``) and, with ``--enable-metrics``, sets its Prometheus
gauges. :func:`report_decode_stats_hook` (an AROUND hook on that method, installed by an
ECOSPEC worker in its scheduler process only) does, on exactly those calls:

- reads the active :class:`~sglang_ecospec.routing.StatsWindow` (one host sync per decode
  log line: the statistics live on the device);
- appends ``, ecospec experts/layer/step: 5.62, predictor recall: 0.833`` to the decode line,
  through a :class:`logging.Filter` on SGLang's reporter logger that is attached only
  while the hooked call runs;
- with ``--enable-metrics``, sets :class:`EcoSpecMetrics` (labels and metric classes taken
  from SGLang's scheduler collector, multiprocess mode like SGLang's gauges), among them the
  predictor's recall per MoE layer and its prediction time per draft step
  (:class:`PredictTimer`).

On every call (each decode batch's results, SGLang's host-side bookkeeping) it also logs the
"EcoSpec:" lines whose asynchronous snapshots have landed (``EcoSpecRuntime.poll_log``, held
by :data:`log_line_slot`; it never waits), so no read of the statistics sits on the forward
path.

Without an active window (EAGLE3 and every other algorithm) the hook calls SGLang's method
and nothing else.
"""

import logging
import time

import torch

from sglang_ecospec.hooks import HookSlot

logger = logging.getLogger(__name__)

REPORT_TARGET = (
    "sglang.srt.managers.scheduler_components.metrics_reporter."
    "SchedulerMetricsReporter.report_decode_stats"
)
DECODE_LOGGER = "sglang.srt.managers.scheduler_components.metrics_reporter"
DECODE_LINE_PREFIX = "Decode batch"


def decode_log_fields(summary: dict) -> str:
    """What EcoSpec appends to SGLang's decode log line (leading ", "); verify steps whose
    routing was not captured only when there were any."""
    fields = (
        f", ecospec experts/layer/step: {summary['unique_experts_per_layer']:.2f}"
        f", predictor recall: {summary['predictor_recall']:.3f}"
    )
    if "forecast_accept_length" in summary:  # calibrated acceptance
        fields += (
            f", ecospec accept len: {summary['accept_length']:.2f}"
            f" (forecast {summary['forecast_accept_length']:.2f})"
        )
    missed = summary.get("capture_missed_steps", 0)
    if missed:
        fields += f", ecospec routing not captured: {missed} steps"
    return fields


def predict_log_field(summary: dict) -> str:
    """The prediction time per draft step in the "EcoSpec:" line (leading ", "), when some
    prediction of the window was timed (:class:`PredictTimer`)."""
    ms = summary.get("predict_ms_per_step")
    return "" if ms is None else f", predict ms/step {ms:.3f}"


class EcoSpecMetrics:
    """EcoSpec's Prometheus series, labelled as SGLang's scheduler metrics.

    The gauges hold the means of the last decode log window (as SGLang's
    ``sglang:spec_accept_length``); in Prometheus' multiprocess mode (SGLang's, through
    ``PROMETHEUS_MULTIPROC_DIR``) they keep the most recent value of any process
    (``multiprocess_mode="mostrecent"``, as SGLang's gauges). prometheus_client is imported
    here, not at module level, so that the scheduler has set that variable first.

    Args:
        labels: label name -> value, SGLang's scheduler labels (model_name, tp_rank, ...).
        gauge_cls, counter_cls: metric classes with prometheus_client's API; None:
            prometheus_client's (SGLang's collectors may swap in others, e.g. Ray's).
        registry: a prometheus_client registry (tests); None: the library's default.
    """

    def __init__(self, labels: dict, *, gauge_cls=None, counter_cls=None, registry=None):
        from prometheus_client import Counter, Gauge

        gauge_cls = gauge_cls or Gauge
        counter_cls = counter_cls or Counter
        extra = {} if registry is None else {"registry": registry}
        names = list(labels)

        def gauge(name: str, documentation: str):
            metric = gauge_cls(
                name=name,
                documentation=documentation,
                labelnames=names,
                multiprocess_mode="mostrecent",
                **extra,
            )
            return metric.labels(**labels)

        self.unique_experts = gauge(
            "sglang:ecospec_unique_experts_per_layer_step",
            "EcoSpec: unique experts loaded per MoE layer per verify step (union over the "
            "step's verify tokens, mean over layers and over the last decode log window).",
        )
        self.predictor_recall = gauge(
            "sglang:ecospec_predictor_recall",
            "EcoSpec: the expert predictor's top-K recall on verify tokens, before learning "
            "from them (mean over the last decode log window).",
        )
        self._labels = labels
        self.layer_recall = gauge_cls(
            name="sglang:ecospec_predictor_recall_per_layer",
            documentation="EcoSpec: the expert predictor's top-K recall on verify tokens in "
            "one MoE layer (label layer: the target's layer id), over the last decode log "
            "window.",
            labelnames=[*names, "layer"],
            multiprocess_mode="mostrecent",
            **extra,
        )
        self.predict_ms = gauge(
            "sglang:ecospec_predict_ms_per_step",
            "EcoSpec: milliseconds of the expert prediction of one draft step (every row of "
            "the batch's trees), mean over the steps timed in the last decode log window.",
        )
        self.accept_length = gauge(
            "sglang:ecospec_accept_length",
            "EcoSpec: mean acceptance length (accepted drafts + bonus token per request and "
            "verify step) over the last decode log window.",
        )
        self.calibrated_accept_length = gauge(
            "sglang:ecospec_calibrated_accept_length",
            "EcoSpec: measured acceptance length over the verify steps the acceptance "
            "calibrator learnt from in the last decode log window (calibrated_acceptance).",
        )
        self.forecast_accept_length = gauge(
            "sglang:ecospec_forecast_accept_length",
            "EcoSpec: acceptance length forecast by the calibrated acceptance probabilities "
            "(1 + the verified nodes' probabilities, before each step's result was learnt) "
            "over the same verify steps.",
        )
        self.verify_tokens = gauge(
            "sglang:ecospec_verify_tokens_per_step",
            "EcoSpec: verify tokens per verify step (batch-wide, mean over the last decode "
            "log window).",
        )
        self.verify_steps = counter_cls(
            name="sglang:ecospec_verify_steps",
            documentation="EcoSpec: verify steps measured.",
            labelnames=names,
            **extra,
        ).labels(**labels)
        self.capture_missed_steps = counter_cls(
            name="sglang:ecospec_routing_capture_missed_steps",
            documentation="EcoSpec: verify steps whose routing was not captured for every MoE "
            "layer (the predictor then learns from stale rows; also logged as an error).",
            labelnames=names,
            **extra,
        ).labels(**labels)

    def record(self, summary: dict, accept_length: float | None) -> None:
        """Sets the series from one window (``StatsWindow.read``) and SGLang's acceptance
        length over the same decode log window (None: none known; left as it was)."""
        self.unique_experts.set(summary["unique_experts_per_layer"])
        self.predictor_recall.set(summary["predictor_recall"])
        for layer, recall in summary.get("predictor_recall_per_layer", {}).items():
            self.layer_recall.labels(**self._labels, layer=str(layer)).set(recall)
        if summary.get("predict_ms_per_step") is not None:
            self.predict_ms.set(summary["predict_ms_per_step"])
        self.verify_tokens.set(summary["verify_tokens_per_step"])
        self.verify_steps.inc(summary["verify_steps"])
        self.capture_missed_steps.inc(summary.get("capture_missed_steps", 0))
        if accept_length is not None:
            self.accept_length.set(accept_length)
        if "forecast_accept_length" in summary:
            self.calibrated_accept_length.set(summary["accept_length"])
            self.forecast_accept_length.set(summary["forecast_accept_length"])


class PredictTimer:
    """The expert predictor's time per draft step, measured without a host sync.

    On the CPU the prediction's wall time (its ops run as they are called). On a CUDA device a
    pair of timing events around it, harvested by :meth:`totals` once the end event has
    completed (``query``: never waiting), at most ``max_pending`` pairs in flight (a step
    finding none free is not timed). Predictions inside a CUDA-graph capture, and so their
    replays, are not timed (an event recorded during capture would need a graph node), nor
    those traced by ``torch.compile``.

    Attributes:
        seconds, timed: the measured seconds and predictions so far (host numbers).
    """

    def __init__(self, device, *, max_pending: int = 8):
        self.device = torch.device(device)
        self.max_pending = max_pending
        self.seconds = 0.0
        self.timed = 0
        self._free: list = []  # event pairs ready to record
        self._pending: list = []  # recorded pairs, oldest first
        self._made = 0

    def start(self):
        """Marks a prediction's start; returns what :meth:`stop` takes (None: not timed)."""
        if torch.compiler.is_compiling():
            return None
        if self.device.type != "cuda":
            return time.perf_counter()
        if torch.cuda.is_current_stream_capturing():
            return None
        if self._free:
            pair = self._free.pop()
        elif self._made < self.max_pending:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._made += 1
        else:
            return None
        pair[0].record()
        return pair

    def stop(self, started) -> None:
        """Marks the end of the prediction :meth:`start` returned ``started`` for."""
        if started is None:
            return
        if isinstance(started, float):
            self.seconds += time.perf_counter() - started
            self.timed += 1
            return
        started[1].record()
        self._pending.append(started)

    def totals(self) -> tuple[float, int]:
        """(seconds, predictions) timed so far, counting every event pair that has completed
        (never waits)."""
        while self._pending and self._pending[0][1].query():
            begin, end = self._pending.pop(0)
            self.seconds += begin.elapsed_time(end) / 1e3
            self.timed += 1
            self._free.append((begin, end))
        return self.seconds, self.timed


class DecodeLineFields(logging.Filter):
    """Appends ``fields`` to the next "Decode batch" record of SGLang's reporter logger."""

    def __init__(self):
        super().__init__()
        self.fields: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            self.fields
            and isinstance(record.msg, str)
            and record.msg.startswith(DECODE_LINE_PREFIX)
        ):
            record.msg += self.fields
            self.fields = None
        return True


# The decode-log window of this process's ECOSPEC worker (a routing.StatsWindow); empty, the
# hook only calls SGLang's method.
slot: HookSlot = HookSlot("decode log window")
# The "EcoSpec:" line's poll (``EcoSpecRuntime.poll_log``), called by the same hook; it adds
# no hook of its own.
log_line_slot: HookSlot = HookSlot("EcoSpec log line")
# The utility gate's policy (``gate.GatePolicy``), whose per-bucket states the same hook exports.
gate_slot: HookSlot = HookSlot("utility gate")
_line_fields = DecodeLineFields()
_metrics: EcoSpecMetrics | None = None


def is_report_tick(reporter) -> bool:
    """Whether this ``report_decode_stats`` call logs the line or sets the metrics: the
    conditions under which SGLang's method does its periodic work."""
    interval = reporter.decode_log_interval
    return (
        interval > 0
        and reporter.forward_ct_decode % interval == 0
        and (reporter.is_stats_logging_rank or reporter.current_scheduler_metrics_enabled)
    )


def window_accept_length(reporter) -> float | None:
    """SGLang's acceptance length over the decode log window that is about to be reported
    (the method resets these counters, so read them before it runs)."""
    forwards = getattr(reporter, "spec_num_forward_ct", 0)
    if not forwards:
        return None
    return reporter.spec_num_accept_tokens / forwards


def metrics_for(collector) -> EcoSpecMetrics:
    """This process's :class:`EcoSpecMetrics`, built on first use with ``collector``'s labels
    and metric classes (a series can be registered once per process)."""
    global _metrics
    if _metrics is None:
        _metrics = EcoSpecMetrics(
            collector.labels,
            gauge_cls=getattr(collector, "_gauge_cls", None),
            counter_cls=getattr(collector, "_counter_cls", None),
        )
    return _metrics


@slot.hook(REPORT_TARGET)
def report_decode_stats_hook(original, reporter, *args, **kwargs):
    """AROUND hook on ``SchedulerMetricsReporter.report_decode_stats`` (module doc)."""
    poll = log_line_slot.active()
    if poll is not None:
        poll()
    gate = gate_slot.active()
    collector = getattr(reporter, "metrics_collector", None)
    if gate is not None and collector is not None and reporter.current_scheduler_metrics_enabled:
        if is_report_tick(reporter):
            gate.export(collector)
        else:  # the step counters after every step, the gauges on the ticks
            gate.count_steps(collector)
    window = slot.active()
    if window is None or not is_report_tick(reporter):
        return original(reporter, *args, **kwargs)
    summary = window.read()
    if summary is None:
        return original(reporter, *args, **kwargs)
    accept_length = window_accept_length(reporter)
    # The filter sits on SGLang's logger only for this call: other lines never meet it.
    decode_logger = logging.getLogger(DECODE_LOGGER)
    _line_fields.fields = decode_log_fields(summary)
    decode_logger.addFilter(_line_fields)
    try:
        result = original(reporter, *args, **kwargs)
    finally:
        decode_logger.removeFilter(_line_fields)
        _line_fields.fields = None
    if reporter.current_scheduler_metrics_enabled and collector is not None:
        metrics_for(collector).record(summary, accept_length)
    return result
