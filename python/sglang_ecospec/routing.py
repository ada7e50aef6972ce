"""Capture of the target's routing during the verify pass, for the online expert predictor.

SGLang calls ``sglang.srt.layers.moe.topk.capture_routed_experts_if_allowed(topk_config,
layer_id, topk_ids)`` once per MoE layer of every target forward, with the top-k expert ids
of every token (``[T, K]``). :func:`after_capture` (an AFTER hook on it) copies them into one
preallocated buffer ``[R, L, K]`` (R rows = the most verify tokens a step can have):

- graph-safe: a static-shape ``copy_`` into a persistent buffer, no host sync, no allocation,
  so a CUDA graph captured around the target forward replays it;
- written on every target forward (prefill, verify): after the verify forward of a step, its
  first ``B * D`` rows hold the verify tokens' routing for every MoE layer, aligned with
  ``EagleVerifyInput.draft_token``. The worker reads them right after verify, before the next
  target forward.

SGLang's ``TopK`` calls that capture site only for its standard output. With the MoE runners
that route inside their kernel it returns a ``TritonKernelTopKOutput`` (``triton_kernel``,
GPT-OSS's default runner with EP 1) or a ``BypassedTopKOutput`` (FlashInfer TRT-LLM, mxfp4)
and never calls it, so :func:`around_topk` (an AROUND hook on ``TopK.forward`` and
``TopK.forward_cuda``) materialises such routing with SGLang's own ``select_experts`` (the
routing the kernel computes from the same logits and config), which calls the capture site;
SGLang's expert-distribution recorder is switched off meanwhile, so nothing is counted twice.

Every verify step is checked: the buffer is filled with -1 before the verify forward
(:meth:`RoutingCapture.begin_forward`), so a verify token row of a MoE layer that SGLang did
not capture still holds -1 afterwards, and :meth:`VerifyStats.update` counts such a step on
the device; every read of the statistics logs new misses as an error, and they are a
Prometheus counter (:mod:`sglang_ecospec.metrics`). One ``copy_`` per MoE layer is all the
capture adds to a target forward.

After each verify the worker measures the step (:meth:`VerifyStats.update`: a few kernels on
``[T, L, K]``, no ``[T, L, E]`` temporary, no host sync). The totals stay on the device; they
reach the host only when read: SGLang's decode log line and /metrics read them once per
``--decode-log-interval`` (:meth:`StatsWindow.read`, one host sync), and the "EcoSpec:" line
takes an asynchronous snapshot (:meth:`StatsWindow.request`, a device -> pinned host copy and
an event) that it logs once the copy has landed (:meth:`StatsWindow.ready`, never waiting).

Shape legend: T = tokens of a forward, R = buffer rows, L = MoE layers, K = experts per token.
"""

import logging
from typing import NamedTuple

import torch
from sglang.srt.plugins.hook_registry import HookType

from sglang_ecospec.acceptance import window_summary
from sglang_ecospec.hooks import HookSlot

logger = logging.getLogger(__name__)

CAPTURE_TARGET = "sglang.srt.layers.moe.topk.capture_routed_experts_if_allowed"


def text_config(hf_config):
    """The language model's config (multimodal configs nest it as ``text_config``)."""
    return getattr(hf_config, "text_config", None) or hf_config


def moe_layout(hf_config) -> tuple[list[int], int, int]:
    """(MoE layer ids, routed experts per layer, experts per token) of a target config.

    Knows the Qwen2/Qwen3-MoE fields (``num_experts``, ``mlp_only_layers``,
    ``decoder_sparse_step``), DeepSeek's (``n_routed_experts``, ``first_k_dense_replace``,
    ``moe_layer_freq``) and Mixtral's (``num_local_experts``).

    Raises:
        ValueError: the config describes no MoE model.
    """
    config = text_config(hf_config)
    num_experts = next(
        (
            getattr(config, name)
            for name in ("num_experts", "n_routed_experts", "num_local_experts")
            if getattr(config, name, None)
        ),
        None,
    )
    top_k = getattr(config, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        raise ValueError(
            "ECOSPEC needs a Mixture-of-Experts target: the model config has no "
            "num_experts/n_routed_experts/num_local_experts and num_experts_per_tok"
        )
    layers = config.num_hidden_layers
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", None) or 1
    first_moe = getattr(config, "first_k_dense_replace", None) or 0
    freq = getattr(config, "moe_layer_freq", None) or 1
    ids = [
        i
        for i in range(layers)
        if i not in dense and (i + 1) % step == 0 and i >= first_moe and (i - first_moe) % freq == 0
    ]
    return ids, int(num_experts), int(top_k)


class RoutingCapture:
    """The verify pass's routing, written by the capture hook.

    Attributes:
        buffer: int64 ``[R, L, K]``: expert ids of the last target forward's first R tokens;
            -1 where nothing was captured since :meth:`begin_forward`.
        layer_rows: target layer id -> row of ``buffer``'s L axis.
    """

    def __init__(self, moe_layer_ids: list[int], top_k: int, max_tokens: int, device):
        self.layer_rows = {layer: row for row, layer in enumerate(moe_layer_ids)}
        self.top_k = top_k
        self.buffer = torch.full(
            (max_tokens, len(moe_layer_ids), top_k), -1, dtype=torch.int64, device=device
        )

    @property
    def max_tokens(self) -> int:
        return self.buffer.shape[0]

    def capture(self, layer_id: int | None, topk_ids: torch.Tensor) -> None:
        """Copies ``topk_ids [T, >=K]`` of MoE layer ``layer_id`` into the buffer (one
        kernel, graph-safe; no Python state changes, so a compiled forward that inlines the
        hook is not recompiled per call)."""
        row = self.layer_rows.get(layer_id)
        if row is None:
            return
        rows = min(topk_ids.shape[0], self.max_tokens)
        # Routes with fused shared-expert columns append them after the routed K.
        self.buffer[:rows, row].copy_(topk_ids[:rows, : self.top_k])

    def begin_forward(self) -> None:
        """Marks every row uncaptured (-1) before a forward whose routing must be captured."""
        self.buffer.fill_(-1)

    def captured_layers(self, num_tokens: int) -> torch.Tensor:
        """bool ``[L]``: the MoE layers whose first ``num_tokens`` rows were all captured
        since :meth:`begin_forward` (for tests and diagnostics; a host read follows)."""
        return self.buffer[:num_tokens].ge(0).flatten(2).all(-1).all(0)

    def verify_routing(self, num_tokens: int) -> torch.Tensor:
        """``[num_tokens, L, K]`` view of the last forward's first tokens (no copy)."""
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"{num_tokens} verify tokens exceed the routing buffer ({self.max_tokens} rows)"
            )
        return self.buffer[:num_tokens]


# The capture of this process's ECOSPEC worker; empty, the hook only returns SGLang's result.
slot: HookSlot[RoutingCapture] = HookSlot("routing capture")


@slot.hook(CAPTURE_TARGET, HookType.AFTER)
def after_capture(result, topk_config, layer_id, topk_ids, *args, **kwargs):
    """AFTER hook on ``capture_routed_experts_if_allowed``: feeds ``topk_ids`` (int ``[T,
    >=K]``) to the active capture; SGLang's ``result`` is returned unchanged.

    Honors the per-config opt-out SGLang sets for draft models' MoE layers.
    """
    capture = slot.active()
    if capture is not None and getattr(topk_config, "allow_routed_experts_capture", True):
        capture.capture(layer_id, topk_ids)
    return result


TOPK_TARGET = "sglang.srt.layers.moe.topk.TopK"
_topk_depth = 0  # nesting of hooked TopK calls (forward may dispatch to the hooked forward_cuda)


@slot.hook(f"{TOPK_TARGET}.forward_cuda")
@slot.hook(f"{TOPK_TARGET}.forward")
def around_topk(original, topk, *args, **kwargs):
    """AROUND hook on ``TopK.forward`` and ``TopK.forward_cuda`` (DeepSeek's TRT-LLM path
    calls the latter directly): SGLang's output, returned unchanged; with an active capture,
    the outermost call materialises routing that SGLang did not capture."""
    global _topk_depth
    _topk_depth += 1
    try:
        output = original(topk, *args, **kwargs)
    finally:
        _topk_depth -= 1
    if _topk_depth == 0 and slot.active() is not None:
        materialize_routing(topk, output, *args, **kwargs)
    return output


def materialize_routing(topk, output, hidden_states=None, router_logits=None, *_, **kwargs):
    """Runs SGLang's ``select_experts`` for a ``TopK`` output that carries no top-k ids
    (``TritonKernelTopKOutput``, ``BypassedTopKOutput``), so that its capture site sees this
    layer's routing; standard outputs were captured already and are left alone.

    A bypassed output that keeps expert-location remapping is skipped: SGLang's runners must
    materialise it themselves (the output refuses to hand out its logits then), which captures.
    """
    from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
    from sglang.srt.layers.moe.topk import (
        BypassedTopKOutput,
        TritonKernelTopKOutput,
        select_experts,
    )

    config = getattr(topk, "topk_config", None)
    if config is None or not config.allow_routed_experts_capture:
        return
    if isinstance(output, BypassedTopKOutput):
        if output.expert_location_dispatch_info is not None:
            return
        materialize = output.to_standard
    elif isinstance(output, TritonKernelTopKOutput):

        def materialize():
            return select_experts(
                hidden_states=kwargs.get("hidden_states", hidden_states),
                router_logits=kwargs.get("router_logits", router_logits),
                topk_config=config,
                layer_id=topk.layer_id,
            )

    else:
        return
    with get_global_expert_distribution_recorder().disable_this_region():
        materialize()


class VerifyStats:
    """Device-side running totals over verify steps; each reader (:class:`StatsWindow`) takes
    the means since its own last read.

    Per verify step: the unique experts each MoE layer loaded (the union over the step's
    verify tokens, batch-wide); the predictor's hits per MoE layer (predicted top-K ids among
    the true ones, measured before it learns from them); whether some verify row of some MoE
    layer was not captured. Totals are never reset, so several readers with different
    intervals (the "EcoSpec:" line, SGLang's decode log line and /metrics) see the same steps
    without taking them from one another.

    Args:
        num_experts: E.
        device: where the totals live.
        layer_ids: the target's MoE layer ids, in the routing's L order (the per-layer
            recall is reported under them).
        acceptance: float64 ``[3]`` or None: ``AcceptanceTracker.totals`` (calibrated
            acceptance), copied with the totals; each summary then carries the forecast and
            measured acceptance length (:func:`sglang_ecospec.acceptance.window_summary`).

    Attributes:
        totals: int64 ``[2 + L]`` on the device: unique experts summed over layers and
            steps, verify steps whose routing was not fully captured, then the predictor hits
            of each MoE layer.
        steps, tokens: verify steps and tokens so far (Python ints: deciding when to read
            needs no sync).
        layer_steps, slots: the host-side denominators, MoE layers x steps and
            tokens x layers x K.
        missed_reported: uncaptured steps already logged as an error (host, as of a read).
    """

    def __init__(
        self,
        num_experts: int,
        device,
        *,
        layer_ids: list[int],
        acceptance: torch.Tensor | None = None,
    ):
        self.num_experts = num_experts
        # Calibrated acceptance's own device totals (float64 [3]), read with these.
        self.acceptance = acceptance
        self.layer_ids = list(layer_ids)
        layers = len(self.layer_ids)
        self.totals = torch.zeros(2 + layers, dtype=torch.int64, device=device)
        # totals += (unique, clamp(min id, max=0), layer hits) * (1, -1, 1): one kernel.
        self._signs = torch.ones(2 + layers, dtype=torch.int64, device=device)
        self._signs[1] = -1
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self._layer_index = torch.arange(layers, device=device).view(1, layers, 1)
        self.steps = 0
        self.tokens = 0
        self.layer_steps = 0
        self.slots = 0
        self.missed_reported = 0

    def update(self, routing: torch.Tensor, predicted: torch.Tensor) -> None:
        """Adds one verify step (no host sync, no ``[T, L, E]`` temporary).

        Args:
            routing: int64 ``[T, L, K]``: the experts of the step's T verify tokens, -1 in
                rows that were not captured (:meth:`RoutingCapture.begin_forward`).
            predicted: int ``[T, L, K]``: what the predictor said before the step (distinct
                ids per row, as ``topk`` gives them).
        """
        num_tokens, layers, top_k = routing.shape
        if layers != self._layer_index.shape[1]:
            raise ValueError(
                f"routing covers {layers} MoE layers, the statistics {self._layer_index.shape[1]}"
            )
        union = torch.zeros((layers, self.num_experts), dtype=torch.bool, device=routing.device)
        # [L, E]; an uncaptured row's -1 marks expert E-1 (such a step is counted as missed).
        union.index_put_((self._layer_index, routing), self._true)
        # Routing ids are distinct per row, so equal pairs count the hits; -1 never hits.
        layer_hits = (predicted[..., :, None] == routing[..., None, :]).sum((0, 2, 3))  # [L]
        missed = routing.amin().clamp(max=0)  # -1: some row was not captured
        step = torch.cat((union.sum()[None], missed[None], layer_hits))
        self.totals.addcmul_(step, self._signs)
        self.steps += 1
        self.tokens += num_tokens
        self.layer_steps += layers
        self.slots += num_tokens * layers * top_k

    def report_missed(self, total_missed: int) -> None:
        """Logs, once, the uncaptured verify steps a read found since the last report."""
        if total_missed > self.missed_reported:
            logger.error(
                "ECOSPEC: the target's routing was not captured in %d verify step(s) (%d since "
                "start): the predictor learns from, and the statistics measure, stale rows. "
                "This model's MoE path or --moe-runner-backend bypasses SGLang's routing "
                "capture; serve with another --moe-runner-backend, or EAGLE3",
                total_missed - self.missed_reported,
                total_missed,
            )
            self.missed_reported = total_missed

    def window(self, timer=None) -> "StatsWindow":
        """A new reader whose first window starts now; ``timer`` (a
        :class:`sglang_ecospec.metrics.PredictTimer`, or None) adds the prediction time."""
        return StatsWindow(self, timer)


class _Mark(NamedTuple):
    """The host-side counters at one read, and the device totals (a host tensor, filled once
    ``event`` has completed; None: already there)."""

    steps: int
    tokens: int
    layer_steps: int
    slots: int
    totals: torch.Tensor
    event: object = None
    acceptance: torch.Tensor | None = None  # host copy of VerifyStats.acceptance


class StatsWindow:
    """One reader of :class:`VerifyStats`: means over the verify steps since its last read.

    Either synchronous (:meth:`read`, one host sync per read: SGLang's decode log line and
    /metrics) or asynchronous (:meth:`request` then :meth:`ready`: the "EcoSpec:" line); a
    window uses one of the two. With a ``timer`` (:class:`sglang_ecospec.metrics.PredictTimer`)
    the summaries also carry the prediction time of the steps timed since the last one.
    """

    def __init__(self, stats: VerifyStats, timer=None):
        self.stats = stats
        self.timer = timer
        self._base = self._requested = self._mark(stats.totals.cpu())  # startup: one read
        self._base_totals = self._base.totals.tolist()
        self._timer_base = timer.totals() if timer is not None else (0.0, 0)
        self._pending: list[_Mark] = []
        accepted = stats.acceptance
        self._acceptance_base = None if accepted is None else accepted.tolist()

    def _mark(self, totals: torch.Tensor, event=None, acceptance=None) -> _Mark:
        s = self.stats
        return _Mark(s.steps, s.tokens, s.layer_steps, s.slots, totals, event, acceptance)

    @property
    def pending_steps(self) -> int:
        """Verify steps since the last read or request (no sync)."""
        return self.stats.steps - self._requested.steps

    def read(self) -> dict | None:
        """Means over the window (one host sync) and start of the next window; None, without
        a sync, when no verify step ran since the last read.

        Returns:
            ``verify_steps``, ``unique_experts_per_layer`` (per verify step, mean over MoE
            layers), ``predictor_recall`` (over the window's verify tokens),
            ``predictor_recall_per_layer`` (MoE layer id -> recall over the same tokens),
            ``verify_tokens_per_step``, ``capture_missed_steps`` (verify steps whose routing
            was not captured; new ones are logged as an error, once across readers),
            ``predict_ms_per_step`` (mean milliseconds of the predictions timed since the
            last read; None without a timer or when none was timed).
        """
        if self.pending_steps <= 0:
            return None
        accepted = self.stats.acceptance
        mark = self._mark(
            self.stats.totals.cpu(), None, None if accepted is None else accepted.cpu()
        )
        self._requested = mark
        return self._summary(mark)

    def request(self) -> None:
        """Starts an asynchronous read of the window (a device -> pinned host copy and an
        event on the current stream; no host sync): :meth:`ready` returns it once there."""
        totals = self.stats.totals
        event = None
        host, accepted = host_copy(totals), host_copy(self.stats.acceptance)
        if totals.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._requested = self._mark(host, event, accepted)
        self._pending.append(self._requested)

    def ready(self) -> list[dict]:
        """The summaries (as :meth:`read`'s) of the requested reads whose copy has landed,
        oldest first; never waits."""
        done = []
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            done.append(self._summary(self._pending.pop(0)))
        return done

    def _summary(self, mark: _Mark) -> dict:
        """:meth:`_advance`'s summary, plus calibrated acceptance's forecast and measured
        acceptance length over the same steps when it is on."""
        summary = self._advance(mark)
        if mark.acceptance is not None:
            now = mark.acceptance.tolist()
            summary.update(window_summary(self._acceptance_base, now))
            self._acceptance_base = now
        return summary

    def _advance(self, mark: _Mark) -> dict:
        """The summary from the base to ``mark`` (whose host totals are there), which becomes
        the base."""
        now = mark.totals.tolist()
        base, before = self._base, self._base_totals
        self._base, self._base_totals = mark, now
        unique, missed, *layer_hits = (a - b for a, b in zip(now, before, strict=True))
        hits = sum(layer_hits)
        steps = mark.steps - base.steps
        self.stats.report_missed(now[1])
        layer_slots = max(1, (mark.slots - base.slots) // max(1, len(layer_hits)))
        return {
            "verify_steps": steps,
            "unique_experts_per_layer": unique / max(1, mark.layer_steps - base.layer_steps),
            "predictor_recall": hits / max(1, mark.slots - base.slots),
            "predictor_recall_per_layer": {
                layer: layer_hit / layer_slots
                for layer, layer_hit in zip(self.stats.layer_ids, layer_hits, strict=True)
            },
            "verify_tokens_per_step": (mark.tokens - base.tokens) / max(1, steps),
            "capture_missed_steps": missed,
            "predict_ms_per_step": self._predict_ms(),
        }

    def _predict_ms(self) -> float | None:
        if self.timer is None:
            return None
        (seconds, timed), (seconds_before, timed_before) = self.timer.totals(), self._timer_base
        self._timer_base = (seconds, timed)
        if timed == timed_before:
            return None
        return 1e3 * (seconds - seconds_before) / (timed - timed_before)


def host_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A host copy of a device tensor: pinned and asynchronous from a CUDA device (valid once
    a later event completes), a clone on the CPU; None for None."""
    if tensor is None or not tensor.is_cuda:
        return None if tensor is None else tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
