"""What the engine hands the expert predictor (sgl_ecospec/lab/engine/predictor_inputs.py,
``sgl_ecospec.step.tree_context``) and the recall-weighted selection cost."""

import pytest
import torch

from sgl_ecospec.lab.engine import ENGINE_SELECTION, OracleExpertPredictor, SpecConfig
from sgl_ecospec.lab.engine.predictor_inputs import next_root_context, verified_context
from sgl_ecospec.ops.selection import SelectionOptions
from sgl_ecospec.predictors import ContextExpertPredictor, LiveRecall, OnlineExpertPredictor
from sgl_ecospec.step import select_step, tree_context

L, E, K, V = 4, 16, 2, 64


def test_tree_context_is_each_rows_parent_token():
    tokens = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    parents = torch.tensor([[-1, -1, 0, 2], [-1, 0, 1, -1]])
    got = tree_context(tokens, parents, torch.tensor([9, 19]))
    assert got.tolist() == [[9, 10, 10, 11, 13], [19, 20, 21, 22, 20]]
    assert tree_context(tokens, parents)[:, 0].tolist() == [-1, -1]


class ContextSpy(ContextExpertPredictor):
    def predict_topk(self, token_ids, hidden=None, *, validate=False, context_tokens=None):
        self.seen = context_tokens
        return super().predict_topk(token_ids, hidden, context_tokens=context_tokens)


def tree(batch=2, candidates=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (batch, 1 + candidates), generator=gen)
    scores = torch.rand(batch, candidates, generator=gen)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2]] * batch)[:, :candidates]
    scores = torch.where(parents >= 0, scores * 0.5, scores)  # children below their parents
    return tokens, scores, parents


def test_select_step_hands_context_only_to_predictors_that_read_it():
    tokens, scores, parents = tree()
    spy = ContextSpy(L, E, K, vocab_size=V, pair_buckets=16)
    options = SelectionOptions("ecospec")
    step = select_step(spy, tokens, scores, parents, 3, options, root_context=torch.tensor([5, 6]))
    assert torch.equal(step.context, tree_context(tokens, parents, torch.tensor([5, 6])))
    assert torch.equal(spy.seen, step.context.flatten())
    plain = select_step(OnlineExpertPredictor(L, E, K), tokens, scores, parents, 3, options)
    assert plain.context is None and verified_context(plain, torch.ones(2, 4, dtype=bool)) == {}
    valid = torch.ones(2, 4, dtype=torch.bool)
    rows = torch.cat([torch.zeros(2, 1, dtype=torch.long), 1 + step.selected], 1)
    want = step.context.gather(1, rows).flatten()
    assert torch.equal(verified_context(step, valid)["context_tokens"], want)


def test_next_root_context_is_the_token_before_the_new_root():
    roots = torch.tensor([7, 8, 9])
    got = next_root_context(roots, [[1, 2, 3], [4], [5, 6]])
    assert got.tolist() == [2, 8, 5]


def trained_online(seed=0):
    gen = torch.Generator().manual_seed(seed)
    predictor = OnlineExpertPredictor(L, E, K, num_buckets=V)
    topk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(V * L)])
    predictor.observe(torch.arange(V), topk.view(V, L, K))
    return predictor


@pytest.mark.parametrize("seed", range(4))
def test_cold_trust_selects_as_confidence_and_full_trust_as_ecospec(seed):
    tokens, scores, parents = tree(batch=3, seed=seed)
    predictor = trained_online(seed)
    options = SelectionOptions("ecospec", eps=0.1, share_buffer=True)
    confidence = select_step(
        predictor, tokens, scores, parents, 3, SelectionOptions("confidence")
    ).selected
    ecospec = select_step(predictor, tokens, scores, parents, 3, options).selected
    live = LiveRecall.of(predictor)
    live.novel.fill_(K * (1 - K / E))  # as measured: every candidate pays it alike

    cold, weights = live.weigh(options, None, host_eps=True)
    assert cold.eps == pytest.approx(0.1 + L * K * (1 - K / E))
    assert torch.equal(weights, torch.zeros(L))
    for host_eps in (True, False):
        got = select_step(
            predictor, tokens, scores, parents, 3, options, live_recall=live, host_eps=host_eps
        ).selected
        assert torch.equal(got, confidence)

    live.trust.fill_(1.0)  # a perfect predictor is trusted fully
    trusted, weights = live.weigh(options, None, host_eps=True)
    assert trusted.eps == pytest.approx(0.1) and weights.tolist() == [1.0] * L
    got = select_step(predictor, tokens, scores, parents, 3, options, live_recall=live).selected
    assert torch.equal(got, ecospec)


def test_configured_layer_weights_scale_the_trust():
    predictor = trained_online()
    live = LiveRecall.of(predictor)
    live.trust.fill_(1.0)
    base = torch.tensor([1.0, 0.0, 2.0, 1.0], dtype=torch.float64)
    _, weights = live.weigh(SelectionOptions("ecospec"), base, host_eps=True)
    assert weights.tolist() == [1.0, 0.0, 2.0, 1.0]


def test_adaptive_sizes_a_cold_predictors_sets_by_the_measured_token_cost():
    """A cold predictor's sets are sized by what a verified token really costs (n_l): where
    tokens use experts the others hold already, "adaptive" takes the nodes whose
    probability pays for the step; where each brings K new ones, none."""
    batch = 4
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (batch, 7), generator=gen)
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]] * batch)
    parents = torch.full((batch, 6), -1)
    options = SelectionOptions("adaptive", eps=0.5, share_buffer=True, step_cost=4.0)
    predictor = trained_online()
    live = LiveRecall.of(predictor, rate=1.0)

    def taken():
        chosen = select_step(
            predictor, tokens, scores, parents, 6, options, live_recall=live, host_eps=True
        )
        return int((chosen.selected >= 0).sum())

    disjoint = torch.randperm(E, generator=gen)[: 2 * batch * K].view(batch, 2, 1, K)
    live.update_novel(disjoint.expand(-1, -1, L, -1))  # candidates on experts no root uses
    assert live.novel.tolist() == [float(K)] * L
    assert taken() == 0
    live.update_novel(torch.arange(K).expand(batch, 2, L, K))  # the roots' experts again
    assert live.novel.tolist() == [0.0] * L
    assert taken() == batch * 6


def test_spec_config_checks_the_flag():
    assert SpecConfig(
        recall_weighted_cost=True, selection=ENGINE_SELECTION.replace(policy="ecospec")
    ).recall_weighted_cost
    with pytest.raises(TypeError, match="recall_weighted_cost"):
        SpecConfig(recall_weighted_cost="yes")


def test_bench_times_each_prediction_and_reports_the_recall_per_layer():
    from sgl_ecospec.lab.bench.predictor_replay import memory_bytes
    from sgl_ecospec.lab.bench.predictor_stats import TimedPredictor, predictor_fields, timed

    inner = ContextExpertPredictor(L, E, K, vocab_size=V, pair_buckets=16)
    predictor = timed(inner)
    assert isinstance(predictor, TimedPredictor) and predictor.needs_context
    oracle = OracleExpertPredictor(L, E, K)
    assert timed(oracle) is oracle  # the engine primes it: not wrapped
    assert predictor_fields(oracle) == {
        "predict_ms_per_step": None,
        "predictor_recall_per_layer": None,
    }
    assert predictor.memory_bytes() == inner.memory_bytes() == memory_bytes(inner)
    tokens, scores, parents = tree()
    step = select_step(predictor, tokens, scores, parents, 3, SelectionOptions("ecospec"))
    assert predictor.calls == 1 and predictor.seconds > 0
    truth = torch.randint(0, E, (tokens.numel(), L, K))
    LiveRecall.of(predictor).update(step.predicted.flatten(0, 1), truth)
    fields = predictor_fields(predictor)
    assert fields["predict_ms_per_step"] == pytest.approx(1e3 * predictor.seconds)
    assert len(fields["predictor_recall_per_layer"]) == L
