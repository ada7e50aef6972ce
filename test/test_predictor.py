import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ecospec.predictors import (
    ExpertPredictor,
    LowRankExpertHead,
    OnlineExpertPredictor,
    load_predictor,
    multi_hot,
    topk_recall,
    train_expert_head,
)

L, E, K = 3, 16, 2


def ids(rows):
    return torch.tensor(rows, dtype=torch.int64)


# --- topk_recall ---------------------------------------------------------------------------


def test_recall_hand_examples():
    true = ids([[[0, 1]], [[2, 3]]])
    assert topk_recall(true, true, 8) == 1.0
    assert topk_recall(ids([[[4, 5]], [[6, 7]]]), true, 8) == 0.0
    assert topk_recall(ids([[[0, 5]], [[3, 7]]]), true, 8) == 0.5
    # Order within a row does not matter.
    assert topk_recall(ids([[[1, 0]], [[3, 2]]]), true, 8) == 1.0


def test_recall_duplicates_count_once():
    # A repeated true id is one expert, so {1} fully covers [1, 1].
    assert topk_recall(ids([[[1, 2]]]), ids([[[1, 1]]]), 8) == 1.0
    # A repeated predicted id does not count twice: 1 of {1, 2} found.
    assert topk_recall(ids([[[1, 1]]]), ids([[[1, 2]]]), 8) == 0.5


def test_recall_mean_over_layers_and_different_k():
    pred = ids([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    true = ids([[[0, 9], [8, 9]]])  # layer 0: 1/2, layer 1: 0/2
    assert topk_recall(pred, true, 16) == 0.25


def test_recall_bad_inputs():
    with pytest.raises(ValueError, match=r"agree on \[T, L\]"):
        topk_recall(ids([[[0, 1]]]), ids([[[0, 1]], [[0, 1]]]), 8)
    with pytest.raises(ValueError, match="3 dims"):
        topk_recall(ids([[0, 1]]), ids([[0, 1]]), 8)
    with pytest.raises(ValueError, match="outside"):
        topk_recall(ids([[[0, 8]]]), ids([[[0, 1]]]), 8)
    with pytest.raises(ValueError, match="at least one token"):
        topk_recall(torch.zeros(0, 1, 2, dtype=torch.int64), torch.zeros(0, 1, 2).long(), 8)


@st.composite
def recall_cases(draw):
    num_experts = draw(st.integers(1, 130))
    tokens, layers = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    expert = st.integers(0, num_experts - 1)

    def id_lists(k):
        row = st.lists(expert, min_size=k, max_size=k)
        return st.lists(
            st.lists(row, min_size=layers, max_size=layers), min_size=tokens, max_size=tokens
        )

    return num_experts, draw(id_lists(draw(st.integers(1, 4)))), draw(id_lists(2))


@settings(max_examples=60, deadline=None)
@given(recall_cases())
def test_recall_matches_python_sets(case):
    num_experts, pred, true = case
    expected = [
        len(set(p) & set(t)) / len(set(t))
        for ptok, ttok in zip(pred, true, strict=True)
        for p, t in zip(ptok, ttok, strict=True)
    ]
    got = topk_recall(ids(pred), ids(true), num_experts)
    assert 0.0 <= got <= 1.0
    assert got == pytest.approx(sum(expected) / len(expected), abs=1e-12)


def test_multi_hot():
    hot = multi_hot(ids([[[0, 3], [2, 2]]]), 4)
    assert hot.dtype == torch.float32 and hot.shape == (1, 2, 4)
    assert hot.tolist() == [[[1, 0, 0, 1], [0, 0, 1, 0]]]
    with pytest.raises(ValueError, match="outside"):
        multi_hot(ids([[[0, 4]]]), 4)


# --- OnlineExpertPredictor -------------------------------------------------------------------


def routing_of(token_ids):
    """A deterministic token -> experts map: distinct experts per layer."""
    t = torch.as_tensor(token_ids, dtype=torch.int64)[:, None, None]
    layer = torch.arange(L)[None, :, None]
    slot = torch.arange(K)[None, None, :]
    return (t * 5 + layer * 3 + slot * 7) % E


def distinct_bucket_tokens(pred, n):
    tokens = torch.arange(1000, 1000 + 4 * n)
    _, first = torch.unique(pred.bucket_ids(tokens), return_inverse=True)
    keep = [i for i in range(tokens.numel()) if (first[:i] != first[i]).all()]
    return tokens[keep[:n]]


def test_online_perfect_after_one_observe():
    pred = OnlineExpertPredictor(L, E, K, num_buckets=256)
    tokens = distinct_bucket_tokens(pred, 50)
    pred.observe(tokens, routing_of(tokens))
    assert pred.recall(tokens, routing_of(tokens)) == 1.0
    out = pred.predict_topk(tokens.int())
    assert out.dtype == torch.int64 and out.shape == (50, L, K)
    bitmaps = pred.predict_bitmaps(tokens)
    assert bitmaps.dtype == torch.int64 and bitmaps.shape == (50, L, 1)


def test_online_learns_majority_routing():
    pred = OnlineExpertPredictor(L, E, K, num_buckets=64)
    token = torch.full((7,), 11)
    major = torch.tensor([[4, 9]] * L)
    minor = torch.tensor([[1, 2]] * L)
    routing = torch.stack([major] * 4 + [minor] * 3)
    pred.observe(token, routing[torch.randperm(7)])
    got = pred.predict_topk(token[:1])[0]
    assert [sorted(row) for row in got.tolist()] == [[4, 9]] * L


def test_online_unseen_token_uses_global_prior():
    pred = OnlineExpertPredictor(L, E, K, num_buckets=512)
    seen = distinct_bucket_tokens(pred, 21)
    unseen, seen = seen[:1], seen[1:]
    # Every seen token uses expert 5, most use 6, the second expert otherwise varies.
    routing = torch.empty(20, L, K, dtype=torch.int64)
    routing[:, :, 0] = 5
    routing[:, :, 1] = torch.where(torch.arange(20) < 12, 6, torch.arange(20) % 5)[:, None]
    pred.observe(seen, routing)
    got = pred.predict_topk(unseen)[0]
    assert got.tolist() == [[5, 6]] * L  # most frequent first


def test_online_prior_breaks_ties():
    pred = OnlineExpertPredictor(L, E, 1, num_buckets=512)
    a, b = distinct_bucket_tokens(pred, 2).tolist()
    # Token a saw experts 3 and 8 once each; globally 8 is more frequent (token b).
    pred.observe(
        torch.tensor([a, a, b, b]), torch.tensor([3, 8, 8, 8])[:, None, None].expand(4, L, 1)
    )
    assert pred.predict_topk(torch.tensor([a]))[0, :, 0].tolist() == [8] * L


def test_online_large_token_ids_and_collisions():
    pred = OnlineExpertPredictor(L, E, K, num_buckets=8)
    tokens = torch.tensor([0, 1, 2**20, 2**31 - 2, 2**31 - 1, 151_935] * 3)
    buckets = pred.bucket_ids(tokens)
    assert buckets.min() >= 0 and buckets.max() < 8
    pred.observe(tokens, routing_of(tokens % 97))
    out = pred.predict_topk(tokens)
    assert out.shape == (tokens.numel(), L, K)
    assert ((out >= 0) & (out < E)).all()
    # Rows stay distinct experts even when buckets are shared.
    assert (out[..., 0] != out[..., 1]).all()


def test_online_hash_spreads_consecutive_ids():
    pred = OnlineExpertPredictor(L, E, K, num_buckets=4096)
    buckets = pred.bucket_ids(torch.arange(150_000))
    counts = torch.bincount(buckets, minlength=4096)
    assert counts.min() > 0 and counts.max() <= 2 * counts.float().mean()


def test_online_observe_batch_equals_one_at_a_time():
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (40,))
    routing = torch.stack([torch.randperm(E)[:K] for _ in range(40 * L)]).view(40, L, K)
    batched = OnlineExpertPredictor(L, E, K, num_buckets=16)
    single = OnlineExpertPredictor(L, E, K, num_buckets=16)
    batched.observe(tokens, routing)
    for i in reversed(range(40)):
        single.observe(tokens[i : i + 1], routing[i : i + 1])
    assert torch.equal(batched.counts, single.counts)
    assert torch.equal(batched.prior, single.prior)
    assert batched.counts.sum() == 40 * L * K


def test_online_aging_halves_counts():
    tokens = torch.tensor([3, 4])
    plain = OnlineExpertPredictor(L, E, K, num_buckets=16)
    aged = OnlineExpertPredictor(L, E, K, num_buckets=16, halve_every=2)
    for _ in range(2):
        plain.observe(tokens, routing_of(tokens))
        aged.observe(tokens, routing_of(tokens))
    assert torch.equal(aged.counts, plain.counts * 0.5)
    assert torch.equal(aged.prior, plain.prior * 0.5)
    plain.observe(tokens, routing_of(tokens))
    aged.observe(tokens, routing_of(tokens))  # third call: no halving
    assert torch.equal(aged.counts, plain.counts * (2 / 3))


def test_online_save_load_round_trip(tmp_path):
    torch.manual_seed(1)
    pred = OnlineExpertPredictor(L, E, K, num_buckets=32, prior_weight=0.1, halve_every=5)
    tokens = torch.randint(0, 1000, (64,))
    routing = torch.stack([torch.randperm(E)[:K] for _ in range(64 * L)]).view(64, L, K)
    pred.observe(tokens, routing)
    path = tmp_path / "pred.pt"
    pred.save(path)
    loaded = OnlineExpertPredictor.load(path, num_layers=L, num_experts=E, top_k=K)
    assert loaded.config() == pred.config()
    assert loaded.observe_calls == 1
    probe = torch.arange(2000)
    assert torch.equal(loaded.predict_topk(probe), pred.predict_topk(probe))
    assert torch.equal(loaded.counts, pred.counts)


def test_online_load_errors(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt.*OnlineExpertPredictor.save"):
        OnlineExpertPredictor.load(missing)
    path = tmp_path / "pred.pt"
    OnlineExpertPredictor(L, E, K, num_buckets=32).save(path)
    with pytest.raises(ValueError, match=r"pred\.pt.*num_experts: saved 16, expected 128"):
        OnlineExpertPredictor.load(path, num_experts=128)
    other = OnlineExpertPredictor(L, E, K, num_buckets=64)
    with pytest.raises(ValueError, match=r"pred\.pt.*num_buckets: saved 32, expected 64"):
        other.load_state_dict(torch.load(path), source=f"predictor file {path}")
    junk = tmp_path / "junk.pt"
    torch.save({"counts": torch.zeros(1)}, junk)
    with pytest.raises(ValueError, match="junk.pt.*not a saved OnlineExpertPredictor"):
        OnlineExpertPredictor.load(junk)


def test_online_input_errors():
    pred = OnlineExpertPredictor(L, E, K, num_buckets=16)
    tokens = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"topk_ids must have shape \(2, 3, 2\)"):
        pred.observe(tokens, torch.zeros(2, L, K + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="token_ids must have 1 dims"):
        pred.predict_topk(tokens[None])
    with pytest.raises(TypeError, match="token_ids must have dtype"):
        pred.predict_topk(tokens.float())
    with pytest.raises(ValueError, match="token_ids must be >= 0"):
        pred.observe(torch.tensor([1, -1]), routing_of([1, 1]))
    with pytest.raises(ValueError, match=r"expert id \d+, outside \[0, 16\)"):
        pred.observe(tokens, routing_of([1, 2]) + E)
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        OnlineExpertPredictor(L, 4, 5)
    with pytest.raises(ValueError, match="prior_weight"):
        OnlineExpertPredictor(L, E, K, prior_weight=-1.0)
    # Without validate no value is checked, and nothing was counted by the failed calls.
    pred.predict_topk(torch.tensor([-1]))
    assert pred.counts.sum() == 0 and pred.observe_calls == 0


def test_predictor_is_abstract():
    with pytest.raises(TypeError):
        ExpertPredictor(L, E, K)


# --- LowRankExpertHead -----------------------------------------------------------------------

H = 32


def clustered_data(num_tokens, seed=0, num_clusters=8):
    """Hidden states around cluster centres; routing is a fixed function of the cluster."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_clusters, H, generator=g) * 3
    routes = torch.stack(
        [torch.randperm(E, generator=g)[:K] for _ in range(num_clusters * L)]
    ).view(num_clusters, L, K)
    cluster = torch.randint(0, num_clusters, (num_tokens,), generator=g)
    hidden = centres[cluster] + 0.3 * torch.randn(num_tokens, H, generator=g)
    return hidden, routes[cluster]


def test_head_trains_to_high_recall(capsys):
    torch.manual_seed(0)
    hidden, routing = clustered_data(2000)
    head = LowRankExpertHead(H, L, E, K, rank=16, token_buckets=0)
    untrained = head.recall(None, routing, hidden)
    assert untrained < 0.4  # chance is K / E = 0.125
    history = train_expert_head(head, hidden, routing, epochs=5, batch_size=128, lr=1e-2)
    assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_recall"] > 0.9
    assert capsys.readouterr().out.count("val recall") == 5
    out = head.predict_topk(torch.arange(10), hidden[:10])
    assert out.dtype == torch.int64 and out.shape == (10, L, K)


def test_head_online_observe_learns_under_inference_mode():
    torch.manual_seed(0)
    hidden, routing = clustered_data(512, seed=3)
    head = LowRankExpertHead(H, L, E, K, rank=16, token_buckets=0, lr=1e-2)
    before = head.recall(None, routing, hidden)
    with torch.inference_mode():
        for _ in range(30):
            head.observe(None, routing, hidden)
    assert head.recall(None, routing, hidden) > max(0.8, before)


def token_and_context_data(num_tokens, seed=0, vocab=12, num_clusters=4):
    """Routing fixed by (token, cluster): siblings share the hidden state (the cluster), so
    only the token tells them apart, and one token routes differently per cluster."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_clusters, H, generator=g) * 3
    routes = torch.stack(
        [torch.randperm(E, generator=g)[:K] for _ in range(vocab * num_clusters * L)]
    )
    routes = routes.view(vocab, num_clusters, L, K)
    cluster = torch.randint(0, num_clusters, (num_tokens,), generator=g)
    tokens = torch.randint(0, vocab, (num_tokens,), generator=g)
    hidden = centres[cluster] + 0.3 * torch.randn(num_tokens, H, generator=g)
    return tokens, hidden, routes[tokens, cluster]


def test_head_token_term_tells_apart_siblings():
    torch.manual_seed(0)
    tokens, hidden, routing = token_and_context_data(4000)
    recalls = {}
    for buckets in (0, 256):
        head = LowRankExpertHead(H, L, E, K, rank=32, token_buckets=buckets)
        history = train_expert_head(
            head, hidden, routing, tokens, epochs=8, batch_size=128, lr=1e-2, progress=False
        )
        recalls[buckets] = history[-1]["val_recall"]
    assert recalls[256] > 0.85
    assert recalls[0] < 0.6  # hidden alone cannot know which sibling token it is


def test_head_holdout_last_measures_unseen_tail():
    # The first 3/4 of the rows come from clusters 0-3, the tail from a cluster never seen:
    # a random split sees it in training, the tail split does not.
    tokens, hidden, routing = token_and_context_data(2000, num_clusters=4)
    tail_tokens, tail_hidden, tail_routing = token_and_context_data(500, seed=9, num_clusters=1)
    tokens = torch.cat([tokens, tail_tokens])
    hidden, routing = torch.cat([hidden, tail_hidden]), torch.cat([routing, tail_routing])
    recalls = {}
    for holdout in ("random", "last"):
        torch.manual_seed(0)
        head = LowRankExpertHead(H, L, E, K, rank=32, token_buckets=256)
        history = train_expert_head(
            head,
            hidden,
            routing,
            tokens,
            epochs=6,
            val_fraction=0.2,
            holdout=holdout,
            progress=False,
        )
        recalls[holdout] = history[-1]["val_recall"]
    assert recalls["random"] > 0.8 and recalls["last"] < recalls["random"] - 0.2


def test_head_save_load_and_load_predictor(tmp_path):
    torch.manual_seed(0)
    tokens, hidden, routing = token_and_context_data(512)
    head = LowRankExpertHead(H, L, E, K, rank=8, token_buckets=64, lr=1e-2)
    for _ in range(5):
        head.observe(tokens, routing, hidden)
    path = tmp_path / "head.pt"
    head.save(path)
    loaded = load_predictor(path, num_layers=L, num_experts=E, top_k=K, hidden_size=H)
    assert isinstance(loaded, LowRankExpertHead) and loaded.needs_hidden
    assert loaded.config() == head.config() and loaded.lr == 0
    assert torch.equal(loaded.predict_topk(tokens, hidden), head.predict_topk(tokens, hidden))
    # Loaded heads are frozen: observing changes nothing.
    before = [p.clone() for p in loaded.parameters()]
    loaded.observe(tokens, routing, hidden)
    assert all(torch.equal(a, b) for a, b in zip(before, loaded.parameters(), strict=True))
    online = tmp_path / "online.pt"
    OnlineExpertPredictor(L, E, K, num_buckets=32).save(online)
    assert type(load_predictor(online, num_layers=L)) is OnlineExpertPredictor
    with pytest.raises(ValueError, match=r"head\.pt.*hidden_size: saved 32, expected 64"):
        load_predictor(path, hidden_size=64)
    with pytest.raises(ValueError, match=r"online\.pt.*not a saved LowRankExpertHead"):
        LowRankExpertHead.load(online)
    with pytest.raises(FileNotFoundError, match="nope.pt.*train-head"):
        load_predictor(tmp_path / "nope.pt")
    junk = tmp_path / "junk.pt"
    junk.write_text("not a torch file")
    with pytest.raises(ValueError, match="junk.pt.*not a predictor file torch can read"):
        load_predictor(junk)


def test_head_input_errors():
    head = LowRankExpertHead(H, L, E, K, rank=4, token_buckets=0)
    tokens = torch.arange(2)
    with pytest.raises(ValueError, match=r"pass hidden \[T, 32\]"):
        head.predict_topk(tokens)
    with pytest.raises(ValueError, match=r"hidden must have shape \[T, 32\]"):
        head.predict_topk(tokens, torch.zeros(2, H + 1))
    with pytest.raises(ValueError, match=r"token_ids must have shape \(3,\)"):
        head.predict_topk(tokens, torch.zeros(3, H))
    with pytest.raises(ValueError, match=r"topk_ids must have shape \(2, 3, 2\)"):
        head.observe(tokens, torch.zeros(2, L + 1, K, dtype=torch.int64), torch.zeros(2, H))
    with pytest.raises(ValueError, match="val_fraction"):
        train_expert_head(head, torch.zeros(4, H), routing_of([0] * 4), val_fraction=1.0)
    with pytest.raises(ValueError, match="holdout must be 'random' or 'last'"):
        train_expert_head(head, torch.zeros(4, H), routing_of([0] * 4), holdout="first")
    with pytest.raises(ValueError, match=r"hidden must have shape \[T, 32\]"):
        train_expert_head(head, torch.zeros(4, 8), routing_of([0] * 4))
    with_tokens = LowRankExpertHead(H, L, E, K, rank=4, token_buckets=16)
    with pytest.raises(ValueError, match="token term.*pass token_ids"):
        with_tokens.predict_topk(None, torch.zeros(2, H))
    with pytest.raises(ValueError, match="lr must be a number >= 0"):
        LowRankExpertHead(H, L, E, K, lr=-1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_online_no_host_sync_and_cuda_graph():
    pred = OnlineExpertPredictor(L, E, K, num_buckets=64, halve_every=3, device="cuda")
    tokens = distinct_bucket_tokens(OnlineExpertPredictor(L, E, K, num_buckets=64), 8)
    routing = routing_of(tokens).cuda()
    tokens = tokens.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            pred.observe(tokens, routing, validate=False)
        pred.predict_bitmaps(tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pred.predict_topk(tokens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pred.predict_topk(tokens)
    # Counts were halved to 1.5 after the third call; two calls with new routing outvote it.
    shifted = (routing + 1) % E
    pred.observe(tokens, shifted, validate=False)
    pred.observe(tokens, shifted, validate=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.sort(-1).values, shifted.sort(-1).values)
