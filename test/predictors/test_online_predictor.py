"""OnlineExpertPredictor (sgl_ecospec/predictors/online.py) and the predictor base class."""

import pytest
import torch

from sgl_ecospec.predictors import (
    ExpertPredictor,
    OnlineExpertPredictor,
)

L, E, K = 3, 16, 2


def ids(rows):
    return torch.tensor(rows, dtype=torch.int64)


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
