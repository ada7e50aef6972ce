"""EcoSpec's verify-MoE kernel in the target's verify forwards (setting ``verify_moe_kernel``).

A verify forward carries few tokens (B x verified nodes) spread over many experts, the case
:func:`sgl_ecospec.ops.verify_moe.verify_moe` is written for: it streams each active
expert's weights once. With the setting on, two AROUND hooks route the routed-expert part of
the target's MoE layers through it, during target-verify forwards only:

- on the target model class's ``forward`` (the class of the model SGLang loaded, found at
  start): marks the forward as a target verify when its ``forward_batch.forward_mode`` is
  ``TARGET_VERIFY`` (not draft, extend, plain decode or idle) for the duration of the call.
  Graph runners call the same ``forward`` when they warm up and capture, so a captured
  verify graph gets the same choice as an eager verify forward, and its replays run the
  kernel;
- on ``FusedMoE.run_moe_core`` (the quantisation method's ``apply``: dispatched tokens in,
  combine input out): inside a marked forward, for a target layer SGLang computes with its
  plain Triton runner or the CPU native path, our kernel computes the combine input from the
  layer's own ``w13_weight`` ``[E, 2I, H]`` and ``w2_weight`` ``[E, H, I]`` and the top-k
  weights and ids SGLang's ``TopK`` produced (renormalised, and scaled where SGLang folds the
  scale into them). Everything else (shared experts, the dispatcher's combine, the tensor
  parallel all-reduce) stays SGLang's.

CUDA graphs: the kernel's host side has no host sync and no data-dependent shape, so SGLang's
graph runner captures it in target-verify graphs like any other op (static shapes; padded
rows masked on the device). The one thing a capture must not do is create the layer's
persistent bitmap buffer (``VerifyMoeRoute.loaded_experts``): SGLang's decode/verify graph
backends (``full`` and ``breakable``, ``capture_one``) run two eager warm-up forwards of each
graph before capturing it, and those create it; a layer met for the first time inside a
capture falls back (with its reason logged) instead.
Checked on the CPU (a traced host side replays on new routing, the hook computes under a
simulated capture); the capture on a GPU is checked by ``scripts/gpu_check/graph_check.py``.

Layers the kernel does not cover fall back to SGLang's path, with one warning per reason
saying that SGLang's MoE is used: quantised or wrapped experts (fp8, MXFP4, ...), another
runner (FlashInfer, DeepGEMM, AITER, ...), expert parallelism (DeepEP and other all-to-all
dispatchers, or part of the experts on this rank), LoRA, AMX-packed CPU weights, biases,
activations other than plain SwiGLU, router weights applied on the input, dtypes other than
fp16/bf16/fp32, and bf16 on the CPU (Triton's interpreter multiplies bf16 bit patterns in
``tl.dot``).

``routed_scaling_factor`` is applied where the replaced path applies it: SGLang's Triton
runner multiplies the expert sum by it on a GPU; the CPU native path leaves it to the model.
Padded rows of a graph batch (expert id -1, SGLang's mask) go to the kernel as they are: it
skips them (no expert loaded, no bit set, output rows 0).

Shape legend: T = tokens, H = hidden size, I = expert intermediate size (this rank's part),
E = experts of the layer, K = experts per token.
"""

import logging
import os

import torch

from sgl_ecospec.ops import verify_moe as kernel
from sgl_ecospec.ops.bitmaps import num_words
from sglang_ecospec.hooks import Hook, HookSlot
from sglang_ecospec.settings import EcoSpecSettingsError

logger = logging.getLogger(__name__)

MOE_CORE_TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.run_moe_core"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_device(device) -> None:
    """Raises :class:`EcoSpecSettingsError` unless the kernel can run on ``device``: a CUDA
    device with Triton, or the CPU under Triton's interpreter (the CPU development mode,
    ``scripts/launch_cpu.sh``, sets ``TRITON_INTERPRET=1``)."""
    device = torch.device(device)
    if kernel.triton is None:
        raise EcoSpecSettingsError(
            "verify_moe_kernel needs the triton package (pip install triton)"
        )
    if device.type == "cuda":
        return
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return
        raise EcoSpecSettingsError(
            "verify_moe_kernel on the CPU runs only under Triton's interpreter (the CPU "
            "development mode: scripts/launch_cpu.sh sets TRITON_INTERPRET=1); unset "
            "SGLANG_ECOSPEC_VERIFY_MOE_KERNEL or serve on a CUDA device"
        )
    raise EcoSpecSettingsError(
        f"verify_moe_kernel needs a CUDA device (Triton), got device {device.type!r}"
    )


def model_forward_target(model_cls: type) -> str:
    """HookRegistry path of ``model_cls.forward``."""
    return f"{model_cls.__module__}.{model_cls.__qualname__}.forward"


def unsupported_reason(layer, dispatch_output) -> str | None:
    """Why the kernel cannot compute this ``run_moe_core`` call exactly as SGLang would
    (None: it can).

    Args:
        layer: SGLang's ``FusedMoE``.
        dispatch_output: its ``StandardDispatchOutput`` (or another dispatcher's output).
    """
    from sglang.srt.layers.moe.topk import TopKOutputChecker
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    method = layer.quant_method
    if type(method) is not UnquantizedFusedMoEMethod:
        return (
            f"quantised or wrapped experts ({type(method).__name__}; the kernel reads "
            "unquantised fp16/bf16/fp32 weights, not fp8, MXFP4 or other formats)"
        )
    if not dispatch_output.format.is_standard():
        return (
            f"dispatcher output {dispatch_output.format.value} (expert parallelism with an "
            "all-to-all dispatcher)"
        )
    if not TopKOutputChecker.format_is_standard(dispatch_output.topk_output):
        return f"top-k output {type(dispatch_output.topk_output).__name__}"
    config = layer.moe_runner_config
    if config.num_experts != config.num_local_experts:
        return "expert parallelism (this rank holds part of the experts)"
    backend = layer.runner_backend
    if backend is None or not backend.is_triton():
        return f"MoE runner {getattr(backend, 'value', backend)}"
    if getattr(method.runner, "lora_enabled", False):
        return "LoRA on the experts"
    if getattr(layer, "use_intel_amx_backend", False):
        return "AMX-packed CPU weights"
    if getattr(method, "w13_swiglu_interleaved", False):
        return "interleaved gate/up rows"
    if getattr(layer, "w13_weight_bias", None) is not None:
        return "expert biases"
    if config.activation != "silu" or not config.is_gated:
        return f"activation {config.activation} (gated: {config.is_gated})"
    if any(v is not None for v in (config.gemm1_alpha, config.gemm1_clamp_limit)):
        return "SwiGLU with alpha or clamp"
    if config.swiglu_limit is not None:
        return "SwiGLU limit"
    if config.apply_router_weight_on_input:
        return "router weights applied on the input"
    if config.no_combine:
        return "no_combine"
    if layer.should_fuse_routed_scaling_factor_in_topk:
        return "routed scaling folded into the top-k weights by the runner"
    hidden, w13, w2 = dispatch_output.hidden_states, layer.w13_weight, layer.w2_weight
    if hidden.dtype not in _FLOATS or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        return f"dtypes (hidden {hidden.dtype}, w13 {w13.dtype}, w2 {w2.dtype})"
    if hidden.dtype == torch.bfloat16 and not hidden.is_cuda:
        return "bfloat16 under Triton's interpreter (its tl.dot does not support bfloat16)"
    if (
        hidden.dim() != 2
        or w13.dim() != 3
        or w13.shape[1] % 2
        or w13.shape[2] != hidden.shape[1]
        or tuple(w2.shape) != (w13.shape[0], hidden.shape[1], w13.shape[1] // 2)
    ):
        return f"weight layout (w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)})"
    return None


def capturing(hidden: torch.Tensor) -> bool:
    """Whether ``hidden``'s forward is being captured into a CUDA graph (``hidden``: the
    layer's input; only a CUDA tensor can be)."""
    return hidden.is_cuda and torch.cuda.is_current_stream_capturing()


FIRST_MET_IN_CAPTURE = (
    "CUDA graph capture of a layer no eager verify forward has run (its persistent bitmap "
    "buffer is created in an eager forward, never during a capture)"
)


class VerifyMoeRoute:
    """The target-verify MoE layers of one scheduler process, computed by the kernel.

    Args:
        impl: ``verify_moe``'s ``impl``: "triton" in a server; tests without Triton's
            interpreter pass "reference" to check the routing logic alone.

    Attributes:
        kernel_layers: MoE layer calls the kernel computed (a Python counter, no sync;
            counted when a call runs in Python: eager forwards, warm-ups and captures, not
            graph replays).
        fallbacks: reason -> MoE layer calls of target-verify forwards left to SGLang.
        loaded_experts: layer id -> int64 ``[W]`` (W = ceil(E / 64)): the routing bitmap of
            the layer's last verify computed by the kernel, eager or replayed from a graph
            (the experts its verify tokens were routed to, padded rows excluded): the
            step's per-layer expert set that EcoSpec's buffer works with. Each buffer is
            created by the layer's first eager kernel call and overwritten in place by every
            later one (captured graphs write the same tensor); with two-batch overlap it
            holds the last micro-batch's. Layers that fell back leave theirs unchanged.
    """

    def __init__(self, impl: str = "triton"):
        if impl not in ("triton", "reference"):
            raise ValueError(f"impl must be triton or reference, got {impl!r}")
        self.impl = impl
        self.kernel_layers = 0
        self.fallbacks: dict[str, int] = {}
        self.loaded_experts: dict[int, torch.Tensor] = {}

    def run(self, original, layer, dispatch_output):
        """``run_moe_core`` of a target layer inside a target-verify forward."""
        hidden = dispatch_output.hidden_states
        if hidden.shape[0] == 0:
            return original(layer, dispatch_output)
        reason = unsupported_reason(layer, dispatch_output)
        bitmap = None if reason is not None else self.bitmap_buffer(layer, hidden)
        if reason is None and bitmap is None:
            reason = FIRST_MET_IN_CAPTURE
        if reason is not None:
            if reason not in self.fallbacks:
                logger.warning(
                    "verify_moe_kernel: MoE layer %s runs SGLang's MoE in verify forwards: %s "
                    "(logged once per reason)",
                    layer.layer_id,
                    reason,
                )
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            return original(layer, dispatch_output)
        if self.kernel_layers == 0:
            logger.info(
                "verify_moe_kernel: first verify MoE layer computed by the kernel (layer %s, "
                "%d tokens)",
                layer.layer_id,
                hidden.shape[0],
            )
        self.kernel_layers += 1
        return self.compute(layer, dispatch_output, bitmap)

    def bitmap_buffer(self, layer, hidden: torch.Tensor) -> torch.Tensor | None:
        """``loaded_experts[layer.layer_id]``, created (zeros) at the layer's first call
        outside a capture; None when first met inside a capture (``hidden``: the layer's
        input, for its device)."""
        buffer = self.loaded_experts.get(layer.layer_id)
        if buffer is None and not capturing(hidden):
            words = num_words(layer.w13_weight.shape[0])
            buffer = torch.zeros(words, dtype=torch.int64, device=hidden.device)
            self.loaded_experts[layer.layer_id] = buffer
        return buffer

    def compute(self, layer, dispatch_output, bitmap: torch.Tensor):
        """The combine input SGLang's runner would return, from the kernel, which also
        writes the layer's routing bitmap into ``bitmap`` (int64 ``[W]``, in place).

        ``dispatch_output``: hidden_states ``[T, H]`` (the layer's dtype), topk_output with
        float ``topk_weights [T, K]`` and int ``topk_ids [T, K]`` (-1 on padded rows).
        Returns ``StandardCombineInput`` with hidden_states ``[T, H]`` in hidden's dtype.
        """
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        hidden = dispatch_output.hidden_states
        topk_weights, topk_ids = dispatch_output.topk_output[:2]
        out, _ = kernel.verify_moe(
            hidden,
            layer.w13_weight,
            layer.w2_weight,
            topk_ids,
            topk_weights,
            bitmap_out=bitmap,
            impl=self.impl,
        )
        scale = layer.moe_runner_config.routed_scaling_factor
        if hidden.is_cuda and scale not in (None, 1.0):
            out.mul_(scale)
        return StandardCombineInput(hidden_states=out)


# The route of this process's ECOSPEC worker; empty, both hooks run SGLang's code.
slot: HookSlot[VerifyMoeRoute] = HookSlot("verify-MoE route")
_in_target_verify = False  # inside a target-verify forward of the hooked model class


def around_model_forward(original, model, *args, **kwargs):
    """AROUND hook on the target model class's ``forward``: marks target-verify forwards
    (installed per class: :func:`model_forward_hook`)."""
    global _in_target_verify
    if slot.active() is None:
        return original(model, *args, **kwargs)
    batch = kwargs.get("forward_batch")
    if batch is None:
        batch = next((a for a in args if hasattr(a, "forward_mode")), None)
    mode = getattr(batch, "forward_mode", None)
    outer = _in_target_verify
    _in_target_verify = mode is not None and mode.is_target_verify()
    try:
        return original(model, *args, **kwargs)
    finally:
        _in_target_verify = outer


def model_forward_hook(model_cls: type) -> Hook:
    """:func:`around_model_forward` on ``model_cls.forward``, for ``slot.bind``."""
    return Hook(model_forward_target(model_cls), around_model_forward)


@slot.hook(MOE_CORE_TARGET)
def around_run_moe_core(original, layer, *args, **kwargs):
    """AROUND hook on ``FusedMoE.run_moe_core``: the kernel for target layers in a
    target-verify forward, SGLang's own path otherwise."""
    route = slot.active()
    if route is None or not _in_target_verify or getattr(layer, "is_draft", False):
        return original(layer, *args, **kwargs)
    if len(args) == 1 and not kwargs:
        dispatch_output = args[0]
    elif not args and set(kwargs) == {"dispatch_output"}:
        dispatch_output = kwargs["dispatch_output"]
    else:  # a subclass's extended call (expert-parallel overlap arguments): not ours
        return original(layer, *args, **kwargs)
    return route.run(original, layer, dispatch_output)
