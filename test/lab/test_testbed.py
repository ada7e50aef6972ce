"""The testbed: MoEfication pieces, the small variant's build, and what it exports.

The small variant is built once per session into the regular cache (reused when already
built: about 4 minutes otherwise).
"""

import argparse
import dataclasses
import json

import pytest
import torch
from _models import TOY_SIZES as TOY
from torch import nn

from sgl_ecospec.lab import numerics
from sgl_ecospec.lab.testbed import (
    acceptance,
    build,
    command,
    draft_training,
    moefy,
    recipe,
    routers,
)
from sgl_ecospec.models import eagle3

# --- fast unit tests -------------------------------------------------------------------


def test_recipe_hash_changes_with_the_recipe():
    base = recipe.recipe_hash(recipe.SMALL)
    assert base == recipe.recipe_hash(dataclasses.replace(recipe.SMALL))
    assert base != recipe.recipe_hash(dataclasses.replace(recipe.SMALL, seed=1))
    moe = dataclasses.replace(recipe.SMALL.moe, top_k=4)
    assert base != recipe.recipe_hash(dataclasses.replace(recipe.SMALL, moe=moe))
    assert base != recipe.recipe_hash(recipe.FULL)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(recipe.CACHE_ENV, str(tmp_path))
    out = recipe.build_dir(recipe.SMALL)
    assert out == tmp_path / "testbed" / f"small-{recipe.recipe_hash(recipe.SMALL)}"


@pytest.mark.parametrize("rows,clusters", [(12, 3), (64, 8), (99, 9)])
def test_balanced_kmeans_gives_equal_disjoint_clusters(rows, clusters):
    gen = torch.Generator().manual_seed(0)
    groups = moefy.balanced_kmeans(torch.randn(rows, 5, generator=gen), clusters, 4, gen)
    assert groups.shape == (clusters, rows // clusters)
    assert sorted(groups.flatten().tolist()) == list(range(rows))


def test_balanced_kmeans_recovers_separated_clusters():
    gen = torch.Generator().manual_seed(0)
    centres = torch.eye(4) * 10
    points = centres.repeat_interleave(5, 0) + 0.1 * torch.randn(20, 4, generator=gen)
    groups = moefy.balanced_kmeans(points, 4, 5, gen)
    assert sorted(sorted(g.tolist()) for g in groups) == [
        list(range(i, i + 5)) for i in (0, 5, 10, 15)
    ]


def _hf_block(block: moefy.MoeMLP):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    num_experts, inter, hidden = block.gate_proj.shape
    config = Qwen2MoeConfig(
        hidden_size=hidden,
        num_experts=num_experts,
        num_experts_per_tok=block.top_k,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=block.shared_gate_proj.shape[0],
        norm_topk_prob=True,
    )
    hf = Qwen2MoeSparseMoeBlock(config)
    with torch.no_grad():
        hf.gate.weight.copy_(block.gate)
        hf.experts.gate_up_proj.copy_(torch.cat([block.gate_proj, block.up_proj], 1))
        hf.experts.down_proj.copy_(block.down_proj)
        hf.shared_expert.gate_proj.weight.copy_(block.shared_gate_proj)
        hf.shared_expert.up_proj.weight.copy_(block.shared_up_proj)
        hf.shared_expert.down_proj.weight.copy_(block.shared_down_proj)
        hf.shared_expert_gate.weight.copy_(block.shared_expert_gate)
    return hf


def random_block(gen, **sizes):
    """A MoeMLP of these sizes with every parameter drawn from N(0, 1)."""
    block = moefy.MoeMLP(**sizes)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return block


def test_moe_mlp_matches_transformers_qwen2_moe_block():
    gen = torch.Generator().manual_seed(0)
    block = random_block(gen, num_experts=8, top_k=3, hidden=16, inter=4, shared=6)
    x = torch.randn(2, 7, 16, generator=gen)
    torch.testing.assert_close(block(x), _hf_block(block)(x), rtol=1e-4, atol=1e-4)


def test_route_renormalises_the_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = routers.route(logits, 2)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))


def test_refit_down_recovers_a_realisable_target():
    # When the target is exactly what some down projections produce with the block's own
    # routing, the ridge refit (tiny ridge) finds them.
    gen = torch.Generator().manual_seed(0)
    block = random_block(gen, num_experts=4, top_k=2, hidden=8, inter=3, shared=2)
    x = torch.randn(400, 8, generator=gen)
    with torch.no_grad():
        target = block(x)
        block.down_proj.mul_(0.5)
        down, shared_down = moefy.refit_down(block, x, target, ridge=1e-8)
        block.down_proj.copy_(down)
        block.shared_down_proj.copy_(shared_down)
        torch.testing.assert_close(block(x), target, rtol=1e-3, atol=1e-3)


def test_accept_length_follows_the_best_matching_path():
    Node = acceptance.Node
    nodes = [
        Node(token=5, score=0.6, parent=-1, depth=1),
        Node(token=7, score=0.3, parent=-1, depth=1),
        Node(token=8, score=0.5, parent=0, depth=2),
        Node(token=9, score=0.2, parent=0, depth=2),  # right token, but not in the budget
        Node(token=3, score=0.4, parent=2, depth=3),
    ]
    assert acceptance.accept_length(nodes, 4, [5, 8, 3, 1]) == 4  # 3 drafts + bonus
    assert acceptance.accept_length(nodes, 4, [5, 9, 3]) == 2
    assert acceptance.accept_length(nodes, 2, [5, 8, 3]) == 3  # budget: nodes 0 and 2
    assert acceptance.accept_length(nodes, 4, [7, 8]) == 2
    assert acceptance.accept_length(nodes, 4, [6]) == 1


def test_ttt_mask_is_causal_then_diagonal():
    mask = draft_training._ttt_mask(3, 2)
    causal, eye = torch.ones(3, 3, dtype=torch.bool).tril(), torch.eye(3, dtype=torch.bool)
    assert torch.equal(mask, torch.cat([causal, eye, eye], 1))


# The toy draft's (and its toy target's) shape, as config fields.
def _toy_samples(gen, count=16, length=16, vocab=40, hidden=16, aux_layers=2, k=4):
    # The "target" always continues token x with x + 1 (mod vocab), with probability 0.7.
    samples = []
    for _ in range(count):
        start = torch.randint(vocab, (1,), generator=gen)
        tokens = (start + torch.arange(length)) % vocab
        top_ids = (tokens[:, None] + 1 + torch.arange(k)) % vocab
        top_probs = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(length, k).clone()
        aux = torch.randn(length, aux_layers * hidden, generator=gen).bfloat16()
        samples.append(draft_training.Sample(tokens, aux, top_ids, top_probs))
    return samples


@pytest.mark.slow  # about 15 s of training
def test_draft_training_learns_a_toy_target():
    gen = torch.Generator().manual_seed(0)
    samples = _toy_samples(gen)
    config = eagle3.Eagle3Config(**TOY, draft_vocab_size=40, aux_layer_ids=[0, 1])
    draft = eagle3.init_weights(eagle3.Eagle3Draft(config))
    # Seeded, so the result does not depend on which tests ran before.
    embed = nn.Embedding.from_pretrained(torch.randn(40, 16, generator=gen))
    spec = dataclasses.replace(
        recipe.SMALL.draft, epochs=30, batch_tokens=128, lr=3e-2, ttt_steps=2, soft_top_k=4
    )
    history = draft_training.train_draft(draft, embed, samples, spec, gen, log=lambda _: None)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert min(history[-1]["acc"]) > 0.7  # chance: 1/40


def test_read_text_matches_one_forward_per_chunk():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**TOY, "vocab_size": 50}, num_hidden_layers=3)
    model = LlamaForCausalLM(config).eval()
    chunks = torch.randint(50, (3, 7))
    lines = []
    samples = draft_training.read_text(
        model, chunks, aux_layer_ids=(0, 2), soft_top_k=4, batch=2, log=lines.append
    )
    assert len(samples) == 3 and len(lines) == 2 and "3/3 chunks" in lines[-1]
    for chunk, sample in zip(chunks, samples, strict=True):
        with torch.no_grad():
            out = model(input_ids=chunk[None], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[1], out.hidden_states[3]], -1)[0]
        assert torch.equal(sample.tokens, chunk) and sample.aux.dtype == torch.bfloat16
        torch.testing.assert_close(sample.aux.float(), aux, atol=2e-2, rtol=1e-2)
        assert torch.equal(sample.greedy, out.logits[0].argmax(-1))
        probs = torch.softmax(out.logits[0], -1).gather(1, sample.top_ids)
        torch.testing.assert_close(sample.top_probs, probs)
        assert (sample.top_probs[:, :-1] >= sample.top_probs[:, 1:]).all()


def test_init_draft_vocabulary_mixes_greedy_and_text_counts():
    gen = torch.Generator().manual_seed(0)
    samples = _toy_samples(gen, count=4, vocab=40)  # greedy tokens: 1 + start + 0..15
    target = argparse.Namespace(
        config=argparse.Namespace(
            **TOY,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_theta": 1e4},
            max_position_embeddings=64,
        )
    )
    greedy = torch.zeros(40)
    for s in samples:
        greedy += torch.bincount(s.greedy, minlength=40)
    rare = int(greedy.argmin())  # never or least often the target's greedy token
    text_counts = torch.zeros(40, dtype=torch.float64)
    text_counts[rare] = 1000.0  # the most frequent token of the text sample
    spec = dataclasses.replace(recipe.SMALL.draft, vocab_size=8, aux_layer_ids=(0, 1))
    draft = draft_training.init_draft(target, samples, text_counts, spec, seed=0)
    vocab = set(draft.to_target_ids(torch.arange(8)).tolist())
    assert rare in vocab
    assert int(greedy.argmax()) in vocab
    without_text = draft_training.init_draft(
        target, samples, torch.ones(40, dtype=torch.float64), spec, seed=0
    )
    assert rare not in set(without_text.to_target_ids(torch.arange(8)).tolist())


# --- the small variant, built once per session -----------------------------------------


@pytest.fixture(scope="session")
def small_build():
    return build.build(recipe.SMALL)


@pytest.fixture(scope="session")
def target(small_build):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small_build / "target", dtype=torch.float32).eval()


@pytest.mark.slow  # needs the small testbed (built once, minutes)
def test_build_writes_both_checkpoints(small_build):
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (small_build / "target" / name).is_file(), name
    for name in ("config.json", "model.safetensors"):
        assert (small_build / "draft" / name).is_file(), name
    info = build.read_info(small_build)
    assert info["hash"] == recipe.recipe_hash(recipe.SMALL)
    # Deterministic build: the same target bits as the reference build, on any machine.
    target_sha = numerics.weights_sha256(small_build / "target")
    assert target_sha == info["weights_sha256"]["target"] == recipe.TARGET_SHA256["small"]
    assert info["target_matches_reference"]
    assert info["weights_sha256"]["draft"] == numerics.weights_sha256(small_build / "draft")
    assert info["draft_source"] == {"trained": "recipe"}  # no shipped draft for this target
    assert build.build(recipe.SMALL) == small_build  # cached: returns at once


@pytest.mark.slow  # needs the small testbed (built once, minutes)
def test_target_is_qwen2_moe_matching_the_in_memory_model(small_build, target):
    from safetensors.torch import load_file

    config = target.config
    assert type(target).__name__ == "Qwen2MoeForCausalLM"
    assert config.num_experts >= 64 and config.num_experts_per_tok >= 4
    assert (
        config.num_hidden_layers >= 8 and config.norm_topk_prob and not config.tie_word_embeddings
    )
    probe = load_file(str(small_build / build.PROBE_FILE))
    with torch.no_grad():
        logits = target(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-3, atol=2e-3)


@pytest.mark.slow  # needs the small testbed (built once, minutes)
def test_tokenizer_round_trips_and_has_the_chat_template(small_build):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(small_build / "target")
    text = "Mixture-of-experts: 64 experts, top-8!\nDone."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    config = json.loads((small_build / "target" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n")


def _routing_on_held_out(target, tokenizer):
    """Per MoE layer: router top-K ids and activation-mass top-K ids, ``[T, K]`` each."""
    from sgl_ecospec.lab.testbed import assets, data

    convs = assets.sharegpt_conversations(build.EVAL_CONVS.stop)[build.EVAL_CONVS]
    ids = data.packed_chunks(tokenizer, convs, 1, 512)
    inputs = []
    hooks = [
        layer.mlp.register_forward_hook(lambda mod, args, out: inputs.append(args[0][0]))
        for layer in target.model.layers
    ]
    with torch.no_grad():
        target(input_ids=ids)
    for hook in hooks:
        hook.remove()
    result = []
    for layer, x in zip(target.model.layers, inputs, strict=True):
        mlp = layer.mlp
        experts = mlp.experts
        gate, up = torch.einsum("th,enh->ten", x, experts.gate_up_proj).chunk(2, dim=-1)
        act = nn.functional.silu(gate) * up  # [T, E, I]
        mass = (act.abs() * experts.down_proj.norm(dim=1)[None]).sum(-1)  # [T, E]
        _, router_ids = routers.route(x @ mlp.gate.weight.T, mlp.gate.top_k)
        result.append((router_ids, mass.topk(mlp.gate.top_k, -1).indices, ids[0]))
    return result


@pytest.mark.slow  # needs the small testbed (built once, minutes)
def test_router_is_trained_skewed_and_context_dependent(small_build, target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(small_build / "target")
    num_experts, top_k = target.config.num_experts, target.config.num_experts_per_tok
    chance = top_k / num_experts
    recalls, busiest = [], []
    for layer, (router_ids, oracle_ids, tokens) in enumerate(
        _routing_on_held_out(target, tokenizer)
    ):
        # Trained: the router finds the heavy experts well above chance (K/E).
        recalls.append(routers.topk_recall(router_ids, oracle_ids))
        assert recalls[-1] > 1.5 * chance, layer
        # Skewed: expert loads spread more than twice as much as a uniform router's would
        # by sampling noise alone (binomial std of a load share over T tokens).
        load = torch.bincount(router_ids.flatten(), minlength=num_experts) / len(router_ids)
        noise = (chance * (1 - chance) / len(router_ids)) ** 0.5
        assert load.std() > 2 * noise, layer
        busiest.append(load.max().item())
        # Context dependent: repeated tokens do not always take the same experts.
        routes: dict[int, set] = {}
        for token, ids in zip(tokens.tolist(), router_ids.sort(-1).values.tolist(), strict=True):
            routes.setdefault(token, set()).add(tuple(ids))
        assert any(len(r) > 1 for r in routes.values()), layer
    assert sum(recalls) / len(recalls) > 2 * chance
    assert sum(busiest) / len(busiest) > 2 * chance


@pytest.mark.slow  # needs the small testbed (built once, minutes)
def test_draft_loads_with_aux_layers_inside_the_target(small_build, target):
    from sgl_ecospec.models.eagle3 import Eagle3Draft

    draft = Eagle3Draft.from_pretrained(small_build / "draft")
    assert max(draft.config.aux_layer_ids) <= target.config.num_hidden_layers - 2
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.hidden_size == target.config.hidden_size
    info = build.read_info(small_build)
    assert info["acceptance"]["tree_topk4_steps3_budget4"] > 1.0


@pytest.mark.slow  # needs the small testbed (built once, minutes)
def test_path_prints_exactly_the_two_directories(small_build, capsys):
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["testbed", "path", "--small"])
    assert args.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"target={small_build / 'target'}", f"draft={small_build / 'draft'}"]
