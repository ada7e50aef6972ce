"""LowRankExpertHead, train_expert_head and load_predictor.

Covers sgl_ecospec/predictors/head.py, training.py and loading.py.
"""

import pytest
import torch
from test_online_predictor import routing_of

from sgl_ecospec.predictors import (
    LowRankExpertHead,
    OnlineExpertPredictor,
    load_predictor,
    train_expert_head,
)

L, E, K = 3, 16, 2


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


@pytest.mark.slow  # trains a head, 10-25 s on 2 busy cores
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


@pytest.mark.slow  # trains a head, 10-25 s on 2 busy cores
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
