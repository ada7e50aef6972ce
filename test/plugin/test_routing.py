"""The target's MoE layout, the routing capture hook and the verify statistics."""

from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import routing

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
    deepseek = SimpleNamespace(
        num_hidden_layers=5,
        n_routed_experts=256,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        moe_layer_freq=1,
    )
    assert routing.moe_layout(deepseek) == ([3, 4], 256, 8)
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
    assert capture.verify_routing(4)[:, 0].eq(0).all()
    assert capture.captures == 1
    with pytest.raises(ValueError, match="exceed"):
        capture.verify_routing(5)


def test_verify_stats_union_and_recall():
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=1 << 16)
    predictor.observe(torch.tensor([5]), torch.tensor([[[1, 2]]]))
    stats = routing.VerifyStats(8, "cpu")
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
    stats = routing.VerifyStats(8, "cpu")
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
