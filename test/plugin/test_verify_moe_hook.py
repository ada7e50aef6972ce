"""The verify-MoE kernel inside SGLang's MoE layers (setting ``verify_moe_kernel``).

The layer checks build real SGLang ``FusedMoE`` and ``TopK`` layers (a one-process gloo
group, as SGLang's own layer tests do) and run the kernel under Triton's interpreter, which
must be switched on before triton is imported: they run in a fresh interpreter, all in one
(starting SGLang's parallel state takes about 10 s).
"""

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import hooks, verify_moe_hook
from sglang_ecospec.settings import EcoSpecSettings, EcoSpecSettingsError

HERE = os.path.dirname(os.path.abspath(__file__))


def test_setting_is_off_by_default_and_read_from_the_environment():
    assert EcoSpecSettings().verify_moe_kernel is False
    env = {"SGLANG_ECOSPEC_VERIFY_MOE_KERNEL": "1"}
    assert EcoSpecSettings.from_env(env).verify_moe_kernel is True
    with pytest.raises(EcoSpecSettingsError, match="VERIFY_MOE_KERNEL='maybe' is not a valid"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_VERIFY_MOE_KERNEL": "maybe"})


def test_device_check(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EcoSpecSettingsError, match="CPU development mode"):
        verify_moe_hook.check_device("cpu")
    with pytest.raises(EcoSpecSettingsError, match="needs a CUDA device"):
        verify_moe_hook.check_device("meta")
    verify_moe_hook.check_device("cuda")  # Triton is installed
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    verify_moe_hook.check_device("cpu")
    monkeypatch.setattr(verify_moe_hook.kernel, "triton", None)
    with pytest.raises(EcoSpecSettingsError, match="needs the triton package"):
        verify_moe_hook.check_device("cuda")


def test_runtime_refuses_the_kernel_where_it_cannot_run(monkeypatch):
    from sglang_ecospec import routing, selection
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    settings = EcoSpecSettings(verify_moe_kernel=True)
    with pytest.raises(EcoSpecSettingsError, match="Triton's interpreter"):
        EcoSpecRuntime(settings, config, topk=2, num_draft_tokens=3, max_batch=2, device="cpu")
    # Refused before anything was activated.
    assert selection.slot.active() is None and routing.slot.active() is None
    assert verify_moe_hook.slot.active() is None


def test_model_forward_hook_marks_only_target_verify_forwards():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    seen = []

    def forward(model, hidden, forward_batch):
        seen.append(verify_moe_hook._in_target_verify)
        return hidden

    verify_moe_hook.slot.activate(verify_moe_hook.VerifyMoeRoute("reference"))
    try:
        for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DECODE, ForwardMode.EXTEND):
            batch = SimpleNamespace(forward_mode=mode)
            verify_moe_hook.around_model_forward(forward, None, 0, batch)
            verify_moe_hook.around_model_forward(forward, None, 0, forward_batch=batch)
    finally:
        verify_moe_hook.slot.activate(None)
    verify_moe_hook.around_model_forward(
        forward, None, 0, SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    )
    assert seen == [True, True, False, False, False, False, False]
    assert verify_moe_hook._in_target_verify is False


def test_capture_test_asks_cuda_only_for_cuda_tensors(monkeypatch):
    def stream_capturing():
        calls.append(1)
        return state

    calls, state = [], True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", stream_capturing)
    assert verify_moe_hook.capturing(SimpleNamespace(is_cuda=True)) is True
    state = False
    assert verify_moe_hook.capturing(SimpleNamespace(is_cuda=True)) is False
    assert verify_moe_hook.capturing(torch.zeros(1)) is False and len(calls) == 2


def test_quantised_and_all_to_all_layers_log_once_that_sglangs_moe_is_used(caplog):
    # fp8 and MXFP4 experts and an EP all-to-all dispatcher (DeepEP) run SGLang's MoE; the
    # log says so once per reason, however many layers and steps meet it.
    from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputFormat
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    def layer(method_cls, layer_id):  # the method's class is all the check reads first
        return SimpleNamespace(quant_method=object.__new__(method_cls), layer_id=layer_id)

    def dispatch(fmt):
        return SimpleNamespace(hidden_states=torch.zeros(3, 8), format=fmt, topk_output=None)

    standard, deepep = DispatchOutputFormat.STANDARD, DispatchOutputFormat.DEEPEP_LL
    cases = [
        (layer(Fp8MoEMethod, 1), dispatch(standard), ["Fp8MoEMethod", "fp8, MXFP4"]),
        (layer(Mxfp4MoEMethod, 2), dispatch(standard), ["Mxfp4MoEMethod", "fp8, MXFP4"]),
        (layer(UnquantizedFusedMoEMethod, 3), dispatch(deepep), ["deepep_ll", "all-to-all"]),
    ]
    route = verify_moe_hook.VerifyMoeRoute("reference")
    sglang_result = object()
    with caplog.at_level("WARNING", logger=verify_moe_hook.logger.name):
        for _ in range(2):  # a second step: no new line
            for moe_layer, dispatch_output, _words in cases:
                got = route.run(lambda *a: sglang_result, moe_layer, dispatch_output)
                assert got is sglang_result
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(cases) and route.kernel_layers == 0
    for line, (moe_layer, _, words) in zip(lines, cases, strict=True):
        assert line.startswith(
            f"verify_moe_kernel: MoE layer {moe_layer.layer_id} runs SGLang's MoE"
        )
        assert all(w in line for w in words), line
    assert sorted(route.fallbacks.values()) == [2, 2, 2] and route.loaded_experts == {}


# --- real SGLang layers, in a child process under Triton's interpreter ----------------------


class TinyMoeModel(torch.nn.Module):
    """Stands in for the target model class: router, SGLang's TopK, SGLang's FusedMoE."""

    def __init__(self, experts, topk, num_experts, hidden_size, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.experts, self.topk = experts, topk
        self.router = torch.randn(num_experts, hidden_size, generator=gen)

    def forward(self, hidden, forward_batch, topk_output=None):
        if topk_output is None:
            logits = hidden.float() @ self.router.t()
            topk_output = self.topk(hidden, logits)
        return self.experts(hidden, topk_output)


# The FusedMoE every test layer has (its constructor's keywords).
LAYER_SHAPE = dict(num_experts=16, hidden_size=64, intermediate_size=32, top_k=4)


def build_layer(*, dtype=torch.float32, seed=0, **kwargs):
    """A real FusedMoE of ``LAYER_SHAPE`` (random weights in SGLang's layout; ``kwargs``:
    more of its keywords) inside a TinyMoeModel."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import TopK

    layer = FusedMoE(**LAYER_SHAPE, layer_id=seed, params_dtype=dtype, **kwargs)
    num_experts, hidden, inter, top_k = LAYER_SHAPE.values()
    gen = torch.Generator().manual_seed(seed)
    layer.w13_weight.data.copy_(torch.randn(layer.w13_weight.shape, generator=gen) / hidden**0.5)
    layer.w2_weight.data.copy_(torch.randn(layer.w2_weight.shape, generator=gen) / inter**0.5)
    topk = TopK(top_k=top_k, renormalize=seed % 2 == 0, layer_id=seed)
    return TinyMoeModel(layer, topk, num_experts, hidden, seed)


def layer_checks() -> dict:
    """Runs in the child: every check's facts, as JSON-ready values."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.layer_ut_utils import init_single_process_dist

    from sgl_ecospec.ops.verify_moe import verify_moe_reference

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_single_process_dist(master_port=port)
    verify_moe_hook.check_device("cpu")
    route = verify_moe_hook.VerifyMoeRoute()
    forward = verify_moe_hook.model_forward_hook(TinyMoeModel)
    hooks.activate([verify_moe_hook.slot.bind(route, forward)])
    assert verify_moe_hook.slot.active() is route and route.impl == "triton"

    def run(model, x, mode, **kwargs):
        with torch.no_grad():
            return model(x, SimpleNamespace(forward_mode=mode), **kwargs)

    def sglang(model, x, **kwargs):  # SGLang's own path: no route active
        verify_moe_hook.slot.activate(None)
        try:
            return run(model, x, ForwardMode.TARGET_VERIFY, **kwargs)
        finally:
            verify_moe_hook.slot.activate(route)

    facts = {}
    gen = torch.Generator().manual_seed(1)
    for name, dtype, tokens in (("fp32", torch.float32, 7), ("fp16", torch.float16, 5)):
        model = build_layer(dtype=dtype, seed=len(facts))
        x = torch.randn(tokens, 64, generator=gen).to(dtype)
        expected = sglang(model, x)
        before = route.kernel_layers
        got = run(model, x, ForwardMode.TARGET_VERIFY)
        facts[name] = {
            "kernel_layers": route.kernel_layers - before,
            "max_err": (got.float() - expected.float()).abs().max().item(),
            "scale": expected.float().abs().max().item(),
            "dtype": str(got.dtype),
        }
        untouched = {}
        for mode in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND_V2):
            before = route.kernel_layers
            out = run(model, x, mode)
            untouched[mode.name] = [route.kernel_layers - before, torch.equal(out, expected)]
        before = route.kernel_layers
        with torch.no_grad():  # a call outside any hooked forward
            out = model.experts(x, model.topk(x, x.float() @ model.router.t()))
        untouched["no_forward"] = [route.kernel_layers - before, torch.equal(out, expected)]
        facts[name]["untouched"] = untouched

    # routed_scaling_factor: on the CPU SGLang's native path leaves it to the model, and so
    # does the kernel (on a GPU both multiply).
    model = build_layer(seed=2, routed_scaling_factor=2.5)
    x = torch.randn(4, 64, generator=gen)
    expected, got = sglang(model, x), run(model, x, ForwardMode.TARGET_VERIFY)
    facts["scaled"] = (got - expected).abs().max().item()

    # Layers the kernel does not cover fall back to SGLang's path, with a reason: another
    # activation; bf16 on the CPU (Triton's interpreter gets bf16 dots wrong).
    for name, kwargs, dtype in (
        ("gelu", {"activation": "gelu"}, torch.float32),
        ("bf16", {}, torch.bfloat16),
    ):
        model = build_layer(seed=3, dtype=dtype, **kwargs)
        expected = sglang(model, x.to(dtype))
        before, reasons = route.kernel_layers, dict(route.fallbacks)
        got = run(model, x.to(dtype), ForwardMode.TARGET_VERIFY)
        facts[name] = {
            "kernel_layers": route.kernel_layers - before,
            "equal": torch.equal(got, expected),
            "new_fallbacks": {k: v - reasons.get(k, 0) for k, v in route.fallbacks.items()},
        }

    # A draft model's layer is never routed.
    model = build_layer(seed=4)
    model.experts.is_draft = True
    expected = sglang(model, x)
    before = route.kernel_layers
    got = run(model, x, ForwardMode.TARGET_VERIFY)
    facts["draft"] = [route.kernel_layers - before, torch.equal(got, expected)]

    # Padded rows of a graph batch (ids -1): zero rows, the rest as the reference, and the
    # padding loads no expert.
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    model = build_layer(seed=5)
    x = torch.randn(5, 64, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(5)]).int()
    weights = torch.rand(5, 4, generator=gen)
    ids[3:] = -1
    topk_output = StandardTopKOutput(weights, ids, torch.zeros(5, 16))
    got = run(model, x, ForwardMode.TARGET_VERIFY, topk_output=topk_output)
    w13, w2 = model.experts.w13_weight.data, model.experts.w2_weight.data
    ref, ref_bitmap = verify_moe_reference(x[:3], w13, w2, ids[:3], weights[:3])
    facts["padded"] = {
        "real_err": (got[:3] - ref).abs().max().item(),
        "padded_zero": bool((got[3:] == 0).all()),
        "ids_untouched": bool((ids[3:] == -1).all()),
        # The layer's persistent bitmap: the real rows' experts, the padding none.
        "bitmap": route.loaded_experts[5].tolist() == ref_bitmap.tolist(),
    }
    facts["capture"] = capture_checks(route, run, sglang, gen)
    return facts


def capture_checks(route, run, sglang, gen) -> dict:
    """A layer met first inside a (simulated) CUDA-graph capture, then after an eager
    warm-up: the capture test is made to say True, as it does on a GPU while SGLang's graph
    runner captures a verify graph (a CPU tensor is never really captured)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_ecospec.ops.verify_moe import verify_moe_reference

    model = build_layer(seed=6)
    w13, w2 = model.experts.w13_weight.data, model.experts.w2_weight.data
    xs = [torch.randn(6, 64, generator=gen) for _ in range(3)]
    capturing = verify_moe_hook.capturing
    facts = {}
    for step, (name, in_capture) in enumerate(
        [("first_in_capture", True), ("warm_up", False), ("captured", True)]
    ):
        verify_moe_hook.capturing = lambda hidden, in_capture=in_capture: in_capture
        try:
            before, reasons = route.kernel_layers, dict(route.fallbacks)
            buffer = route.loaded_experts.get(6)
            got = run(model, xs[step], ForwardMode.TARGET_VERIFY)
        finally:
            verify_moe_hook.capturing = capturing
        expected = sglang(model, xs[step])
        topk = model.topk(xs[step], xs[step].float() @ model.router.t())
        _, ref_bitmap = verify_moe_reference(xs[step], w13, w2, topk[1], topk[0])
        bitmap = route.loaded_experts.get(6)
        facts[name] = {
            "kernel_layers": route.kernel_layers - before,
            "new_fallbacks": {
                k: v - reasons.get(k, 0)
                for k, v in route.fallbacks.items()
                if v > reasons.get(k, 0)
            },
            "max_err": (got - expected).abs().max().item(),
            "equal": torch.equal(got, expected),
            "bitmap": None if bitmap is None else bitmap.tolist() == ref_bitmap.tolist(),
            "same_buffer": buffer is not None and bitmap is buffer,
        }
    return facts


def test_kernel_in_real_sglang_layers_matches_sglang_in_verify_forwards_only():
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_verify_moe_hook as t; "
        "print('FACTS', json.dumps(t.layer_checks()))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, HERE], capture_output=True, text=True, timeout=900, env=env
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("FACTS ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    facts = json.loads(lines[-1][len("FACTS ") :])

    for name, tol in (("fp32", 1e-5), ("fp16", 2e-3)):
        fact = facts[name]
        assert fact["kernel_layers"] == 1, fact  # the kernel computed the verify forward
        assert fact["max_err"] <= tol * max(1.0, fact["scale"]), fact
        assert fact["dtype"] == f"torch.{'float32' if name == 'fp32' else 'float16'}"
        # Decode, extend, draft extend and calls outside a forward: SGLang's path, bit for bit.
        assert fact["untouched"] == {
            "DECODE": [0, True],
            "EXTEND": [0, True],
            "DRAFT_EXTEND_V2": [0, True],
            "no_forward": [0, True],
        }
    assert facts["scaled"] <= 1e-5
    for name, reason in (
        ("gelu", "activation gelu (gated: True)"),
        ("bf16", "bfloat16 under Triton's interpreter (its tl.dot does not support bfloat16)"),
    ):
        assert facts[name]["kernel_layers"] == 0 and facts[name]["equal"], facts[name]
        assert {k: v for k, v in facts[name]["new_fallbacks"].items() if v} == {reason: 1}
    assert facts["draft"] == [0, True]
    assert facts["padded"]["real_err"] <= 1e-5
    assert facts["padded"]["padded_zero"] and facts["padded"]["ids_untouched"]
    assert facts["padded"]["bitmap"]

    # Under a capture, a layer whose bitmap buffer exists runs the kernel (so the captured
    # graph, and every replay of it, computes with it) and writes that same buffer; one met
    # first inside a capture runs SGLang's MoE rather than allocate during the capture.
    capture = facts["capture"]
    first = capture["first_in_capture"]
    assert first["kernel_layers"] == 0 and first["equal"] and first["bitmap"] is None
    assert first["new_fallbacks"] == {verify_moe_hook.FIRST_MET_IN_CAPTURE: 1}
    for name in ("warm_up", "captured"):
        fact = capture[name]
        assert fact["kernel_layers"] == 1 and fact["new_fallbacks"] == {}, (name, fact)
        assert fact["max_err"] <= 1e-5 and fact["bitmap"] is True, (name, fact)
    assert capture["captured"]["same_buffer"]
