"""ContextExpertPredictor, AdjacentExpertPredictor and LiveRecall as graphs: prediction
compiles once and keeps reading the live tables while ``observe`` changes them in place; none
syncs with the host."""

import pytest
import torch
from _util import compile_once, host_syncs

from sgl_ecospec.ops.selection import SelectionOptions
from sgl_ecospec.predictors import AdjacentExpertPredictor, ContextExpertPredictor, LiveRecall

PREDICTORS = [ContextExpertPredictor, AdjacentExpertPredictor]

L, E, K, V = 2, 70, 3, 300


def routing(seed: int, count: int = 200):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (count,), generator=gen)
    context = torch.randint(-1, V, (count,), generator=gen)
    return tokens, torch.randint(0, E, (count, L, K), generator=gen), context


@pytest.mark.parametrize("kind", PREDICTORS)
def test_prediction_compiles_once_and_follows_observe(kind):
    torch._dynamo.reset()
    predictor = kind(L, E, K, vocab_size=V, pair_buckets=512)

    def predict(token_ids, context):
        return predictor.predict_topk(token_ids, context_tokens=context)

    compiled, recorder = compile_once(predict, "aot_eager")
    queries, _, context = routing(99, 60)
    answers = []
    for seed in range(4):
        tokens, topk, parents = routing(seed)
        predictor.observe(tokens, topk, validate=False, context_tokens=parents)
        # Half the queries are pairs just learnt, so the pair table is read too.
        q, c = torch.cat([queries, tokens[:60]]), torch.cat([context, parents[:60]])
        got, want = compiled(q, c), predict(q, c)
        assert torch.equal(got, want), seed
        answers.append(got)
    assert len(recorder.graphs) == 1
    assert not torch.equal(answers[0], answers[-1])
    assert host_syncs(predict, queries, context) == []
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", PREDICTORS)
def test_observe_and_live_recall_have_no_host_sync(kind):
    predictor = kind(L, E, K, vocab_size=V, pair_buckets=512)
    live = LiveRecall(L, E, K)
    tokens, topk, parents = routing(0, 40)

    def learn(tokens, topk, parents):
        predicted = predictor.predict_topk(tokens, context_tokens=parents)
        live.update(predicted, topk, tokens >= 0)
        predictor.observe(tokens, topk, validate=False, context_tokens=parents)
        live.update_novel(topk[:8].view(4, 2, L, K), (tokens[:8] >= 0).view(4, 2))
        options = SelectionOptions("ecospec", eps=0.5, share_buffer=True)
        return live.weigh(options, None, host_eps=False)[1], live.unpredicted_cost()

    assert host_syncs(learn, tokens, topk, parents) == []
