"""LiveRecall (sgl_ecospec/predictors/live_recall.py): the live per-layer recall and the trust
selection derives from it."""

import pytest
import torch

from sgl_ecospec.ops.bitmaps import topk_to_bitmap
from sgl_ecospec.ops.selection_reference import _delta_cost
from sgl_ecospec.predictors import LiveRecall, OnlineExpertPredictor, topk_recall
from sgl_ecospec.step import Placement

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


def test_trust_starts_at_zero_and_scales_with_the_layer_weights():
    live = LiveRecall(L, E, K, rate=0.5)
    assert live.recall() is None and live.per_layer() is None
    assert torch.equal(live.layer_weights(), torch.zeros(L))
    # Nothing measured yet: no cost beyond eps, so the first steps verify and measure.
    assert float(live.unpredicted_cost()) == 0.0
    novel = K * (1 - K / E)
    live.novel.fill_(novel)
    # A cold predictor is worth nothing: every expert a candidate brings is unpredicted.
    assert float(live.unpredicted_cost()) == pytest.approx(L * novel)
    live.trust.copy_(torch.tensor([0.2, 1.0, 0.0]))
    base = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    assert live.layer_weights().tolist() == pytest.approx([0.2, 1.0, 0.0])
    assert live.layer_weights(base).tolist() == pytest.approx([0.4, 1.0, 0.0])
    assert float(live.unpredicted_cost()) == pytest.approx(novel * (0.8 + 0.0 + 1.0))


def test_a_candidate_cost_schedule_replaces_the_unpredicted_cost():
    from sgl_ecospec.ops.selection import SelectionOptions

    live = LiveRecall(L, E, K)
    live.novel.fill_(2.0)
    live.trust.copy_(torch.tensor([0.5, 0.0, 1.0]))
    flat = SelectionOptions("adaptive", 0.1, step_cost=10.0)
    options, weights = live.weigh(flat, None, host_eps=True)
    assert options.eps == pytest.approx(0.1 + 2.0 * (0.5 + 1.0 + 0.0))
    # The cost model's schedule already prices every candidate's experts: no U. DeltaCost
    # prices the trusted share (mean trust 0.5), the schedule the rest.
    scheduled = SelectionOptions("adaptive", 0.1, step_cost=10.0, candidate_cost=5.0)
    options, weights = live.weigh(scheduled, None, host_eps=True)
    assert options.eps == 0.1 and options.candidate_cost == pytest.approx(2.5)
    assert weights.tolist() == [0.5, 0.0, 1.0]
    base = torch.tensor([1.0, 2.0, 1.0])  # trust weighted by layer: (0.5 + 0 + 1) / 4
    options, _ = live.weigh(scheduled, base, host_eps=True)
    assert options.candidate_cost == pytest.approx(5.0 * (1 - 1.5 / 4))
    # Graph-safe (no sync), the whole schedule stays.
    options, weights = live.weigh(scheduled, None, host_eps=False)
    assert options is scheduled and weights.tolist() == [0.5, 0.0, 1.0]


def test_novel_experts_of_the_verified_candidates():
    """n_l, the experts the verified candidates add to their step's roots, per candidate:
    0 when cold; measured on the candidates (0 when they use the roots' experts, K when
    each uses new ones of its own, shared when they use the same new ones); on the roots,
    each left out in turn, in a step without candidates (not a lone root); averaged over
    the first steps, so one step replaces the starting value."""
    live = LiveRecall(L, E, K, rate=0.05)
    assert live.novel.tolist() == [0.0] * L
    live.novel.fill_(3.0)

    roots = torch.arange(K).expand(2, 1, L, K)  # both roots use experts 0..K-1
    echo = torch.arange(K).expand(2, 2, L, K)  # candidates that use the same experts
    live.update_novel(torch.cat([roots, echo], 1))
    assert live.novel.tolist() == [0.0] * L  # the first step replaces the start

    fresh = LiveRecall(L, E, K)
    new = (torch.arange(K) + K).expand(2, 2, L, K)  # candidates on experts the roots lack
    valid = torch.tensor([[True, True, False], [True, False, False]])
    fresh.update_novel(torch.cat([roots, new], 1), valid)
    assert fresh.novel.tolist() == [float(K)] * L
    # Candidates that bring the same new experts share their cost: 4 candidates, K new.
    shared = LiveRecall(L, E, K)
    shared.update_novel(torch.cat([roots, new], 1))
    assert shared.novel.tolist() == pytest.approx([K / 4] * L)

    # No candidate verified: the roots, each left out in turn. A lone root measures nothing
    # (against an empty union it would count all K of its experts), even after many steps.
    lone = LiveRecall(L, E, K)
    lone.update_novel(torch.cat([roots, new], 1)[:1], valid[:1])
    for seed in range(20):
        lone.update_novel(random_routing(seed, 1)[:, None])
    assert lone.novel.tolist() == [float(K)] * L  # the one step with a candidate
    assert float(lone.novel_steps) == 1
    twins = LiveRecall(L, E, K)
    twins.update_novel(roots)
    assert twins.novel.tolist() == [0.0] * L
    uniform = LiveRecall(L, E, K)
    for seed in range(60):  # 4 uniform roots: K (1 - K / E)^3 each
        uniform.update_novel(random_routing(seed, 4)[:, None])
    assert uniform.novel.tolist() == pytest.approx([K * (1 - K / E) ** 3] * L, rel=0.25)

    # Rows that do not count change nothing.
    before = twins.novel.clone()
    twins.update_novel(torch.cat([roots, new], 1), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(twins.novel, before)

    # A trusted layer's measured cost counts only as far as it is not trusted.
    fresh.trust.fill_(1.0)
    assert float(fresh.unpredicted_cost()) == pytest.approx(0.0)


def test_novel_experts_amortised_over_a_whole_verify_set():
    """With a budget the measured cost is spread over a full verify set: where the roots
    nearly saturate a layer the few experts they miss are filled once, by the first
    candidates; where they miss many the measured average stays."""
    roots = torch.arange(K).expand(2, 1, L, K)  # 2 roots on experts 0..K-1: E - K missing
    one_new = torch.cat([torch.arange(1, K), torch.tensor([K])]).expand(2, 1, L, K)
    routing = torch.cat([roots, one_new], 1)  # each request verifies one candidate
    valid = torch.tensor([[True, True], [True, False]])  # 1 candidate, 1 new expert
    plain, amortised = LiveRecall(L, E, K), LiveRecall(L, E, K)
    plain.update_novel(routing, valid)
    amortised.update_novel(routing, valid, budget=3)
    assert plain.novel.tolist() == [1.0] * L
    # share f = 1 / (E - K) of the missing filled by k = 1; K = 2 roots x 3 = 6 candidates
    missing = E - K
    want = missing * (1 - (1 - 1 / missing) ** 6) / 6
    assert amortised.novel.tolist() == pytest.approx([want] * L)
    assert want < 1.0
    # Roots that saturate the layer but one expert, filled by the one candidate: each of
    # the six candidates of a full set pays a sixth of it.
    saturated = torch.arange(E - 1).view(1, 1, 1, E - 1).expand(2, 1, L, E - 1)
    last = torch.full((2, 1, L, E - 1), E - 1)
    full = LiveRecall(L, E, E - 1)
    full.update_novel(torch.cat([saturated, last], 1), valid, budget=3)
    assert full.novel.tolist() == pytest.approx([1 / 6] * L)
    # A full verify set measured as it is: nothing to amortise.
    every = torch.ones(2, 4, dtype=torch.bool)
    spread = random_routing(3, 8).view(2, 4, L, K)
    same, budgeted = LiveRecall(L, E, K), LiveRecall(L, E, K)
    same.update_novel(spread, every)
    budgeted.update_novel(spread, every, budget=3)
    assert budgeted.novel.tolist() == pytest.approx(same.novel.tolist())


def test_novel_experts_in_the_units_of_the_ep_cost():
    """With an EP placement n_l is what selection's EP DeltaCost charges for the same
    experts: the busiest rank's rise plus total_weight times the other ranks' rise."""
    ranks = torch.arange(E) // (E // 4)  # 4 ranks, contiguous
    placement = Placement(ranks, 4)
    for seed in range(5):
        routing = random_routing(seed, 4).view(2, 2, L, K)  # 2 requests: root, candidate
        candidate = routing[:1, 1:]  # one candidate, request 0's
        roots = routing[:, :1]
        live = LiveRecall(L, E, K)
        valid = torch.tensor([[True, True], [True, False]])
        live.update_novel(routing, valid, placement=placement, total_weight=0.3)
        buffer = topk_to_bitmap(roots, E).squeeze(1)  # [2, L, W]
        buffer = buffer[0] | buffer[1]
        bits = topk_to_bitmap(candidate, E)  # [1, 1, L, W]
        for layer in range(L):
            only = torch.eye(L, dtype=torch.float64)[layer]  # DeltaCost of this layer alone
            want = _delta_cost(bits, buffer[None], only, (ranks.expand(L, E), 4, 0.3))
            assert float(live.novel[layer]) == pytest.approx(float(want))
    with pytest.raises(ValueError, match="total_weight needs placement"):
        LiveRecall(L, E, K).update_novel(routing, total_weight=0.5)


def test_of_attaches_one_tracker_per_predictor():
    predictor = OnlineExpertPredictor(L, E, K)
    assert predictor.live_recall is None
    live = LiveRecall.of(predictor)
    assert LiveRecall.of(predictor) is live and predictor.live_recall is live
    assert OnlineExpertPredictor(L, E, K).live_recall is None


def test_rate_is_checked():
    with pytest.raises(ValueError, match="rate"):
        LiveRecall(L, E, K, rate=0)


def steps_of_routing(gen, count, batch=2, rows=4):
    return [
        torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(batch * rows * L)]).view(
            batch, rows, L, K
        )
        for _ in range(count)
    ]


def test_trust_is_the_slope_of_true_on_predicted_new_experts():
    """0 when cold, near 1 for a perfect predictor, near 0 for one independent of the
    routing, and 0 for one whose recall is high but whose new experts are the candidate's
    own replaced by others (the count is right, which candidate costs more is not); rows
    that do not count change nothing."""
    gen = torch.Generator().manual_seed(0)
    perfect, independent = LiveRecall(L, E, K), LiveRecall(L, E, K)
    for routing, other in zip(steps_of_routing(gen, 100), steps_of_routing(gen, 100), strict=True):
        perfect.update_cost_fit(routing, routing)
        independent.update_cost_fit(other, routing)
    assert float(perfect.trust.min()) > 0.9  # shrunk a little by the prior
    assert float(independent.trust.max()) < 0.15
    before = (perfect.cost_fit.clone(), perfect.trust.clone())
    routing = steps_of_routing(gen, 1)[0]
    perfect.update_cost_fit(routing, routing, torch.zeros(2, 4, dtype=torch.bool))
    assert torch.allclose(perfect.cost_fit, before[0] * (1 - perfect.rate))
    assert torch.all(perfect.trust <= before[1])  # older evidence weighs less
    assert torch.allclose(perfect.trust, before[1], atol=0.01)


def test_trust_reads_how_many_new_experts_a_step_brings():
    """ "adaptive" sizes a verify set by what its candidates cost, so a predictor that knows
    how many new experts each step's candidates bring is trusted even where a request
    verifies one candidate (batch 1) or its candidates are alike; one whose counts do not
    follow the routing is not."""
    gen = torch.Generator().manual_seed(1)
    exact, wrong = LiveRecall(L, E, K), LiveRecall(L, E, K)
    roots = torch.arange(K).expand(1, 1, L, K)

    def candidate(new):
        return torch.cat([torch.arange(new) + K, torch.arange(K - new)]).expand(1, 1, L, K)

    for _ in range(50):
        new, guess = (int(n) for n in torch.randint(K + 1, (2,), generator=gen))
        routing = torch.cat([roots, candidate(new)], 1)
        exact.update_cost_fit(routing, routing)
        wrong.update_cost_fit(torch.cat([roots, candidate(guess)], 1), routing)
    assert float(exact.trust.min()) > 0.85  # shrunk by the prior: one candidate a step
    assert float(wrong.trust.max()) < 0.3
