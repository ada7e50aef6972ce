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

Every verify step is checked: each MoE layer's capture sets a device flag
(:attr:`RoutingCapture.written`, cleared before the verify forward), and a step in which any
layer stayed unset is counted on the device (:meth:`VerifyStats.record_capture`); every read of
the statistics logs new misses as an error, and they are a Prometheus counter
(:mod:`sglang_ecospec.metrics`).

Shape legend: T = tokens of a forward, R = buffer rows, L = MoE layers, K = experts per token.
"""

import logging

import torch
from sglang.srt.plugins.hook_registry import HookType

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
        buffer: int64 ``[R, L, K]``: expert ids of the last target forward's first R tokens.
        layer_rows: target layer id -> row of ``buffer``'s L axis.
    """

    def __init__(self, moe_layer_ids: list[int], top_k: int, max_tokens: int, device):
        self.layer_rows = {layer: row for row, layer in enumerate(moe_layer_ids)}
        self.top_k = top_k
        self.buffer = torch.zeros(
            (max_tokens, len(moe_layer_ids), top_k), dtype=torch.int64, device=device
        )
        # [L] bool: which MoE layers were captured since begin_forward (written in-graph).
        self.written = torch.zeros(len(moe_layer_ids), dtype=torch.bool, device=device)
        self.captures = 0  # Python counter: how many layer captures the hook has seen

    @property
    def max_tokens(self) -> int:
        return self.buffer.shape[0]

    def capture(self, layer_id: int | None, topk_ids: torch.Tensor) -> None:
        """Copies ``topk_ids [T, >=K]`` of MoE layer ``layer_id`` into the buffer."""
        row = self.layer_rows.get(layer_id)
        if row is None:
            return
        rows = min(topk_ids.shape[0], self.max_tokens)
        # Routes with fused shared-expert columns append them after the routed K.
        self.buffer[:rows, row].copy_(topk_ids[:rows, : self.top_k])
        self.written[row].fill_(True)
        self.captures += 1

    def begin_forward(self) -> None:
        """Clears the per-layer flags before a forward whose routing must be captured."""
        self.written.zero_()

    def missed(self) -> torch.Tensor:
        """0-d bool on the device: some MoE layer was not captured since
        :meth:`begin_forward` (no host sync)."""
        return ~self.written.all()

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
    the means since its own last read, with one host sync per read.

    Per verify step: the unique experts each MoE layer loaded (the union over the step's
    verify tokens, batch-wide), averaged over layers; and the predictor's top-K recall on the
    step's tokens, measured before it learns from them. Totals are never reset, so several
    readers with different intervals (the "EcoSpec:" line, SGLang's decode log line and
    /metrics) see the same steps without taking them from one another.

    Attributes:
        totals: float64 ``[3]`` on the device: summed unique experts per layer, summed recall,
            verify steps whose routing was not captured for every MoE layer.
        steps: verify steps so far (a Python int: deciding when to read needs no sync).
        tokens: verify tokens so far (a Python int, known on the host).
        missed_reported: uncaptured steps already logged as an error (host, as of a read).
    """

    def __init__(self, num_experts: int, device):
        self.num_experts = num_experts
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)
        self.steps = 0
        self.tokens = 0
        self.missed_reported = 0

    def record_capture(self, missed: torch.Tensor) -> None:
        """Counts a verify step whose routing was not fully captured (``missed``: 0-d bool
        on the device, :meth:`RoutingCapture.missed`; no host sync)."""
        self.totals[2] += missed.to(torch.float64)

    def report_missed(self, total_missed: float) -> None:
        """Logs, once, the uncaptured verify steps a read found since the last report."""
        missed = round(total_missed)
        if missed > self.missed_reported:
            logger.error(
                "ECOSPEC: the target's routing was not captured in %d verify step(s) (%d since "
                "start): the predictor learns from, and the statistics measure, stale rows. "
                "This model's MoE path or --moe-runner-backend bypasses SGLang's routing "
                "capture; serve with another --moe-runner-backend, or EAGLE3",
                missed - self.missed_reported,
                missed,
            )
            self.missed_reported = missed

    def update(self, routing: torch.Tensor, predicted: torch.Tensor) -> None:
        """``routing`` int64 ``[T, L, K]``: the experts of this step's T verify tokens;
        ``predicted`` int64 ``[T, L, K]``: what the predictor said before the step."""
        from sgl_ecospec.predictors import multi_hot

        num_tokens, layers, top_k = routing.shape
        union = torch.zeros((layers, self.num_experts), device=routing.device)  # [L, E]
        union.scatter_(1, routing.transpose(0, 1).reshape(layers, -1), 1.0)
        unique = union.sum() / layers
        truth = multi_hot(routing, self.num_experts, validate=False)  # [T, L, E]
        recall = truth.gather(-1, predicted).sum() / (num_tokens * layers * top_k)
        self.totals[:2] += torch.stack((unique, recall)).to(torch.float64)
        self.steps += 1
        self.tokens += num_tokens

    def window(self) -> "StatsWindow":
        """A new reader whose first window starts now."""
        return StatsWindow(self)


class StatsWindow:
    """One reader of :class:`VerifyStats`: means over the verify steps since its last read."""

    def __init__(self, stats: VerifyStats):
        self.stats = stats
        self._steps = stats.steps
        self._tokens = stats.tokens
        self._totals = stats.totals.tolist()

    @property
    def pending_steps(self) -> int:
        """Verify steps since the last read (no sync)."""
        return self.stats.steps - self._steps

    def read(self) -> dict | None:
        """Means over the window (one host sync) and start of the next window; None, without
        a sync, when no verify step ran since the last read.

        Returns:
            ``verify_steps``, ``unique_experts_per_layer`` (per verify step, mean over MoE
            layers), ``predictor_recall``, ``verify_tokens_per_step``,
            ``capture_missed_steps`` (verify steps whose routing was not captured; new ones
            are logged as an error, once across readers).
        """
        steps = self.pending_steps
        if steps <= 0:
            return None
        totals = self.stats.totals.tolist()
        unique, recall, missed = (
            now - before for now, before in zip(totals, self._totals, strict=True)
        )
        summary = {
            "verify_steps": steps,
            "unique_experts_per_layer": unique / steps,
            "predictor_recall": recall / steps,
            "verify_tokens_per_step": (self.stats.tokens - self._tokens) / steps,
            "capture_missed_steps": round(missed),
        }
        self.stats.report_missed(totals[2])
        self._steps, self._tokens, self._totals = self.stats.steps, self.stats.tokens, totals
        return summary
