"""The measured exchange rate of testbed experts into a profile's (``ExpertExchange``): what
the pricing charges for the experts verified candidates add, the prior blended in, and the
engine scaling its layer weights by it (tiny models, as test_engine)."""

import dataclasses

import pytest
import torch
from _models import EXPERTS, LAYERS, TOP_K, random_prompts, tiny_engine_fixture

from sgl_ecospec.costmodel import get_model
from sgl_ecospec.costmodel.scaling import scale_unique_experts
from sgl_ecospec.lab.bench import sweep_plan
from sgl_ecospec.lab.bench.expert_exchange import ExpertExchange
from sgl_ecospec.lab.engine import ENGINE_SELECTION, SpecConfig
from sgl_ecospec.ops.selection import SelectionOptions
from sgl_ecospec.predictors import OnlineExpertPredictor

DEEPSEEK = get_model("deepseek-v3")


def _exchange(profile=DEEPSEEK, prior=2.0, prior_experts=10.0, *, kind=ExpertExchange, **more):
    """An ExpertExchange (or its subclass ``kind``) of 64 experts top-8 on ``profile``;
    ``more``: its other keywords, or other ``num_experts`` and ``top_k``."""
    return kind(
        **{"num_experts": 64, "top_k": 8, **more},
        profile=profile,
        prior=prior,
        prior_experts=prior_experts,
    )


def _tiny_exchange(**more):
    """The exchange of the tiny engine's experts (``_models``), prior 1 at 1 expert."""
    return _exchange(prior=1.0, prior_experts=1.0, num_experts=EXPERTS, top_k=TOP_K, **more)


def _step(*rows):
    """routing ``[1, R, 1, K]`` and valid ``[1, R]``: one request, its root and verified
    candidates (``rows``: each row's experts in the one layer); a row's experts repeat to
    fill K."""
    k = max(map(len, rows))
    routing = torch.tensor([[[r + r[: k - len(r)]] for r in rows]])
    return routing, torch.ones(1, len(rows), dtype=torch.bool)


def _batch_step(root_union, new_experts):
    """A one-layer step of 16 requests whose roots cover experts 0..root_union-1, and one
    verified candidate per expert in ``new_experts``, each reading it and 7 experts the
    roots read (K = 8, E = 64)."""
    roots = [[(8 * i + j) % root_union for j in range(8)] for i in range(16)]
    candidates = [[e, *range(7)] for e in new_experts]
    routing = torch.zeros(16, 2, 1, 8, dtype=torch.int64)
    valid = torch.zeros(16, 2, dtype=torch.bool)
    valid[:, 0] = True
    routing[:, 0, 0] = torch.tensor(roots)
    for i, c in enumerate(candidates):
        routing[i, 1, 0], valid[i, 1] = torch.tensor(c), True
    return routing, valid


def _priced(u, tokens):
    return scale_unique_experts(u, num_experts=64, top_k=8, profile=DEEPSEEK, tokens=tokens)


def test_each_candidate_is_priced_as_if_verified_last():
    exchange = _exchange()
    assert exchange.rate() == exchange.prior == 2.0 and exchange.scale() == 1.0
    exchange.update(*_step(list(range(8)), list(range(8, 16)), list(range(16, 24))))
    # Either candidate, removed with its token: the union falls from 24 to 16.
    last = _priced(24.0, 3) - _priced(16.0, 2)
    assert exchange.experts.sum() == 16
    assert exchange.rate() == pytest.approx((2.0 * 10 + 2 * last) / (10 + 16))
    assert exchange.scale() == pytest.approx(exchange.rate() / 2.0)


def test_a_step_without_candidates_or_new_experts_adds_no_rise():
    exchange = _exchange()
    routing, valid = _batch_step(40, range(40, 46))
    valid[:, 1] = False  # only the roots verified
    exchange.update(routing, valid)
    assert exchange.rate() == 2.0
    shared = _exchange()
    shared.update(*_step(list(range(8)), list(range(8))))  # the candidate reads the root's
    assert shared.experts.sum() == 0 and shared.charged.sum() == pytest.approx(0.0)
    same = _exchange(profile=dataclasses.replace(DEEPSEEK, num_experts=64, top_k=8))
    same.update(*_batch_step(40, range(40, 46)))
    # A profile of the testbed's shape: every testbed expert is one of its own.
    assert same.rate() == pytest.approx((2.0 * 10 + 6) / 16)


def test_near_saturation_the_last_experts_cost_more_than_the_roots_slope_says():
    """The cliff: 16 roots at 58 of 64 experts, six candidates fill the layer. The sweep's
    prior is the map's slope at the roots; each candidate, verified last, costs far more."""
    slope = sweep_plan.testbed_expert_weight(58.0, 16, num_experts=64, top_k=8, profile=DEEPSEEK)
    exchange = _exchange(prior=slope, prior_experts=1e-9)
    exchange.update(*_batch_step(58, range(58, 64)))
    assert exchange.rate() == pytest.approx(_priced(64.0, 22) - _priced(63.0, 21))
    assert exchange.rate() > 3 * slope
    far = _exchange(prior=1.0, prior_experts=1e-9)
    far.update(*_batch_step(16, range(16, 22)))
    assert far.rate() < exchange.rate() / 5


def test_invalid_rows_and_bad_priors():
    exchange = _exchange()
    routing, _ = _step([0, 1], [2, 3])
    exchange.update(routing, torch.tensor([[False, False]]))
    assert exchange.experts.sum() == 0
    with pytest.raises(ValueError, match="must be > 0"):
        _exchange(prior=0.0)
    with pytest.raises(ValueError, match="must be > 0"):
        _exchange(prior_experts=-1.0)


PROMPTS = random_prompts(3, seed=5)
MAX_NEW = 16


engine = tiny_engine_fixture("engine_exchange", PROMPTS, MAX_NEW + 8)


def test_the_engine_scales_its_layer_weights_by_the_measured_rate(engine):
    """A profile far larger than the tiny target (16 experts) makes every added expert dear:
    the rate climbs above its prior, adaptive verifies fewer candidates, the output stays
    the target's own."""
    greedy = engine.generate_greedy(PROMPTS, MAX_NEW)
    spec = SpecConfig(
        budget=4,
        layer_weights=(1.0,) * LAYERS,
        selection=ENGINE_SELECTION.replace(policy="adaptive", eps=0.5, step_cost=40.0),
    )
    fixed = engine.generate_speculative(
        PROMPTS, MAX_NEW, spec, OnlineExpertPredictor(LAYERS, EXPERTS, TOP_K)
    )
    exchange = _tiny_exchange()
    measured = engine.generate_speculative(
        PROMPTS, MAX_NEW, spec, OnlineExpertPredictor(LAYERS, EXPERTS, TOP_K), exchange=exchange
    )
    assert fixed.outputs == measured.outputs == greedy.outputs
    assert exchange.experts.sum() > 0 and exchange.rate() > 2.0

    def verified(result):
        return sum(s.verified_tokens for s in result.steps) / sum(
            s.batch_size for s in result.steps
        )

    assert verified(measured) < verified(fixed)
    with pytest.raises(ValueError, match="layer_weights"):
        engine.generate_speculative(
            PROMPTS, MAX_NEW, dataclasses.replace(spec, layer_weights=None), exchange=exchange
        )


@pytest.mark.parametrize("total_weight", [0.0, None])
def test_under_ep_the_experts_off_the_busiest_rank_get_their_own_price(total_weight):
    """EP 8 (8 experts per rank): the root reads experts 0-7 (all on rank 0), the candidate
    8-15 (all on rank 1): the busiest rank does not rise, the union does by 8."""
    exchange = _exchange(ep_size=8, total_weight=total_weight)
    configured = 1 / 8 if total_weight is None else total_weight
    assert exchange.prices() == pytest.approx((2.0, 2.0 * configured))
    exchange.update(*_step(list(range(8)), list(range(8, 16))))
    assert exchange.experts.tolist() == [0.0, 8.0]
    # The pricing keeps the busiest rank's share of the union (ep_cost.scale_busiest_rank).
    load = _priced(16.0, 2) * 8 / 16
    assert exchange.charged[0] == pytest.approx(load - _priced(8.0, 1) - (load - _priced(8.0, 2)))
    assert exchange.charged[1] == pytest.approx(load - _priced(8.0, 2))
    others = (2.0 * configured * 10 + exchange.charged[1]) / (10 + 8)
    assert exchange.prices() == pytest.approx((2.0 + exchange.charged[0] / 10, others))
    # Selection gets total_weight = the others' price over the busiest rank's, in [0, 1].
    options, extra = exchange.adjust(
        SelectionOptions("adaptive", 0.1, True, total_weight, step_cost=1.0),
        {"layer_weights": torch.ones(3)},
    )
    busiest = exchange.prices()[0]
    assert options.total_weight == pytest.approx(min(max(others / busiest, 0.0), 1.0))
    assert extra["layer_weights"].tolist() == pytest.approx([busiest / 2.0] * 3)
    with pytest.raises(ValueError, match="divide 64"):
        _exchange(prior=1.0, prior_experts=1.0, ep_size=6)


def test_saturated_ranks_make_the_other_experts_cost():
    """Roots fill rank 0 (experts 0-7) and half of every other rank; each candidate adds one
    expert on another rank. The busiest rank does not rise, but the pricing keeps its share
    of a profile union that grows faster than the testbed's near saturation, so the other
    experts cost; with few experts loaded they cost next to nothing."""
    exchange = _exchange(prior=1.0, prior_experts=1e-9, ep_size=8)
    full = list(range(8)) + [r * 8 + j for r in range(1, 8) for j in range(4)]  # 36 experts
    roots = [full[i : i + 8] for i in range(0, 32, 8)] + [full[32:] + full[:4]] * 3
    candidates = [[r * 8 + 5, *range(7)] for r in range(1, 8)]
    routing = torch.tensor([[[root], [c]] for root, c in zip(roots, candidates, strict=True)])
    exchange.update(routing, torch.ones(7, 2, dtype=torch.bool))
    assert exchange.experts[0] == 0 and exchange.experts[1] == 7
    roomy = _exchange(prior=1.0, prior_experts=1e-9, ep_size=8)
    root = [[0, 1, 2, 8, 16, 24, 32, 40]] * 7  # rank 0 holds 3, the others 1 each
    candidates = [[r * 8 + 1, *root[0][:7]] for r in range(1, 8)]
    routing = torch.tensor([[[a], [c]] for a, c in zip(root, candidates, strict=True)])
    roomy.update(routing, torch.ones(7, 2, dtype=torch.bool))
    assert roomy.experts[0] == 0 and roomy.experts[1] == 7
    assert 0 <= roomy.prices()[1] < exchange.prices()[1] / 3


def test_the_live_recall_measures_new_experts_at_the_exchange_s_total_weight(engine, monkeypatch):
    """Under EP a candidate's measured new experts n join DeltaCost, so they are counted
    with the total_weight the step selected with: the exchange's, not the configured one."""
    from sgl_ecospec.lab.engine import offline

    class FixedPrices(ExpertExchange):
        def prices(self):
            return 1.0, 0.5  # total_weight 0.5 under EP

    seen = []

    def record(*args, total_weight=None, **kwargs):
        seen.append(total_weight)
        return record_recall(*args, total_weight=total_weight, **kwargs)

    record_recall = offline.record_recall
    monkeypatch.setattr(offline, "record_recall", record)
    spec = SpecConfig(
        budget=4,
        layer_weights=(1.0,) * LAYERS,
        expert_rank=(torch.arange(EXPERTS) // 4).tolist(),
        num_ranks=4,
        recall_weighted_cost=True,
        selection=ENGINE_SELECTION.replace(
            policy="adaptive", eps=0.5, step_cost=40.0, total_weight=0.0
        ),
    )
    exchange = _tiny_exchange(kind=FixedPrices, ep_size=4, total_weight=0.0)
    result = engine.generate_speculative(
        PROMPTS, 4, spec, OnlineExpertPredictor(LAYERS, EXPERTS, TOP_K), exchange=exchange
    )
    assert result.steps and seen == [0.5] * len(result.steps)
