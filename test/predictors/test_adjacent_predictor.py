"""AdjacentExpertPredictor (sgl_ecospec/predictors/adjacent.py): recency in the cached rows,
an unseen token predicted by its parent, saving and loading, the catalog name (its graph
safety: test_context_graph.py)."""

import pytest
import torch
from test_context_predictor import E, K, L, V, ids, routing_of, sorted_rows

from sgl_ecospec.predictors import (
    AdjacentExpertPredictor,
    ContextExpertPredictor,
    load_predictor,
    make_predictor,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_an_unseen_token_takes_its_seen_parents_experts():
    pred = AdjacentExpertPredictor(L, E, K, vocab_size=V, pair_buckets=64)
    seen = ids(1, 2, 3)
    pred.observe(seen, routing_of(seen), context_tokens=ids(-1, 1, 2))
    got = pred.predict_topk(ids(9, 9, 9, 2), context_tokens=ids(3, -1, 20, 1))
    global_topk = pred.prior_topk.long()
    # Parent 3 seen: its experts; parent unknown or unseen: the global top-K.
    assert sorted_rows(got[:1]) == sorted_rows(routing_of(ids(3)))
    assert torch.equal(got[1], global_topk) and torch.equal(got[2], global_topk)
    # A seen token keeps its own (here its pair's) experts whatever its parent.
    assert sorted_rows(got[3:]) == sorted_rows(routing_of(ids(2)))
    # Without context every unseen token uses the global top-K, as ContextExpertPredictor.
    assert torch.equal(pred.predict_topk(ids(9))[0], global_topk)


def test_the_latest_routing_breaks_near_ties_but_not_a_habit():
    adjacent = AdjacentExpertPredictor(L, E, K, vocab_size=V, recent_weight=0.5)
    token = ids(4)
    usual, other = routing_of(token), routing_of(token, shift=1)
    # Two ways seen once each: the latest leads.
    adjacent.observe(token, usual)
    adjacent.observe(token, other)
    assert sorted_rows(adjacent.predict_topk(token)) == sorted_rows(other)
    # With weight 0.5 a habit of over three quarters of the observations (here 7 of 9)
    # outvotes the latest routing.
    for _ in range(6):
        adjacent.observe(token, usual)
    adjacent.observe(token, other)
    assert sorted_rows(adjacent.predict_topk(token)) == sorted_rows(usual)


def test_pair_rows_also_lean_to_their_latest_routing():
    pred = AdjacentExpertPredictor(L, E, K, vocab_size=V, pair_buckets=64)
    token, parent = ids(7), ids(1)
    pred.observe(token, routing_of(token), context_tokens=parent)
    pred.observe(token, routing_of(token, shift=2), context_tokens=parent)
    got = pred.predict_topk(token, context_tokens=parent)
    assert sorted_rows(got) == sorted_rows(routing_of(token, shift=2))


def test_save_load_round_trip_catalog_and_checks(tmp_path):
    pred = make_predictor("adjacent", L, E, K, vocab_size=V)
    assert isinstance(pred, AdjacentExpertPredictor) and pred.pair_buckets > 0
    assert pred.memory_bytes() == make_predictor("context", L, E, K, vocab_size=V).memory_bytes()
    tokens = torch.arange(10)
    pred.observe(tokens, routing_of(tokens), context_tokens=tokens.roll(1))
    path = tmp_path / "adjacent.pt"
    pred.save(path)
    queries, parents = torch.arange(20), torch.arange(20).roll(1)
    for loaded in (AdjacentExpertPredictor.load(path, num_layers=L), load_predictor(path)):
        assert isinstance(loaded, AdjacentExpertPredictor) and loaded.config() == pred.config()
        assert torch.equal(
            loaded.predict_topk(queries, context_tokens=parents),
            pred.predict_topk(queries, context_tokens=parents),
        )
    with pytest.raises(ValueError, match="not a saved ContextExpertPredictor"):
        ContextExpertPredictor.load(path)
    with pytest.raises(ValueError, match="recent_weight"):
        AdjacentExpertPredictor(L, E, K, recent_weight=0)
