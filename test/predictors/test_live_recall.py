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
    missed_layer0 = K * (1 - max(float(live.ema[0]), K / E))
    assert float(live.unpredicted_cost()) == pytest.approx(missed_layer0, abs=1e-6)
    base = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    assert live.layer_weights(base).tolist() == pytest.approx((weights * base.float()).tolist())


def test_of_attaches_one_tracker_per_predictor():
    predictor = OnlineExpertPredictor(L, E, K)
    assert predictor.live_recall is None
    live = LiveRecall.of(predictor)
    assert LiveRecall.of(predictor) is live and predictor.live_recall is live
    assert OnlineExpertPredictor(L, E, K).live_recall is None


def test_rate_is_checked():
    with pytest.raises(ValueError, match="rate"):
        LiveRecall(L, E, K, rate=0)
