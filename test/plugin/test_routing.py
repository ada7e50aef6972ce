"""The target's MoE layout, the routing capture hook and the verify statistics."""

import logging
from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import routing

from plugin._helpers import MOE_CONFIGS
from sgl_ecospec.predictors import OnlineExpertPredictor


def test_moe_layout_of_known_configs():
    from transformers import Qwen2MoeConfig

    qwen = Qwen2MoeConfig(
        num_hidden_layers=6,
        num_experts=64,
        num_experts_per_tok=4,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
    )
    assert routing.moe_layout(qwen) == ([0, 2, 3, 4, 5], 64, 4)
    # The plugin tests' DeepSeek-V3 config (64 routed experts, top-8), 5 layers, 3 dense.
    deepseek = SimpleNamespace(
        **{**MOE_CONFIGS["deepseek-v3"], "num_hidden_layers": 5, "first_k_dense_replace": 3}
    )
    assert routing.moe_layout(deepseek) == ([3, 4], 64, 8)
    with pytest.raises(ValueError, match="Mixture-of-Experts"):
        routing.moe_layout(SimpleNamespace(num_hidden_layers=2))


def test_capture_hook_writes_moe_layers_and_honors_the_opt_out():
    capture = routing.RoutingCapture([0, 2], top_k=2, max_tokens=4, device="cpu")
    routing.slot.activate(capture)
    try:
        target = SimpleNamespace(allow_routed_experts_capture=True)
        draft = SimpleNamespace(allow_routed_experts_capture=False)
        ids = torch.tensor([[1, 2, 9], [3, 4, 9], [5, 6, 9], [7, 8, 9], [0, 0, 9]])
        assert routing.after_capture("r", target, 2, ids) == "r"
        routing.after_capture(None, target, 1, ids + 100)  # not a MoE layer
        routing.after_capture(None, draft, 0, ids + 100)  # draft model opted out
    finally:
        routing.slot.activate(None)
    # Five tokens, four rows: the first four are kept; the extra (shared) column dropped.
    assert capture.verify_routing(4)[:, 1].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert capture.verify_routing(4)[:, 0].eq(-1).all()  # never captured
    assert capture.captured_layers(4).tolist() == [False, True]
    with pytest.raises(ValueError, match="exceed"):
        capture.verify_routing(5)


def test_verify_stats_union_and_recall():
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=1 << 16)
    predictor.observe(torch.tensor([5]), torch.tensor([[[1, 2]]]))
    stats = routing.VerifyStats(8, "cpu", layer_ids=[0])
    window = stats.window()
    assert window.read() is None  # no verify step yet
    # Tokens 5 and 6 routed to {1, 2} and {2, 3}: union 3 experts; recall: token 5 fully
    # predicted (2/2), token 6 (unseen, prior says {1, 2} or similar) at least 1/2 of {2, 3}.
    tokens, route = torch.tensor([5, 6]), torch.tensor([[[1, 2]], [[2, 3]]])
    stats.update(route, predictor.predict_topk(tokens))
    summary = window.read()
    assert summary["unique_experts_per_layer"] == 3.0 and summary["verify_steps"] == 1
    assert 0.75 <= summary["predictor_recall"] <= 1.0
    assert summary["verify_tokens_per_step"] == 2.0
    assert window.pending_steps == 0 and window.read() is None


def test_stats_windows_read_their_own_intervals():
    predictor = OnlineExpertPredictor(2, 8, 1, num_buckets=64)
    stats = routing.VerifyStats(8, "cpu", layer_ids=[0, 1])
    early, late = stats.window(), stats.window()
    # Step 1: 1 token, experts {0} and {1} -> 1 unique per layer. Step 2: 3 tokens, layer 0
    # {0, 1, 2}, layer 1 {3, 3, 3} -> (3 + 1) / 2 = 2. Step 3: 2 tokens, 2 per layer -> 2.
    steps = [
        [[[0], [1]]],
        [[[0], [3]], [[1], [3]], [[2], [3]]],
        [[[4], [5]], [[6], [7]]],
    ]
    for i, routes in enumerate(steps):
        route = torch.tensor(routes)
        stats.update(route, predictor.predict_topk(torch.arange(route.shape[0]) + 10 * i))
        if i == 0:
            first = early.read()
    assert first["unique_experts_per_layer"] == 1.0 and first["verify_tokens_per_step"] == 1
    rest = early.read()
    assert rest["verify_steps"] == 2 and rest["unique_experts_per_layer"] == 2.0
    assert rest["verify_tokens_per_step"] == 2.5
    whole = late.read()  # the other reader still sees all three steps
    assert whole["verify_steps"] == 3 and whole["verify_tokens_per_step"] == 2.0
    assert whole["unique_experts_per_layer"] == pytest.approx(5 / 3)
    assert 0.0 <= whole["predictor_recall"] <= 1.0


# --- TopK outputs that SGLang does not capture ----------------------------------------------


def topk_layer(layer_id, *, capture=True):
    """What the TopK hook reads of SGLang's ``TopK``: its config (the PyTorch routing, so
    that ``select_experts`` runs on the CPU) and layer id."""
    from sglang.srt.layers.moe.topk import TopKConfig

    config = TopKConfig(
        top_k=2,
        layer_id=layer_id,
        renormalize=True,
        torch_native=True,
        allow_routed_experts_capture=capture,
    )
    return SimpleNamespace(topk_config=config, layer_id=layer_id)


def test_topk_hook_captures_routing_of_kernel_routed_outputs():
    """GPT-OSS's ``triton_kernel`` runner and the FlashInfer TRT-LLM / mxfp4 runners get a
    ``TritonKernelTopKOutput`` / ``BypassedTopKOutput`` (no ids, SGLang's capture site never
    called): the hook captures the same experts the standard path would."""
    from sglang.srt.layers.moe.topk import (
        BypassedTopKOutput,
        StandardTopKOutput,
        TopK,
        TritonKernelTopKOutput,
    )
    from sglang_ecospec import hooks

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, generator=gen)
    logits = [torch.randn(5, 16, generator=gen) for _ in range(2)]
    truth = [x.topk(2).indices.sort(-1).values for x in logits]  # softmax top-2 = logit top-2
    capture = routing.RoutingCapture([0, 3], top_k=2, max_tokens=4, device="cpu")
    bindings = [routing.slot.bind(capture)]
    hooks.activate(bindings)  # SGLang's TopK and capture site hooked in this process
    try:
        triton = TritonKernelTopKOutput(None, torch.empty(0), torch.empty(0), torch.empty(0), 2)
        # Through SGLang's own call path: nn.Module.__call__ -> the hooked TopK.forward ->
        # BaseFusedOp.forward -> the resolved platform method (here returning the output of
        # the triton_kernel runner's routing).
        layer3 = TopK.__new__(TopK)
        torch.nn.Module.__init__(layer3)
        layer3.topk_config, layer3.layer_id = topk_layer(3).topk_config, 3
        layer3._forward_method = lambda hidden_states, router_logits: triton
        capture.begin_forward()
        assert layer3(hidden, logits[1]) is triton
        assert capture.captured_layers(4).tolist() == [False, True]
        layer0 = topk_layer(0)
        bypassed = BypassedTopKOutput(hidden, logits[0], layer0.topk_config)
        # Called as TopK.forward -> (cached dispatch) TopK.forward_cuda: captured once.
        inner = lambda topk, h, router_logits: bypassed  # noqa: E731

        def outer(topk, *args, **kwargs):
            return routing.around_topk(inner, topk, *args, **kwargs)

        calls = []
        real_capture = capture.capture
        capture.capture = lambda *args: calls.append(args[0]) or real_capture(*args)
        assert routing.around_topk(outer, layer0, hidden, router_logits=logits[0]) is bypassed
        del capture.capture
        assert calls == [0] and capture.captured_layers(4).all()
        got = capture.verify_routing(4).sort(-1).values  # [T, L, K]
        assert torch.equal(got[:, 0], truth[0][:4]) and torch.equal(got[:, 1], truth[1][:4])
        # Standard outputs were captured by SGLang's select_experts; draft layers opt out.
        capture.begin_forward()
        standard = StandardTopKOutput(torch.ones(5, 2), truth[0], logits[0])
        routing.around_topk(lambda *a: standard, topk_layer(0), hidden, logits[0])
        draft = topk_layer(3, capture=False)
        routing.around_topk(lambda *a: triton, draft, hidden, logits[1])
        assert capture.captured_layers(4).tolist() == [False, False]
    finally:
        hooks.deactivate(bindings)
    # Without an ECOSPEC capture in the process the hook only returns SGLang's output.
    capture.begin_forward()
    routing.around_topk(lambda *a: triton, topk_layer(3), hidden, logits[1])
    assert not capture.captured_layers(4).any()


def test_uncaptured_verify_steps_are_counted_and_logged_once(caplog):
    predictor = OnlineExpertPredictor(2, 8, 1, num_buckets=64)
    capture = routing.RoutingCapture([0, 1], top_k=1, max_tokens=3, device="cpu")
    stats = routing.VerifyStats(8, "cpu", layer_ids=[0, 1])
    first, second = stats.window(), stats.window()
    config = SimpleNamespace(allow_routed_experts_capture=True)

    def verify_step(layers, rows=2):
        """A verify forward in which SGLang's capture site ran for ``layers`` only (with
        ``rows`` token rows each)."""
        capture.begin_forward()
        for layer in layers:
            routing.after_capture(None, config, layer, torch.tensor([[layer], [2], [3]])[:rows])
        stats.update(capture.verify_routing(2), predictor.predict_topk(torch.tensor([1, 2])))

    routing.slot.activate(capture)
    try:
        for layers in ([0, 1], [0], [1]):  # the last two steps miss a layer
            verify_step(layers)
        with caplog.at_level(logging.ERROR, logger=routing.__name__):
            assert first.read()["capture_missed_steps"] == 2
            assert second.read()["capture_missed_steps"] == 2  # its own window, logged once
        (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "routing was not captured in 2 verify step(s)" in error.getMessage()
        assert "--moe-runner-backend" in error.getMessage()
        verify_step([0, 1])
        assert first.read()["capture_missed_steps"] == 0
        verify_step([0, 1], rows=1)  # a capture that left a verify row out is a miss too
        with caplog.at_level(logging.ERROR, logger=routing.__name__):
            assert first.read()["capture_missed_steps"] == 1
        assert "in 1 verify step(s) (3 since start)" in caplog.records[-1].getMessage()
    finally:
        routing.slot.activate(None)
