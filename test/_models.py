"""Tiny models shared by the tests: a random Qwen2-MoE target (the testbed's
architecture), an EAGLE-3 draft fitted to it in seconds, and a byte-level chat tokenizer."""

import json

import torch
import torch.nn.functional as F

from sgl_ecospec.models.eagle3 import (
    Eagle3Config,
    Eagle3Draft,
    build_vocab_maps,
    init_weights,
    training_pairs,
)

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K = 512, 64, 4, 16, 4
INTERMEDIATE, HEADS, KV_HEADS = 128, 4, 2
AUX = [0, 1, 2]

# Decoder sizes of the toy drafts (and toy Llama targets) of the testbed tests.
TOY_SIZES = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 40,
}


def eagle3_draft(counts, hidden, intermediate, heads, kv_heads, draft_vocab, aux, std, seed=0):
    """A fresh EAGLE-3 draft (``init_weights`` with ``std`` and ``seed``) over a vocab of
    ``len(counts)`` ids, whose draft vocab keeps the ``draft_vocab`` most counted ones."""
    config = Eagle3Config(
        hidden, intermediate, heads, kv_heads, len(counts), draft_vocab, list(aux)
    )
    draft = init_weights(Eagle3Draft(config), std=std, seed=seed)
    draft.set_vocab_maps(*build_vocab_maps(counts, draft_vocab))
    return draft


def tiny_target():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return Qwen2MoeForCausalLM(config).eval()


def train_draft(target, sequences, steps=80):
    """Fits a draft to the target on ``sequences`` (teacher forcing plus one unrolled step
    on its own hidden states, the input the second tree level sees)."""
    counts = torch.zeros(VOCAB)
    for seq in sequences:
        counts += torch.bincount(torch.tensor(seq), minlength=VOCAB)
    draft = eagle3_draft(counts, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, 256, AUX, std=0.05)
    # One right-padded batch: causal attention keeps padding out of the real rows' inputs,
    # and its labels are ignored.
    width = max(len(seq) for seq in sequences)
    ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in sequences])
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        input_ids, hidden, labels = training_pairs(ids, torch.cat([states[a + 1] for a in AUX], -1))
        embeds = target.get_input_embeddings()(input_ids)
    lengths = torch.tensor([len(seq) for seq in sequences])
    labels = torch.where(
        torch.arange(width - 2) < lengths[:, None] - 2, draft.to_draft_ids(labels), -100
    )
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for _ in range(steps):
        logits, own = draft.forward_sequence(embeds, hidden)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        logits, _ = draft.forward_sequence(embeds[:, 1:], own[:, :-1])
        loss = loss + F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


def random_prompts(count, seed):
    """``count`` prompts of 2-11 random token ids below VOCAB."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (count,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def tiny_engine(root, prompts, new_tokens):
    """An ``OfflineEngine`` on a tiny target saved under ``root`` and a draft trained on the
    target's greedy continuations (``new_tokens`` each) of ``prompts``."""
    from sgl_ecospec.lab.engine import OfflineEngine

    target = tiny_target()
    target.save_pretrained(root / "target")
    greedy = OfflineEngine(str(root / "target"), None).generate_greedy(prompts, new_tokens)
    sequences = [p + o for p, o in zip(prompts, greedy.outputs, strict=True)]
    train_draft(target, sequences).save_pretrained(root / "draft")
    return OfflineEngine(str(root / "target"), str(root / "draft"))


def tiny_chat_models(root, texts, draft_steps):
    """Saves under ``root`` a tiny random target with a byte-level chat tokenizer
    (``target/``), the chat prompts ``texts`` (``prompts.jsonl``, the benchmark's prompt file)
    and an EAGLE-3 draft trained ``draft_steps`` steps on the target's greedy continuations
    (12 tokens) of them (``draft/``). Returns the target and the draft's training sequences,
    for more drafts."""
    from sgl_ecospec.lab.datasets import load_prompts, render_chat
    from sgl_ecospec.lab.engine import OfflineEngine

    target = tiny_target()
    target.save_pretrained(root / "target")
    byte_tokenizer().save_pretrained(root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    engine = OfflineEngine(str(root / "target"), None)
    ids = [render_chat(engine.tokenizer, p.text) for p in load_prompts(str(prompts))]
    continuations = engine.generate_greedy(ids, 12).outputs
    sequences = [p + o for p, o in zip(ids, continuations, strict=True)]
    train_draft(target, sequences, draft_steps).save_pretrained(root / "draft")
    return target, sequences


def tiny_engine_fixture(name, prompts, new_tokens):
    """A module-scoped pytest fixture ``engine``: :func:`tiny_engine` built once in a
    temporary folder ``name``, run on one intra-op thread (conftest's ``one_thread``)."""
    import pytest

    @pytest.fixture(scope="module")
    def engine(tmp_path_factory, one_thread):
        return tiny_engine(tmp_path_factory.mktemp(name), prompts, new_tokens)

    return engine


def byte_tokenizer():
    """Byte-level tokenizer (259 ids, within the tiny target's vocab of 512) with a chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|user|>", "<|assistant|>", "<|end|>"]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    template = (
        "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template)
    hf.add_special_tokens({"additional_special_tokens": specials})
    return hf
