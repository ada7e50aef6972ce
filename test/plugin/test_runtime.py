"""EcoSpecRuntime: what it builds from the settings and the served model, what it learns and
logs after verify, and the hook slots it fills and empties."""

from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import ep_placement, metrics, routing, selection
from sglang_ecospec.settings import EcoSpecSettings, EcoSpecSettingsError

from plugin._helpers import (
    PUBLISHED,
    draft_tree_through_hooks,
)


def test_runtime_builds_ep_placement_and_cost_model_eps():
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    from sgl_ecospec.costmodel import (
        PerformanceModel,
        analytic_params,
        get_hardware,
        get_model,
        selection_cost,
    )

    # Qwen3-30B-A3B's MoE shape (48 layers x 128 experts, top-8), EP 2 without metadata.
    config = Qwen2MoeConfig(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8)
    settings = EcoSpecSettings(
        eps="auto",
        profile="qwen3-30b-a3b",
        hardware="2xh200",
        num_buckets=64,
        log_interval=0,
        **PUBLISHED,
    )

    def ep2_runtime(settings, max_batch):
        return EcoSpecRuntime(
            settings,
            config,
            topk=4,
            num_draft_tokens=6,
            max_batch=max_batch,
            device="cpu",
            ep_layout=ep_placement.EPLayout(ep_size=2),
        )

    runtime = ep2_runtime(settings, max_batch=40)
    try:
        placement = runtime.selector.placement
        assert placement is runtime.placement and ep_placement.slot.active() is placement
        assert placement.expert_rank.shape == (48, 128) and placement.num_ranks == 2
        assert torch.equal(placement.expert_rank, (torch.arange(128) // 64).expand(48, -1))
        table = runtime.selector.eps_table
        assert table.batches == (1, 2, 4, 8, 16, 32, 40)
        model, hardware = get_model("qwen3-30b-a3b"), get_hardware("2xh200")
        perf = PerformanceModel(model, hardware, analytic_params(model, hardware).params)
        for batch, eps in zip(table.batches, table.eps, strict=True):
            assert eps == selection_cost(perf, batch, 6, layers=48, ep_size=2).eps
        assert runtime.selector.options_for(39).eps == table.eps[-2]
    finally:
        runtime.close()
    assert ep_placement.slot.active() is None and selection.slot.active() is None
    # ep_cost=false: no placement even under EP.
    off = ep2_runtime(EcoSpecSettings(ep_cost=False, num_buckets=64, log_interval=0), 4)
    off.close()
    assert off.selector.placement is None and off.selector.options_for(4).eps == 0.1


def test_runtime_learns_from_the_verify_routing_and_logs_statistics():
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    settings = EcoSpecSettings(log_interval=1, num_buckets=1 << 12, **PUBLISHED)
    runtime = EcoSpecRuntime(
        settings, config, topk=2, num_draft_tokens=3, max_batch=2, device="cpu"
    )
    try:
        assert (
            selection.slot.active() is runtime.selector and routing.slot.active() is runtime.capture
        )
        assert metrics.slot.active() is runtime.decode_log_window
        runtime.before_decode(
            SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=torch.tensor([4, 5]))
        )
        assert runtime.selector.root_valid.tolist() == [True, True]
        # The verify forward of 2 requests x 3 tokens routes token t to experts {t%8, (t+1)%8}.
        tokens = torch.tensor([4, 9, 10, 5, 11, 12])
        ids = torch.stack([tokens % 8, (tokens + 1) % 8], 1)
        topk_config = SimpleNamespace(allow_routed_experts_capture=True)
        runtime.before_verify()
        for layer in (0, 1):  # SGLang's verify forward, as the capture hook sees it
            routing.after_capture(None, topk_config, layer, ids)
        runtime.after_verify(SimpleNamespace(draft_token=tokens))
        assert runtime.summaries == []  # copied, logged after the batch's results:
        runtime.poll_log()  # SGLang's per-batch report (metrics.report_decode_stats_hook)
        predicted = runtime.predictor.predict_topk(tokens)  # learnt: exact routing
        assert torch.equal(
            predicted.sort(-1).values, ids.sort(-1).values[:, None].expand(-1, 2, -1)
        )
        (summary,) = runtime.summaries
        assert summary["verify_tokens_per_step"] == 6.0
        assert summary["unique_experts_per_layer"] == 6.0  # experts 1..6
        # The decode log line's window is separate: it still holds the step.
        assert runtime.decode_log_window.read() == summary
    finally:
        runtime.close()
    assert (
        selection.slot.active() is None
        and routing.slot.active() is None
        and metrics.slot.active() is None
    )


def test_runtime_serves_a_trained_head_frozen(tmp_path):
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    from sgl_ecospec.predictors import LowRankExpertHead

    config = Qwen2MoeConfig(
        hidden_size=16, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2
    )
    head = LowRankExpertHead(16, 2, 8, 2, rank=4, token_buckets=32)
    path = tmp_path / "head.pt"
    head.save(path)
    with pytest.raises(EcoSpecSettingsError, match="predictor 'head' needs predictor_file"):
        EcoSpecSettings(predictor="head")
    settings = EcoSpecSettings(predictor="head", predictor_file=str(path), log_interval=1)
    runtime = EcoSpecRuntime(
        settings, config, topk=2, num_draft_tokens=3, max_batch=2, device="cpu"
    )
    try:
        assert isinstance(runtime.predictor, LowRankExpertHead) and runtime.predictor.lr == 0
        before = [p.clone() for p in runtime.predictor.parameters()]
        runtime.before_decode(
            SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=torch.tensor([4, 5]))
        )
        lists, _ = draft_tree_through_hooks(2, 2, 2, 16, vocab=30)
        _, _, draft_tokens = selection.organize_hook(None, *lists, 3)
        tokens = torch.cat([torch.tensor([[4], [5]]), draft_tokens], 1).flatten()
        # Route every verify row exactly as the head predicted, layer by layer: recall 1.
        predicted = runtime.selector.verify_topk[:6].long()  # [6, L, K]
        capture_config = SimpleNamespace(allow_routed_experts_capture=True)
        for layer in (0, 1):
            routing.after_capture(None, capture_config, layer, predicted[:, layer])
        runtime.after_verify(SimpleNamespace(draft_token=tokens))
        runtime.poll_log()
        (summary,) = runtime.summaries
        assert summary["predictor_recall"] == 1.0
        params = runtime.predictor.parameters()
        assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    finally:
        runtime.close()
    # A head for another model is refused at startup.
    wrong = Qwen2MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2
    )
    with pytest.raises(ValueError, match="hidden_size: saved 16, expected 32"):
        EcoSpecRuntime(settings, wrong, topk=2, num_draft_tokens=3, max_batch=2, device="cpu")


def test_runtime_feeds_the_live_recall_from_captured_verify_rows():
    """With the recall-weighted cost the predictor's LiveRecall learns, per MoE layer, how
    much of each verified row's routing selection predicted; rows SGLang did not capture
    do not count."""
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    settings = EcoSpecSettings(
        recall_weighted_cost=True, min_score=0.0, num_buckets=64, log_interval=0
    )
    runtime = EcoSpecRuntime(
        settings, config, topk=2, num_draft_tokens=3, max_batch=2, device="cpu"
    )
    try:
        live = runtime.selector.live_recall
        assert live is runtime.predictor.live_recall and live.trust.tolist() == [0.0, 0.0]
        fits = []
        fit = live.update_cost_fit
        live.update_cost_fit = lambda *args: (fits.append(args), fit(*args))
        roots = torch.tensor([4, 5])
        runtime.before_decode(SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=roots))
        lists, _ = draft_tree_through_hooks(2, 2, 2, 16, vocab=30)
        _, _, draft = selection.organize_hook(None, *lists, 3)
        tokens = torch.cat([roots[:, None], draft], 1).flatten()  # [6]
        predicted = runtime.selector.verify_topk[:6].long()  # [6, L, K]
        # Layer 0 routed as predicted, layer 1 to two unpredicted experts; the last row of
        # layer 1 is not captured.
        unpredicted = torch.ones(6, 8, dtype=torch.bool).scatter_(1, predicted[:, 1], False)
        elsewhere = unpredicted.long().topk(2, dim=1).indices  # [6, 2]
        capture_config = SimpleNamespace(allow_routed_experts_capture=True)
        runtime.before_verify()
        routing.after_capture(None, capture_config, 0, predicted[:, 0])
        routing.after_capture(None, capture_config, 1, elsewhere[:5])
        runtime.after_verify(SimpleNamespace(draft_token=tokens))
        assert live.rows.item() == 5 and live.hits.tolist() == [5.0, 0.0]
        # The trust's fit saw the same rows per request, root first, and what selection
        # predicted for them; a cold table predicts every candidate alike: no trust yet.
        ((fit_predicted, fit_routing, fit_valid),) = fits
        assert torch.equal(fit_predicted.flatten(0, 1), predicted)
        assert fit_routing.shape == (2, 3, 2, 2)
        assert fit_valid.tolist() == [[True, True, True], [True, True, False]]
        assert live.trust.tolist() == [0.0, 0.0]
        assert live.per_layer() == [1.0, 0.0]
    finally:
        runtime.close()
