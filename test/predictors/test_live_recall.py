"""LiveRecall (sgl_ecospec/predictors/live_recall.py): the live per-layer recall and the trust
selection derives from it."""

import pytest
import torch

from sgl_ecospec.predictors import LiveRecall, OnlineExpertPredictor, topk_recall

L, E, K = 3, 16, 4


def random_routing(seed, rows=30):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(rows * L)]).view(
        rows, L, K
    )


def test_cumulative_recall_equals_topk_recall_per_layer():
    live = LiveRecall(L, E, K)
    preds, trues = [], []
    for seed in range(3):
        pred, true = random_routing(seed), random_routing(seed + 10)
        live.update(pred, true)
        preds.append(pred)
        trues.append(true)
    pred, true = torch.cat(preds), torch.cat(trues)
    for layer, got in enumerate(live.per_layer()):
        want = topk_recall(pred[:, layer : layer + 1], true[:, layer : layer + 1], E)
        assert got == pytest.approx(want)
    assert live.recall() == pytest.approx(topk_recall(pred, true, E))


def test_invalid_rows_do_not_count():
    live = LiveRecall(L, E, K)
    true = random_routing(0, 4)
    pred = true.clone()
    pred[2:] = random_routing(5, 2)
    live.update(pred, true, torch.tensor([True, True, False, False]))
    assert live.per_layer() == [1.0] * L
    assert float(live.rows) == 2


def test_trust_starts_at_zero_and_follows_recall():
    live = LiveRecall(L, E, K, rate=0.5)
    assert live.recall() is None and live.per_layer() is None
    assert torch.equal(live.layer_weights(), torch.zeros(L))
    # A cold predictor is worth nothing: every expert a candidate brings is unpredicted.
    assert float(live.unpredicted_cost()) == pytest.approx(L * K * (1 - K / E))
    true = random_routing(1)
    pred = true.clone()
    pred[:, 0] = random_routing(2)[:, 0]  # layer 0 mostly wrong, layers 1-2 perfect
    for _ in range(30):
        live.update(pred, true)
    weights = live.layer_weights()
    assert weights[1:].tolist() == pytest.approx([1.0, 1.0])
    assert 0 <= float(weights[0]) < 0.3
    base = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    assert live.layer_weights(base).tolist() == pytest.approx((weights * base.float()).tolist())


def test_novel_experts_are_measured_leaving_each_root_out():
    """n_l, the experts one verified token brings that its step's other tokens do not use:
    K (1 - K / E) when cold, K (1 - K / E)^(B - 1) under uniform routing, 0 when every token
    uses the same experts, and K for a lone root."""
    live = LiveRecall(L, E, K, rate=0.5)
    assert live.novel.tolist() == pytest.approx([K * (1 - K / E)] * L)
    # Cold: no trust, so the whole measured cost is unpredicted.
    assert float(live.unpredicted_cost()) == pytest.approx(L * K * (1 - K / E))
    for seed in range(60):  # batches of 4 uniform roots
        live.update_novel(random_routing(seed, 4))
    assert live.novel.tolist() == pytest.approx([K * (1 - K / E) ** 3] * L, rel=0.25)

    same = LiveRecall(L, E, K, rate=0.5)
    for _ in range(20):
        same.update_novel(torch.arange(K).expand(4, L, K))
    assert same.novel.max() < 1e-4

    alone = LiveRecall(L, E, K, rate=1.0)
    alone.update_novel(random_routing(0, 1))
    assert alone.novel.tolist() == [float(K)] * L
    # Roots that do not count are no one's neighbours, and none leaves the rate alone.
    roots = torch.cat([random_routing(1, 1), torch.arange(K).expand(1, L, K)])
    alone.update_novel(roots, torch.tensor([True, False]))
    assert alone.novel.tolist() == [float(K)] * L
    alone.update_novel(roots, torch.tensor([False, False]))
    assert alone.novel.tolist() == [float(K)] * L

    # A trusted layer's measured cost counts only as far as it is not trusted.
    live.ema.fill_(1.0)
    assert float(live.unpredicted_cost()) == pytest.approx(0.0)


def test_of_attaches_one_tracker_per_predictor():
    predictor = OnlineExpertPredictor(L, E, K)
    assert predictor.live_recall is None
    live = LiveRecall.of(predictor)
    assert LiveRecall.of(predictor) is live and predictor.live_recall is live
    assert OnlineExpertPredictor(L, E, K).live_recall is None


def test_rate_is_checked():
    with pytest.raises(ValueError, match="rate"):
        LiveRecall(L, E, K, rate=0)
