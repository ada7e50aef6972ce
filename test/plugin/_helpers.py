"""Helpers shared by the plugin tests: SGLang draft trees, as its draft worker builds them,
spies on the selection step, and model directories holding only a config (for SGLang's
server-argument resolution)."""

import dataclasses
import json

import torch
from sglang_ecospec import selection
from sglang_ecospec.settings import EcoSpecSettings

from sgl_ecospec import step as library_step
from sgl_ecospec.predictors import OnlineExpertPredictor


def sglang_draft_tree(batch, topk, steps, seed, vocab=1000):
    """score_list, token_list, parents_list exactly as EagleDraftWorker.draft_forward builds
    them, from SGLang's own select_top_k_tokens and random draft distributions."""
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.zeros(batch, 4)
    rows = batch
    scores = None
    score_list, token_list, parents_list = [], [], []
    for i in range(steps):
        probs = torch.rand(rows, vocab, generator=gen).pow(6)
        probs = probs / probs.sum(-1, keepdim=True)
        topk_p, topk_index = probs.topk(topk, dim=-1)
        _, hidden, scores, tree_info = select_top_k_tokens(
            i, topk_p, topk_index, hidden, scores, topk
        )
        score_list.append(tree_info[0])
        token_list.append(tree_info[1])
        parents_list.append(tree_info[2])
        rows = batch * topk
        hidden = torch.zeros(rows, 4)
    return score_list, token_list, parents_list


# The rules as published (no score floor, no recall weighting): the tests of the selection's
# mechanics pin them; the served defaults have their own tests (test_settings.py).
PUBLISHED = dict(recall_weighted_cost=False, min_score=0.0)


def make_selector(policy="confidence", share_buffer=True, num_experts=16, max_batch=8, ndt=8):
    predictor = OnlineExpertPredictor(2, num_experts, 2, num_buckets=64)
    settings = EcoSpecSettings(
        policy=policy, share_buffer=share_buffer, log_interval=0, **PUBLISHED
    )
    return selection.EcoSpecSelector(
        settings, predictor, topk=3, num_draft_tokens=ndt, max_batch=max_batch, device="cpu"
    )


def cpu_runtime(settings, model_config, topk, num_draft_tokens, max_batch=4, **extra):
    """An ``EcoSpecRuntime`` on the CPU for a draft tree of branching ``topk`` and
    ``num_draft_tokens`` verified rows per request (``extra``: its other keywords)."""
    from sglang_ecospec.runtime import EcoSpecRuntime

    tree = dict(topk=topk, num_draft_tokens=num_draft_tokens, max_batch=max_batch)
    return EcoSpecRuntime(settings, model_config, **tree, device="cpu", **extra)


def assert_valid_selection(tree, got, ndt, topk=3):
    score_list, token_list, parents_list = tree
    parent_list, index, draft_tokens = got
    tokens = torch.cat(token_list, 1)
    batch, num_candidates = tokens.shape
    assert index.shape == draft_tokens.shape == (batch, ndt - 1)
    assert torch.equal(draft_tokens, tokens.gather(1, index))
    parents = selection.candidate_parents(parent_list, num_candidates, topk)
    for b in range(batch):
        chosen = index[b].tolist()
        assert chosen == sorted(set(chosen)) and 0 <= min(chosen) and max(chosen) < num_candidates
        for c in chosen:  # ancestor-closed
            assert parents[b, c] == -1 or int(parents[b, c]) in chosen


def spy_on_selection(monkeypatch):
    """Records the keyword arguments of every select_verify_set call the selector makes, the
    options' fields (policy, eps, ...) among them."""
    calls = []
    real = library_step.select_verify_set

    def spy(*args, **kwargs):
        fields = dataclasses.asdict(kwargs["options"])
        calls.append({**fields, **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(library_step, "select_verify_set", spy)
    return calls


HOST_READS = ("tolist", "item", "__bool__", "cpu", "numpy")


def spy_on_host_reads(monkeypatch) -> list[str]:
    """Records every tensor method that reads a value to the host (a sync on a GPU); returns
    the list the names are appended to."""
    reads = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def spy(tensor, *args, _name=name, _real=real, **kwargs):
            reads.append(_name)
            return _real(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


def draft_tree_through_hooks(batch, topk, steps, hidden_size, seed=0, vocab=50):
    """As ``sglang_draft_tree``, but through the plugin's select hook, with distinct draft
    states: the root's of request b is b, beam row r's after step i is 100 * (i + 1) + r.
    Returns the tree lists and the state that proposed each candidate ``[B, N]``."""
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    # SGLang's own function, not the hooked one a runtime installs in the process.
    original = getattr(select_top_k_tokens, "__wrapped__", select_top_k_tokens)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.arange(batch).float()[:, None].expand(-1, hidden_size)
    scores, lists, proposers = None, ([], [], []), []
    for i in range(steps):
        rows = hidden.shape[0]
        probs = torch.rand(rows, vocab, generator=gen).pow(6)
        topk_p, topk_index = (probs / probs.sum(-1, keepdim=True)).topk(topk, dim=-1)
        proposers.append(hidden[:, 0].view(batch, -1).repeat_interleave(topk, 1))
        _, hidden, scores, info = selection.select_hook(
            original, i, topk_p, topk_index, hidden, scores, topk
        )
        for store, item in zip(lists, info, strict=True):
            store.append(item)
        hidden = (100.0 * (i + 1) + torch.arange(batch * topk).float())[:, None]
        hidden = hidden.expand(-1, hidden_size)
    return lists, torch.cat(proposers, 1)


class StateEchoPredictor(OnlineExpertPredictor):
    """Needs draft states; predicts experts from the first state value, and records it."""

    needs_hidden = True
    hidden_size = 3

    def predict_topk(self, token_ids, hidden=None, *, validate=False):
        self.seen = hidden[:, 0].clone()
        first = hidden[:, 0].long()
        offsets = torch.arange(self.top_k)
        ids = (first[:, None] + offsets) % self.num_experts  # [T, K]
        return ids[:, None].expand(-1, self.num_layers, -1)


# Small configs of three MoE families (their real expert counts and top-k) for which SGLang
# 0.5.23 picks (steps 3, topk 1, 4 draft tokens) when no tree flag is given
# (speculative_hook._auto_choose_speculative_params).
MOE_CONFIGS = {
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 1000,
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "vocab_size": 1000,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "vocab_size": 1000,
    },
}


def write_model_configs(root):
    """``root/<name>/config.json`` for every MOE_CONFIGS name (no weights, no tokenizer:
    enough for ``ServerArgs.resolve_once`` with ``--skip-tokenizer-init``); returns root."""
    for name, config in MOE_CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root
