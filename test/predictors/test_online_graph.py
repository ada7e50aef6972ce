"""OnlineExpertPredictor's prediction as a graph: one compilation that keeps reading the live
count tables while ``observe`` (and its aging) changes them in place, with no host sync."""

import pytest
import torch
from _util import compile_once, host_syncs

from sgl_ecospec.predictors.online import OnlineExpertPredictor

L, E, K = 2, 70, 3


def routing(seed: int, count: int = 200):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (count,), generator=gen), torch.randint(
        0, E, (count, L, K), generator=gen
    )


@pytest.mark.parametrize("halve_every", [0, 2])
def test_prediction_compiles_once_and_follows_observe(halve_every):
    torch._dynamo.reset()
    predictor = OnlineExpertPredictor(L, E, K, num_buckets=32, halve_every=halve_every)

    def predict(token_ids):
        return predictor.predict_topk(token_ids), predictor.predict_bitmaps(token_ids)

    compiled, recorder = compile_once(predict, "aot_eager")
    queries = torch.arange(0, 300, 7)
    answers = []
    for seed in range(4):
        predictor.observe(*routing(seed), validate=False)
        got, want = compiled(queries), predict(queries)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
        answers.append(got[0])
    assert len(recorder.graphs) == 1
    # Learning changed the predictions, so a graph with frozen tables would have failed.
    assert not torch.equal(answers[0], answers[-1])
    assert host_syncs(predict, queries) == []
    torch._dynamo.reset()
