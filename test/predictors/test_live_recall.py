"""LiveRecall (sgl_ecospec/predictors/live_recall.py): the live per-layer recall and the trust
selection derives from it."""

import pytest
import torch

from sgl_ecospec.ops.bitmaps import topk_to_bitmap
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


def test_missed_rate_is_measured_against_the_starting_buffer():
    """m_l counts a candidate's true experts that were neither predicted nor in its buffer,
    per free expert: chance (K / E) when cold and under uniform routing with a useless
    predictor, 0 for a perfect predictor, and 0 when routing favours experts the buffer
    already holds."""
    live = LiveRecall(L, E, K, rate=0.5)
    assert live.missed_rate.tolist() == pytest.approx([K / E] * L)
    free = torch.full((L,), float(E - K))
    assert float(live.unpredicted_cost(free=free)) == pytest.approx(float(live.unpredicted_cost()))
    empty = torch.zeros(30, L, 1, dtype=torch.int64)
    for seed in range(40):  # uniform routing, predictions independent of it, empty buffers
        live.update_missed(random_routing(seed), random_routing(seed + 100), empty)
    assert live.missed_rate.tolist() == pytest.approx([K * (1 - K / E) / E] * L, rel=0.25)

    perfect = LiveRecall(L, E, K, rate=0.5)
    for seed in range(10):
        true = random_routing(seed)
        perfect.update_missed(true, true, empty)
    assert perfect.missed_rate.max() < 1e-2

    # Popular experts: every true expert is one of 0..K-1, and the buffer holds them.
    popular = LiveRecall(L, E, K, rate=0.5)
    held = topk_to_bitmap(torch.arange(K).expand(30, L, K), E)
    for seed in range(10):
        popular.update_missed(random_routing(seed), torch.arange(K).expand(30, L, K), held)
    assert popular.missed_rate.max() < 1e-2
    # Rows that do not count leave the rate alone.
    before = popular.missed_rate.clone()
    popular.update_missed(
        random_routing(0), random_routing(1), empty, torch.zeros(30, dtype=torch.bool)
    )
    assert torch.equal(popular.missed_rate, before)


def test_start_buffer_is_the_union_of_the_roots_or_each_root():
    ids = torch.tensor([[[0, 63]], [[64, 127]], [[5, 100]]])  # 3 roots, 1 layer, 128 experts
    roots = topk_to_bitmap(ids, 128)
    union = LiveRecall.start_buffer(roots, True)
    assert union.shape == roots.shape
    assert all(torch.equal(u, roots[0] | roots[1] | roots[2]) for u in union)
    assert LiveRecall.start_buffer(roots, False) is roots
    live = LiveRecall(1, 128, 2)
    assert live.buffer_free(roots).tolist() == [122.0]
    assert live.buffer_free(roots, share_buffer=False).tolist() == [126.0]


def test_of_attaches_one_tracker_per_predictor():
    predictor = OnlineExpertPredictor(L, E, K)
    assert predictor.live_recall is None
    live = LiveRecall.of(predictor)
    assert LiveRecall.of(predictor) is live and predictor.live_recall is live
    assert OnlineExpertPredictor(L, E, K).live_recall is None


def test_rate_is_checked():
    with pytest.raises(ValueError, match="rate"):
        LiveRecall(L, E, K, rate=0)
