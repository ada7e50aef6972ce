"""ContextExpertPredictor (sgl_ecospec/predictors/context.py) and the predictor catalog."""

import pytest
import torch

from sgl_ecospec.predictors import (
    ContextExpertPredictor,
    OnlineExpertPredictor,
    load_predictor,
    make_predictor,
)

L, E, K, V = 3, 16, 2, 50


pytestmark = pytest.mark.usefixtures("one_thread")


def ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def routing_of(token_ids, shift=0):
    """A deterministic token -> experts map, distinct experts per layer; ``shift`` moves it."""
    t = torch.as_tensor(token_ids, dtype=torch.int64)[:, None, None] + shift
    layer = torch.arange(L)[None, :, None]
    slot = torch.arange(K)[None, None, :]
    return (t * 5 + layer * 3 + slot * 7) % E


def sorted_rows(pred):
    return [[sorted(layer) for layer in row] for row in pred.tolist()]


def test_every_token_its_own_row_is_exact_after_one_observe():
    pred = ContextExpertPredictor(L, E, K, vocab_size=V)
    tokens = torch.arange(V)
    pred.observe(tokens, routing_of(tokens))
    got = pred.predict_topk(tokens.int())
    assert got.dtype == torch.int64 and got.shape == (V, L, K)
    assert sorted_rows(got) == sorted_rows(routing_of(tokens))
    assert pred.recall(tokens, routing_of(tokens)) == 1.0


def test_hashed_rows_mix_colliding_tokens_but_vocab_rows_do_not():
    hashed = ContextExpertPredictor(L, E, K, token_buckets=1)  # every token in one row
    vocab = ContextExpertPredictor(L, E, K, vocab_size=V)
    tokens = ids(3, 3, 3, 4)
    for pred in (hashed, vocab):
        pred.observe(tokens, routing_of(tokens))
    assert sorted_rows(hashed.predict_topk(ids(4))) == sorted_rows(routing_of(ids(3)))
    assert sorted_rows(vocab.predict_topk(ids(4))) == sorted_rows(routing_of(ids(4)))


def test_pair_rows_tell_contexts_apart_and_back_off_to_the_token():
    pred = ContextExpertPredictor(L, E, K, vocab_size=V, pair_buckets=256)
    token = ids(7, 7, 7)
    # Token 7 after 1 (twice) routes one way, after 2 another way.
    routing = torch.cat([routing_of(ids(7, 7)), routing_of(ids(7), shift=1)])
    pred.observe(token, routing, context_tokens=ids(1, 1, 2))
    after_1 = pred.predict_topk(ids(7), context_tokens=ids(1))
    after_2 = pred.predict_topk(ids(7), context_tokens=ids(2))
    assert sorted_rows(after_1) == sorted_rows(routing_of(ids(7)))
    assert sorted_rows(after_2) == sorted_rows(routing_of(ids(7), shift=1))
    # Unknown or unseen parents, and no context at all, use the token row: its majority.
    for context in (ids(-1), ids(9), None):
        got = pred.predict_topk(ids(7), context_tokens=context)
        assert sorted_rows(got) == sorted_rows(routing_of(ids(7))), context


def test_unseen_token_uses_the_global_frequency():
    pred = ContextExpertPredictor(L, E, K, vocab_size=V)
    routing = torch.empty(20, L, K, dtype=torch.int64)
    routing[:, :, 0] = 5
    routing[:, :, 1] = torch.where(torch.arange(20) < 12, 6, torch.arange(20) % 5)[:, None]
    pred.observe(torch.arange(20), routing)
    assert pred.predict_topk(ids(40))[0].tolist() == [[5, 6]] * L  # most frequent first


def test_a_batch_equals_the_same_rows_one_at_a_time():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (40,), generator=gen)
    context = torch.randint(-1, 3, (40,), generator=gen)
    routing = torch.randint(0, E, (40, L, K), generator=gen)
    # Enough slots that no two of the 18 pairs share one (eviction is tested below).
    batched = ContextExpertPredictor(L, E, K, vocab_size=V, pair_buckets=1 << 16)
    single = ContextExpertPredictor(L, E, K, vocab_size=V, pair_buckets=1 << 16)
    batched.observe(tokens, routing, context_tokens=context)
    for i in range(40):
        single.observe(tokens[i : i + 1], routing[i : i + 1], context_tokens=context[i : i + 1])
    # The last row of each table is the scratch row that duplicate writes go to.
    assert torch.equal(batched.token_counts[:-1], single.token_counts[:-1])
    assert torch.equal(batched.pair_keys[:-1], single.pair_keys[:-1])
    assert torch.equal(batched.pair_counts[:-1], single.pair_counts[:-1])
    assert torch.equal(batched.prior, single.prior)


@pytest.mark.parametrize("count_dtype", ["uint8", "int16"])
def test_compact_counts_halve_at_their_limit_and_keep_the_majority(count_dtype):
    pred = ContextExpertPredictor(L, E, K, vocab_size=V, count_dtype=count_dtype)
    limit = 255 if count_dtype == "uint8" else 32767
    token = torch.full((100,), 3)
    major, minor = routing_of(ids(3)), routing_of(ids(3), shift=1)
    rounds = limit // 60 + 2
    for _ in range(rounds):
        pred.observe(token, torch.cat([major.expand(60, -1, -1), minor.expand(40, -1, -1)]))
    counts = pred.token_counts[3].float()
    assert counts.max() <= limit and counts.max() >= limit // 4  # halved, not reset
    assert sorted_rows(pred.predict_topk(ids(3))) == sorted_rows(major)


def test_a_new_pair_evicts_the_old_one_in_its_slot_without_mixing():
    pred = ContextExpertPredictor(L, E, K, vocab_size=V, pair_buckets=1)
    pred.observe(ids(7), routing_of(ids(7), shift=1), context_tokens=ids(1))
    pred.observe(ids(8), routing_of(ids(8), shift=3), context_tokens=ids(2))
    assert pred.pair_keys[0] == (2 << 32) | 8
    assert sorted_rows(pred.predict_topk(ids(8), context_tokens=ids(2))) == sorted_rows(
        routing_of(ids(8), shift=3)
    )
    # The evicted pair (1, 7) backs off to token 7's row, which saw the same routing.
    got = pred.predict_topk(ids(7), context_tokens=ids(1))
    assert sorted_rows(got) == sorted_rows(routing_of(ids(7), shift=1))
    assert pred.pair_counts[0].sum() == L * K  # one observation, not two mixed


def test_save_load_round_trip_and_load_predictor(tmp_path):
    pred = ContextExpertPredictor(L, E, K, vocab_size=V, pair_buckets=32)
    tokens = torch.arange(10)
    pred.observe(tokens, routing_of(tokens), context_tokens=tokens.roll(1))
    path = tmp_path / "context.pt"
    pred.save(path)
    for loaded in (
        ContextExpertPredictor.load(path, num_layers=L),
        load_predictor(path, num_experts=E),
    ):
        assert isinstance(loaded, ContextExpertPredictor) and loaded.config() == pred.config()
        assert torch.equal(
            loaded.predict_topk(tokens, context_tokens=tokens.roll(1)),
            pred.predict_topk(tokens, context_tokens=tokens.roll(1)),
        )
    with pytest.raises(ValueError, match="different model"):
        load_predictor(path, num_layers=L + 1)
    other = ContextExpertPredictor(L, E, K, vocab_size=V)
    with pytest.raises(ValueError, match="different config"):
        other.load_state_dict(pred.state_dict())


def test_inputs_are_checked():
    pred = ContextExpertPredictor(L, E, K, vocab_size=V, pair_buckets=8)
    with pytest.raises(ValueError, match="vocab_size"):
        pred.predict_topk(ids(V), validate=True)
    with pytest.raises(ValueError, match="context_tokens must have shape"):
        pred.predict_topk(ids(1, 2), context_tokens=ids(1))
    with pytest.raises(ValueError, match="token_ids"):
        pred.predict_topk(None)
    with pytest.raises(ValueError, match="count_dtype"):
        ContextExpertPredictor(L, E, K, count_dtype="int8")
    with pytest.raises(ValueError, match="pair_weight"):
        ContextExpertPredictor(L, E, K, pair_weight=0)


def test_memory_of_a_vocabulary_table():
    pred = ContextExpertPredictor(L, E, K, vocab_size=V, pair_buckets=8)
    rows, slots = V + 1, 8 + 1
    counts = (rows + slots) * L * E  # uint8
    cached = (rows + slots) * L * K  # uint8 expert ids
    expected = counts + cached + rows + 8 * slots + 4 * L * E + L * K
    assert pred.memory_bytes() == expected


def test_catalog_builds_each_online_predictor_by_name():
    assert isinstance(make_predictor("online", L, E, K), OnlineExpertPredictor)
    vocab = make_predictor("vocab", L, E, K, vocab_size=V)
    context = make_predictor("context", L, E, K, vocab_size=V)
    assert vocab.num_rows == V and vocab.pair_buckets == 0 and context.pair_buckets > 0
    with pytest.raises(ValueError, match="vocab_size"):
        make_predictor("vocab", L, E, K)
    with pytest.raises(ValueError, match="unknown online predictor"):
        make_predictor("oracle", L, E, K)
