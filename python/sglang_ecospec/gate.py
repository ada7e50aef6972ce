"""ECOSPEC's utility gate in the server: per batch-size bucket, the speculation level that
decodes fastest, plain decoding where speculation does not pay (setting ``gate``, on by
default).

The decision is :class:`sgl_ecospec.gate.UtilityGate`'s (measured tokens per request per step
and step times, per bucket and level, with periodic re-probing). The switch is SGLang's own:
EAGLE's V2 worker runs with ``speculative_num_steps == 0`` as plain decoding (no draft tree: a
one-node verify of the bonus token, which samples the next token from the target's logits,
through the verify graph captured for one draft token), and its adaptive-speculation controller
(``AdaptiveController``) holds a runtime state (attention backends, CUDA graphs) per step count
and switches between them before each decode step. SGLang builds the state of ``s`` steps with
``s + 1`` draft tokens, so the narrow level (setting ``gate_narrow``, on by default: on the
bandwidth testbed at concurrency 16 it decoded 6% faster than the plain server where the tree
lost, docs/results/log.md) is one draft step verifying the draft's most likely token (SGLang's
own selection: with one slot per request there is no set to choose), for where a wide tree's
verify costs more than it yields but one drafted token still pays. :class:`GatePolicy` is the
controller's policy (SGLang's ``AdaptiveSpecPolicy`` protocol) with the step counts 0, 1
(narrow) and the configured ``--speculative-num-steps``; :func:`install` builds the controller
on the worker. While a bucket decodes plainly the draft model does not run at all: the worker
sets SGLang's ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` (unless the operator set it), so the
draft extend after the one-node verify is skipped too. Re-entering speculation, the requests
draft from a draft state that misses the plainly decoded positions (lossless: verification
decides), so a closed bucket's probes refresh only the speculative step's time, not its
acceptance (:mod:`sgl_ecospec.gate`). For the same reason a prefill skips the draft model's
pass over the prompt (:func:`skip_draft_prefill`) where the batch its requests join decodes
plainly (:meth:`UtilityGate.speculates_at` of the last decode step's batch size plus the
prefill's requests): a new request's first token then costs what it costs the plain server.
Only that batch's bucket counts, not every bucket seen: a bucket of another size that
speculates (batch size 1, say, from a warmup request or a restored memory) does not make a
batch of 16 that decodes plainly pay the draft's prefill.

Timing: each decode step's time is measured around the worker's ``forward_batch_generation``
(on the CPU its wall time; on a GPU two CUDA events on the forward stream, read when the step's
results reach the host, where the scheduler has already waited for them), and its tokens per
request from ``num_correct_drafts_per_req`` that SGLang hands to the controller
(``on_verify_complete``). Steps and results pair in order (a FIFO), as the overlap scheduler
processes results in launch order.

Ranks: every rank of the TP group must run the same level, or the collectives of the target's
forward would mix a one-token verify with a tree verify. With more than one rank, rank 0's
level is broadcast over the group's CPU (gloo) group before each step (one 8-byte broadcast).

Memory (setting ``gate_memory``, :mod:`sglang_ecospec.gate_memory`): rank 0 writes the settled
buckets at each decision, and a restarted server of the same key starts from them.

Logged: each bucket's first decision and every change of state, with its measurements.
Exported (``--enable-metrics``): ``sglang:ecospec_gate_open`` and
``sglang:ecospec_gate_utility`` per bucket (label ``batch_sizes``), and the decode steps run
at each level, ``sglang:ecospec_gate_{plain,narrow,tree}_steps_total``.
"""

import collections
import logging
import os
import time

import torch

from sgl_ecospec.gate import (
    PLAIN,
    BucketState,
    GateOptions,
    LevelFigures,
    UtilityGate,
    bucket_label,
)
from sglang_ecospec import gate_memory

logger = logging.getLogger(__name__)

SKIP_DRAFT_EXTEND_ENV = "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"


def unsupported_reason(view) -> str | None:
    """Why the gate cannot run with these server arguments (``view``: SGLang's resolved
    view of the final ``ServerArgs``), or None. SGLang's runtime-state switch does not cover
    these layouts (as SGLang's ``adaptive_spec_params.adaptive_unsupported_reason`` says)."""
    if getattr(view, "enable_dp_attention", False) or getattr(view, "attn_dp_size", 1) > 1:
        return (
            "attention DP (--enable-dp-attention / --attn-dp-size): the DP ranks' decisions "
            "are not synchronised"
        )
    checks = (
        ("enable_multi_layer_eagle", "multi-layer EAGLE"),
        ("enable_two_batch_overlap", "two-batch overlap"),
        ("enable_pdmux", "PD multiplexing"),
    )
    for flag, what in checks:
        if getattr(view, flag, False):
            return f"{what} (--{flag.replace('_', '-')})"
    if getattr(view, "pp_size", 1) > 1:
        return "pipeline parallelism (--pp-size > 1)"
    return None


class StepTimer:
    """Times decode steps on ``device``: ``start()``/``stop()`` around a step return a token
    that :meth:`seconds` turns into the step's time once its results are on the host."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return (started, event)
        return time.perf_counter() - started

    def seconds(self, token) -> float:
        if self.cuda:
            begin, end = token
            end.synchronize()  # the scheduler has waited for this step's results already
            return begin.elapsed_time(end) / 1000.0
        return token


# The kinds of decode step the gate counts (``sglang:ecospec_gate_<kind>_steps_total``).
STEP_KINDS = ("plain", "narrow", "tree")


def step_kind(level: int, num_steps: int) -> str:
    """The kind of a step of ``level`` draft steps: "plain" (0), "tree" (the configured
    ``num_steps``) or "narrow" (one)."""
    return "plain" if level == PLAIN else "tree" if level == num_steps else "narrow"


class GateMetrics:
    """The gate's Prometheus series: per bucket the gauges (SGLang's scheduler labels plus
    ``batch_sizes``), and a counter of decode steps per kind of :data:`STEP_KINDS` (what the
    serving benchmark prices each phase's steps by)."""

    def __init__(self, labels: dict, *, gauge_cls=None, counter_cls=None, registry=None):
        from prometheus_client import Counter, Gauge

        gauge_cls = gauge_cls or Gauge
        counter_cls = counter_cls or Counter
        extra = {} if registry is None else {"registry": registry}
        self.steps = {
            kind: counter_cls(
                name=f"sglang:ecospec_gate_{kind}_steps",
                documentation=f"EcoSpec utility gate: decode steps run at the {kind} level.",
                labelnames=list(labels),
                **extra,
            ).labels(**labels)
            for kind in STEP_KINDS
        }
        names = [*labels, "batch_sizes"]
        self.labels = labels
        self.open = gauge_cls(
            name="sglang:ecospec_gate_open",
            documentation="EcoSpec utility gate: 1 where the batch-size bucket speculates, 0 "
            "where it decodes plainly.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            **extra,
        )
        self.utility = gauge_cls(
            name="sglang:ecospec_gate_utility",
            documentation="EcoSpec utility gate: measured tokens per second of speculation "
            "over plain decoding's, per batch-size bucket.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            **extra,
        )

    def record(self, bucket: int, state: BucketState) -> None:
        labels = {**self.labels, "batch_sizes": bucket_label(bucket)}
        self.open.labels(**labels).set(1.0 if state.open else 0.0)
        if state.utility == state.utility:  # not NaN
            self.utility.labels(**labels).set(state.utility)


def describe(bucket: int, state: BucketState) -> str:
    """One log line's account of a bucket's decision."""
    decision = f"speculate ({_steps(state.level)})" if state.open else "decode plainly"
    levels = ", ".join(_figures(f) for f in state.speculative)
    return (
        f"EcoSpec gate: batch sizes {bucket_label(bucket)} {decision}: speculation "
        f"{levels}; plain decoding {state.plain_time * 1e3:.1f} ms/step"
    )


def _figures(f: LevelFigures) -> str:
    """A level's figures; what is not yet measured in the bucket is said, not printed as NaN
    (a bucket that inherited a neighbour's tokens per step has not timed their step; log,
    "Run V")."""
    name = _steps(f.steps)
    if f.time != f.time:
        if f.tokens != f.tokens:
            return f"{name} not yet measured here"
        return f"{name} {f.tokens:.2f} tokens/request/step, not yet timed here"
    if f.utility != f.utility:
        return f"{name} at {f.time * 1e3:.1f} ms, utility not yet measured"
    return (
        f"{name} {f.tokens:.2f} tokens/request/step at {f.time * 1e3:.1f} ms "
        f"(utility {f.utility:.2f})"
    )


def _steps(count: int) -> str:
    return f"{count} draft step{'s' if count != 1 else ''}"


def gate_levels(num_steps: int, narrow: bool) -> list[int]:
    """The step counts the gate chooses among: plain decoding, the narrow level when
    ``narrow`` and the configured tree is wider, and the configured ``num_steps``."""
    if num_steps < 1:
        raise ValueError(f"the gate needs --speculative-num-steps >= 1, got {num_steps}")
    return [PLAIN, 1, num_steps] if narrow and num_steps > 1 else [PLAIN, num_steps]


class GatePolicy:
    """SGLang's ``AdaptiveSpecPolicy`` over :class:`UtilityGate`: the step counts of
    :func:`gate_levels` (0: plain decoding).

    Args:
        num_steps: the configured ``--speculative-num-steps`` (> 0).
        options: the gate's :class:`GateOptions`.
        device: the worker's device (step timing).
        group: SGLang's ``GroupCoordinator`` of the TP ranks (more than one), or None.
        narrow: also the narrow level, one draft step (setting ``gate_narrow``).
        memory: ``(file, key)`` of the gate's memory (:mod:`sglang_ecospec.gate_memory`),
            restored now and written by rank 0 at each decision; None: no memory.
    """

    def __init__(
        self, num_steps: int, options: GateOptions, device, group=None, narrow=False, memory=None
    ):
        self.levels = gate_levels(num_steps, narrow)
        self.gate = UtilityGate(options, levels=self.levels, on_change=self._changed)
        self.memory = memory
        if memory is not None:
            for bucket in gate_memory.restore(self.gate, *memory):
                state = self.gate.state(bucket)
                logger.info("%s (restored from %s)", describe(bucket, state), memory[0])
            if group is not None and group.rank != group.ranks[0]:
                self.memory = None  # rank 0 writes it
        self.timer = StepTimer(device)
        self.group = group
        self.metrics: GateMetrics | None = None
        # (batch size, level, timing, stale draft state) of each step awaiting its results;
        # bounded, so steps whose results never come (none are known) cannot pile up.
        self._pending: collections.deque = collections.deque(maxlen=64)
        self._level = self.levels[-1]
        self._batch_size = 0  # of the last decode step: what a prefill's requests join
        self._stale = False
        # Steps per kind not yet in the counters (all of them until the first export).
        self._uncounted = dict.fromkeys(STEP_KINDS, 0)
        self._draft_prefill = True  # the last answer of draft_prefill_needed, logged on change

    # SGLang's AdaptiveSpecPolicy protocol.
    @property
    def candidate_steps(self) -> list[int]:
        return list(self.levels)

    def set_cuda_graph_bs(self, cuda_graph_bs) -> None:
        """Both states serve every batch size: nothing to prune."""

    def cuda_graph_bs_for_step(self, step: int):
        return None

    def get_steps_for_batch(self, batch_size: int) -> int:
        """Called by SGLang before each decode step: this step's level (draft steps)."""
        size = max(batch_size, 1)
        self._batch_size = size
        level = self.gate.level(size)
        if self.group is not None:
            level = self._rank0_int(level)
        self._level = level
        # A speculative probe of a closed bucket drafts from a stale draft state.
        self._stale = level != PLAIN and not self.gate.is_open(size)
        return level

    def on_verify_complete(self, num_correct_drafts_per_req, batch_size: int):
        """Called with each decode step's results on the host: measures the step."""
        if not self._pending:
            return None
        size, level, timing, stale = self._pending.popleft()
        if num_correct_drafts_per_req:
            tokens = 1.0 + sum(num_correct_drafts_per_req) / len(num_correct_drafts_per_req)
            seconds = self.timer.seconds(timing)
            self.gate.record(size, level, seconds, None if stale else tokens)
        return None

    # The worker's side.
    def step_started(self):
        return self.timer.start()

    def step_finished(self, batch_size: int, started) -> None:
        if batch_size > 0:
            timing = self.timer.stop(started)
            self._pending.append((batch_size, self._level, timing, self._stale))
            kind = step_kind(self._level, self.levels[-1])
            if self.metrics is not None:
                self.metrics.steps[kind].inc()
            else:
                self._uncounted[kind] += 1

    def count_steps(self, collector) -> None:
        """Creates the series (``collector``'s labels and metric classes) if needed and adds
        the steps counted on the host so far (with ``--enable-metrics``, after every decode
        step: a run shorter than SGLang's decode log interval is counted too)."""
        if self.metrics is None:
            self.metrics = GateMetrics(
                collector.labels,
                gauge_cls=getattr(collector, "_gauge_cls", None),
                counter_cls=getattr(collector, "_counter_cls", None),
            )
        for kind, count in self._uncounted.items():
            if count:
                self.metrics.steps[kind].inc(count)
        self._uncounted = dict.fromkeys(STEP_KINDS, 0)

    def export(self, collector) -> None:
        """Sets the gauges of every bucket seen (with ``--enable-metrics``, on SGLang's decode
        log ticks), after :meth:`count_steps`."""
        self.count_steps(collector)
        for bucket in self.gate.buckets():
            self.metrics.record(bucket, self.gate.state(bucket))

    def draft_prefill_needed(self, num_requests: int) -> bool:
        """Called before the draft pass of a prefill of ``num_requests`` requests: False when
        the batch they join (the last decode step's and theirs) decodes plainly (rank 0's
        answer on every rank: the draft's forward has collectives too). The last decode
        step's batch may have finished since, so this may judge a larger bucket than the next
        step runs; it is lossless either way (module doc)."""
        needed = self.gate.speculates_at(self._batch_size + max(num_requests, 1))
        if self.group is not None:
            needed = self._rank0_flag(needed)
        if needed != self._draft_prefill:
            self._draft_prefill = needed
            logger.info(
                "EcoSpec gate: %s",
                "the batch a prefill joins speculates: prefills run the draft model"
                if needed
                else "the batch a prefill joins decodes plainly: prefills skip the draft model",
            )
        return needed

    def _rank0_flag(self, value: bool) -> bool:
        return bool(self._rank0_int(int(value)))

    def _rank0_int(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int64)
        torch.distributed.broadcast(flag, src=self.group.ranks[0], group=self.group.cpu_group)
        return int(flag.item())

    def _changed(self, bucket: int, state: BucketState) -> None:
        logger.info(describe(bucket, state))
        if self.memory is not None:
            gate_memory.save(self.gate, *self.memory)
        # The gauges follow each change at once, not only on the next decode log tick, so a
        # scrape never shows a state the log has already left.
        if self.metrics is not None:
            self.metrics.record(bucket, state)


def skip_draft_prefill(worker, policy: GatePolicy) -> None:
    """Wraps ``worker``'s draft prefill (``EAGLEWorkerV2.draft_worker._draft_extend_for_prefill``)
    so that it runs only when ``policy`` needs it; otherwise the next step's draft input is
    the prefill's next tokens with zeroed draft fields of the right shapes, as SGLang's own
    skipped draft extend (``_stub_skipped_draft_extend``) leaves them."""
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.eagle_utils import get_draft_recurrent_hidden_state_spec

    draft_worker = worker.draft_worker
    draft_prefill = draft_worker._draft_extend_for_prefill

    def gated_draft_prefill(batch, target_hidden_states, next_token_ids, *args, **kwargs):
        if policy.draft_prefill_needed(next_token_ids.shape[0]):
            return draft_prefill(batch, target_hidden_states, next_token_ids, *args, **kwargs)
        bs, device = next_token_ids.shape[0], next_token_ids.device
        hidden_size, hidden_dtype = get_draft_recurrent_hidden_state_spec(draft_worker.draft_runner)
        hidden = None
        if hidden_size is not None:
            hidden = torch.zeros((bs, hidden_size), dtype=hidden_dtype, device=device)
        return EagleDraftInput(
            topk_p=torch.zeros((bs, worker.topk), dtype=torch.float32, device=device),
            topk_index=torch.zeros((bs, worker.topk), dtype=torch.int64, device=device),
            hidden_states=hidden,
            bonus_tokens=next_token_ids,
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )

    draft_worker._draft_extend_for_prefill = gated_draft_prefill


def install(
    worker, options: GateOptions, group=None, narrow: bool = False, memory=None
) -> GatePolicy:
    """Gives ``worker`` (an ``EAGLEWorkerV2``, before SGLang's ``init_cuda_graphs``) an
    adaptive controller driven by :class:`GatePolicy` (``memory`` as there); its runtime
    states (one per level of :func:`gate_levels`) are built when SGLang initialises the CUDA
    graphs."""
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

    if os.environ.get(SKIP_DRAFT_EXTEND_ENV) is None:
        os.environ[SKIP_DRAFT_EXTEND_ENV] = "1"
    policy = GatePolicy(worker.speculative_num_steps, options, worker.device, group, narrow, memory)
    worker.adaptive_controller = AdaptiveController(worker, policy)
    skip_draft_prefill(worker, policy)
    logger.info(
        "EcoSpec gate on: per batch-size bucket the fastest measured of draft steps %s (0: "
        "plain decoding; re-probed every %d steps for %d steps)",
        "/".join(map(str, policy.levels)),
        options.probe_interval,
        options.probe_steps,
    )
    return policy
