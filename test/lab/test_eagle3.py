"""EAGLE-3 draft head: checkpoint layout SGLang loads, semantics, incremental decoding."""

import json

import pytest
import torch
from _models import eagle3_draft

from sgl_ecospec.models.eagle3 import (
    Eagle3Config,
    Eagle3Draft,
    _apply_rotary,
    build_vocab_maps,
    check_vocab_maps,
    training_pairs,
)

HIDDEN, HEADS, KV_HEADS, VOCAB, DRAFT_VOCAB = 32, 4, 2, 97, 40

CHECKPOINT_KEYS = {
    "fc.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def make_draft(seed=0, aux=(0, 1, 2)):
    counts = torch.rand(VOCAB, generator=torch.Generator().manual_seed(seed))
    return eagle3_draft(counts, HIDDEN, 48, HEADS, KV_HEADS, DRAFT_VOCAB, aux, 0.2, seed).eval()


def random_inputs(batch, rows, seed=1, width=3 * HIDDEN):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, rows, HIDDEN, generator=gen), torch.randn(
        batch, rows, width, generator=gen
    )


def test_checkpoint_keys_and_config(tmp_path):
    draft = make_draft()
    assert set(draft.state_dict()) == CHECKPOINT_KEYS
    draft.save_pretrained(tmp_path, torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == VOCAB and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    assert Eagle3Config.from_hf_config(config) == draft.config


def test_config_readable_by_transformers_llama_config():
    from transformers import LlamaConfig

    config = LlamaConfig.from_dict(make_draft().config.to_hf_config())
    assert config.draft_vocab_size == DRAFT_VOCAB and config.head_dim == HIDDEN // HEADS
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.eagle_config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip(tmp_path, dtype):
    draft = make_draft()
    draft.save_pretrained(tmp_path, dtype)
    loaded = Eagle3Draft.from_pretrained(tmp_path)
    assert loaded.fc.weight.dtype == dtype
    for name, tensor in draft.state_dict().items():
        expected = tensor.to(dtype) if tensor.is_floating_point() else tensor
        assert torch.equal(loaded.state_dict()[name], expected), name
    assert loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool


def test_load_rebuilds_t2d_when_missing(tmp_path):
    from safetensors.torch import load_file, save_file

    draft = make_draft()
    draft.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["t2d"]
    save_file(weights, tmp_path / "model.safetensors")
    assert torch.equal(Eagle3Draft.from_pretrained(tmp_path).t2d, draft.t2d)


def sglang_eagle3_parameters(config: Eagle3Config):
    """Parameter names and shapes of SGLang's LlamaForCausalLMEagle3 built from ``config``
    (read off llama_eagle3.py / llama.py: fused qkv and gate_up, layers.0, no fc_norm)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    return {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.fc.weight": (hidden, config.num_aux * hidden),
        "model.layers.0.self_attn.qkv_proj.weight": (qkv_rows, 2 * hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, config.num_attention_heads * head_dim),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * config.intermediate_size, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, config.intermediate_size),
        "model.layers.0.input_layernorm.weight": (hidden,),
        "model.layers.0.post_attention_layernorm.weight": (hidden,),
        "model.layers.0.hidden_norm.weight": (hidden,),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.draft_vocab_size, hidden),
    }


def test_sglang_load_weights_maps_every_checkpoint_tensor(tmp_path):
    """Runs SGLang's own LlamaForCausalLMEagle3.load_weights on a stand-in module whose
    parameters record what the loader hands them (building the real model needs a GPU)."""
    from safetensors.torch import load_file
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    draft = make_draft()
    draft.save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    loads = []

    class StandIn:
        hot_token_id = None

        def __init__(self, shapes):
            self.params = {}
            for name, shape in shapes.items():
                param = torch.nn.Parameter(torch.empty(shape), requires_grad=False)
                param.weight_loader = lambda p, w, shard=None, name=name: loads.append(
                    (name, shard, w)
                )
                self.params[name] = param

        def named_parameters(self):
            return self.params.items()

    shapes = sglang_eagle3_parameters(draft.config)
    model = StandIn(shapes)
    LlamaForCausalLMEagle3.load_weights(model, iter(checkpoint.items()))

    loaded = {(name, shard): w for name, shard, w in loads}
    config, attn = draft.config, "model.layers.0.self_attn.qkv_proj.weight"
    mlp = "model.layers.0.mlp.gate_up_proj.weight"
    expected = {
        (attn, "q"): checkpoint["midlayer.self_attn.q_proj.weight"],
        (attn, "k"): checkpoint["midlayer.self_attn.k_proj.weight"],
        (attn, "v"): checkpoint["midlayer.self_attn.v_proj.weight"],
        (mlp, 0): checkpoint["midlayer.mlp.gate_proj.weight"],
        (mlp, 1): checkpoint["midlayer.mlp.up_proj.weight"],
    }
    for name in shapes:
        if name in (attn, mlp, "model.embed_tokens.weight"):
            continue
        key = name.removeprefix("model.").replace("layers.0", "midlayer")
        expected[(name, None)] = checkpoint[key]
    assert loaded.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
        name = key[0]
        if key[1] is None:
            assert tuple(tensor.shape) == shapes[name], name
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    assert shapes[attn][0] == q_rows + 2 * kv_rows
    assert loaded[(attn, "q")].shape == (q_rows, 2 * HIDDEN)
    assert loaded[(attn, "k")].shape == (kv_rows, 2 * HIDDEN)
    # SGLang maps draft ids to target ids with d2t + arange(D).
    assert torch.equal(model.hot_token_id, draft.to_target_ids(torch.arange(DRAFT_VOCAB)))


def test_rms_norm_matches_sglang():
    from sglang.srt.layers.layernorm import RMSNorm as SglangRMSNorm

    draft = make_draft()
    norm = draft.midlayer.hidden_norm
    with torch.no_grad():
        norm.weight.copy_(torch.rand(HIDDEN) + 0.5)
    theirs = SglangRMSNorm(HIDDEN, eps=norm.eps)
    theirs.weight.data.copy_(norm.weight.data)
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(norm(x), theirs.forward_native(x), rtol=0, atol=1e-6)


def test_rotary_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    draft = make_draft()
    attn = draft.midlayer.self_attn
    hf = LlamaRotaryEmbedding(LlamaConfig.from_dict(draft.config.to_hf_config()))
    positions = torch.tensor([[0, 3, 7, 100]])
    q = torch.randn(1, HEADS, 4, attn.head_dim)
    k = torch.randn(1, KV_HEADS, 4, attn.head_dim)
    cos, sin = hf(q, positions)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours_cos, ours_sin = attn._rotary(positions, q.dtype)
    torch.testing.assert_close(_apply_rotary(q, ours_cos, ours_sin), expected_q)
    torch.testing.assert_close(_apply_rotary(k, ours_cos, ours_sin), expected_k)


def _rot(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def reference_step(draft, embeds, hidden, positions):
    """The module docstring's formulas written out with plain ops, causal attention."""
    layer, cfg = draft.midlayer, draft.config
    g = draft.fc(hidden)
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(g)], -1)
    attn = layer.self_attn
    batch, rows, _ = x.shape
    q = attn.q_proj(x).view(batch, rows, HEADS, cfg.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, rows, KV_HEADS, cfg.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(batch, rows, KV_HEADS, cfg.head_dim).transpose(1, 2)
    cos, sin = attn._rotary(positions, x.dtype)
    q, k = q * cos + _rot(q) * sin, k * cos + _rot(k) * sin
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = q @ k.transpose(-1, -2) / cfg.head_dim**0.5
    scores = scores.masked_fill(~torch.ones(rows, rows, dtype=torch.bool).tril(), -torch.inf)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, rows, -1)
    h = attn.o_proj(out) + g
    out = layer.mlp(layer.post_attention_layernorm(h)) + h
    return draft.lm_head(draft.norm(out)), out


@torch.no_grad()
def test_forward_sequence_matches_reference_formulas():
    draft = make_draft()
    embeds, hidden = random_inputs(2, 6)
    positions = torch.arange(6).expand(2, -1) + 3
    logits, out = draft.forward_sequence(embeds, hidden, positions)
    ref_logits, ref_out = reference_step(draft, embeds, hidden, positions)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(out, ref_out)


@torch.no_grad()
def test_incremental_decode_equals_sequence_forward():
    draft = make_draft()
    embeds, hidden = random_inputs(3, 7)
    positions = torch.arange(7).expand(3, -1)
    full_logits, full_hidden = draft.forward_sequence(embeds, hidden, positions)
    # Prefill 3 rows, then one row at a time, then the last 2 together.
    past, logits, outs = None, [], []
    for start, stop in [(0, 3), (3, 4), (4, 5), (5, 7)]:
        step = draft(
            embeds[:, start:stop], hidden[:, start:stop], positions[:, start:stop], past=past
        )
        key, value = step.key, step.value
        if past is not None:
            key, value = torch.cat([past[0], key], 2), torch.cat([past[1], value], 2)
        past = (key, value)
        logits.append(step.logits), outs.append(step.hidden)
    torch.testing.assert_close(torch.cat(logits, 1), full_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(outs, 1), full_hidden, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_tree_mask_equals_the_path_sequence():
    """Rows for siblings in one forward, each masked to prefix + its own ancestors, give the
    same result as running each root-to-node path as a plain sequence."""
    draft = make_draft()
    embeds, hidden = random_inputs(1, 7)
    prefix = 3
    # Tree rows 3..6: 3 and 4 are children of the prefix, 5 is a child of 3, 6 a child of 4.
    parents = {3: None, 4: None, 5: 3, 6: 4}
    depth = {3: 0, 4: 0, 5: 1, 6: 1}
    positions = torch.tensor([[0, 1, 2, 3, 3, 4, 4]])
    pre = draft(embeds[:, :prefix], hidden[:, :prefix], positions[:, :prefix])
    mask = torch.zeros(1, 4, prefix + 4, dtype=torch.bool)
    mask[..., :prefix] = True
    for row, node in enumerate(range(3, 7)):
        while node is not None:
            mask[0, row, prefix + node - 3] = True
            node = parents[node]
    tree = draft(
        embeds[:, 3:],
        hidden[:, 3:],
        positions[:, 3:],
        past=(pre.key, pre.value),
        attn_mask=mask,
    )
    for node in range(3, 7):
        path = [node] if parents[node] is None else [parents[node], node]
        rows = list(range(prefix)) + path
        logits, _ = draft.forward_sequence(
            embeds[:, rows], hidden[:, rows], torch.arange(prefix + depth[node] + 1)[None]
        )
        torch.testing.assert_close(tree.logits[:, node - 3], logits[:, -1], rtol=1e-5, atol=1e-5)


def test_fc_is_skipped_for_draft_hidden_states():
    draft = make_draft()
    embeds, own = random_inputs(1, 2, width=HIDDEN)
    out = draft(embeds, own, torch.arange(2)[None])
    assert out.logits.shape == (1, 2, DRAFT_VOCAB) and out.hidden.shape == (1, 2, HIDDEN)
    assert out.key.shape == (1, KV_HEADS, 2, HIDDEN // HEADS)


def test_training_pairs_alignment():
    tokens = torch.arange(10, 16)[None]  # x_0..x_5
    aux = torch.arange(6).float()[None, :, None].expand(1, 6, 3 * HIDDEN)  # g_t = t
    input_ids, hidden, labels = training_pairs(tokens, aux)
    assert input_ids.tolist() == [[11, 12, 13, 14]]  # x_{t+1}
    assert hidden[0, :, 0].tolist() == [0, 1, 2, 3]  # g_t
    assert labels.tolist() == [[12, 13, 14, 15]]  # x_{t+2}


def test_build_vocab_maps_picks_most_frequent_with_low_id_ties():
    counts = torch.tensor([5, 1, 9, 5, 0, 7, 5])
    d2t, t2d = build_vocab_maps(counts, 4)
    chosen = (torch.arange(4) + d2t).tolist()
    assert chosen == [0, 2, 3, 5]  # 9, 7 and the two lowest ids with count 5
    assert t2d.tolist() == [True, False, True, True, False, True, False]
    check_vocab_maps(d2t, t2d, 4, 7)


def test_vocab_map_round_trip_and_ignore_index():
    draft = make_draft()
    draft_ids = torch.arange(DRAFT_VOCAB)
    target_ids = draft.to_target_ids(draft_ids)
    assert draft.t2d[target_ids].all() and int(draft.t2d.sum()) == DRAFT_VOCAB
    assert torch.equal(draft.to_draft_ids(target_ids), draft_ids)
    outside = torch.nonzero(~draft.t2d).flatten()
    assert (draft.to_draft_ids(outside) == -100).all()


@pytest.mark.parametrize(
    "d2t, t2d, message",
    [
        (torch.zeros(3, dtype=torch.long), torch.zeros(5, dtype=torch.bool), "t2d must be True"),
        (torch.tensor([0, 0, 9]), torch.ones(5, dtype=torch.bool), "distinct target ids"),
        (torch.zeros(2, dtype=torch.long), torch.zeros(5, dtype=torch.bool), "must have shape"),
    ],
)
def test_bad_vocab_maps(d2t, t2d, message):
    with pytest.raises(ValueError, match=message):
        check_vocab_maps(d2t, t2d, 3, 5)


def test_config_validation():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config(32, 48, 4, 2, vocab_size=10, draft_vocab_size=11, aux_layer_ids=[0])
    with pytest.raises(ValueError, match="multiple"):
        Eagle3Config(32, 48, 4, 3, vocab_size=10, draft_vocab_size=10, aux_layer_ids=[0])
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_hf_config({**make_draft().config.to_hf_config(), "eagle_config": {}})
