"""Writes the MoEfied model as a Hugging Face ``Qwen2MoeForCausalLM`` checkpoint.

Layout (the Qwen1.5/Qwen2-MoE hub layout, which transformers 5.19 and SGLang 0.5.23 both
load): per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.gate.weight``,
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight`` (all zero: the shared expert
is always on with weight sigmoid(0) = 0.5, which the build folded into its down
projection). Attention is SmolLM2's, with zero q/k/v biases (Qwen2 attention has them) and
no sliding window; ``lm_head`` is a copy of the embedding because SGLang's qwen2_moe has no
tied head.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from sgl_ecospec.lab.testbed.moefy import MoeMLP

WEIGHTS_FILE = "model.safetensors"


def qwen2_moe_config(model: nn.Module, dtype: torch.dtype):
    """The ``Qwen2MoeConfig`` of a MoEfied ``LlamaForCausalLM`` (every layer an MoeMLP)."""
    from transformers import Qwen2MoeConfig

    src = model.config
    block = model.model.layers[0].mlp
    num_experts, inter, _ = block.gate_proj.shape
    return Qwen2MoeConfig(
        architectures=["Qwen2MoeForCausalLM"],
        vocab_size=src.vocab_size,
        hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size,
        num_hidden_layers=len(model.model.layers),
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads,
        hidden_act=src.hidden_act,
        max_position_embeddings=src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps,
        rope_parameters=dict(src.rope_parameters),
        tie_word_embeddings=False,
        use_sliding_window=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=block.shared_gate_proj.shape[0],
        num_experts=num_experts,
        num_experts_per_tok=block.top_k,
        norm_topk_prob=True,
        qkv_bias=True,
        bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id,
        pad_token_id=src.pad_token_id,
        dtype=dtype,
    )


def state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Qwen2-MoE tensor names -> contiguous tensors cast to ``dtype``."""
    inner = model.model
    out = {
        "model.embed_tokens.weight": inner.embed_tokens.weight,
        "model.norm.weight": inner.norm.weight,
    }
    # A copy, not the tied embedding: SGLang's qwen2_moe always loads a separate lm_head.
    out["lm_head.weight"] = model.lm_head.weight.clone()
    for idx, layer in enumerate(inner.layers):
        p = f"model.layers.{idx}."
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(attn, name)
            out[f"{p}self_attn.{name}.weight"] = proj.weight
            out[f"{p}self_attn.{name}.bias"] = torch.zeros(proj.out_features)
        out[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
        out.update(_moe_tensors(p + "mlp.", layer.mlp))
    return {name: t.detach().to(dtype).contiguous() for name, t in out.items()}


def _moe_tensors(prefix: str, block: MoeMLP) -> dict[str, torch.Tensor]:
    out = {prefix + "gate.weight": block.gate}
    for e in range(block.gate_proj.shape[0]):
        out[f"{prefix}experts.{e}.gate_proj.weight"] = block.gate_proj[e]
        out[f"{prefix}experts.{e}.up_proj.weight"] = block.up_proj[e]
        out[f"{prefix}experts.{e}.down_proj.weight"] = block.down_proj[e]
    out[prefix + "shared_expert.gate_proj.weight"] = block.shared_gate_proj
    out[prefix + "shared_expert.up_proj.weight"] = block.shared_up_proj
    out[prefix + "shared_expert.down_proj.weight"] = block.shared_down_proj
    out[prefix + "shared_expert_gate.weight"] = block.shared_expert_gate
    return out


def save_target(model: nn.Module, tokenizer, out_dir: Path, dtype: torch.dtype) -> None:
    """Writes config.json, generation_config.json, model.safetensors and the tokenizer.

    The chat template is stored inside tokenizer_config.json (transformers 5 would write a
    separate chat_template.jinja, which older loaders do not read).
    """
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    qwen2_moe_config(model, dtype).save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
    ).save_pretrained(out_dir)
    save_file(state_dict(model, dtype), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    jinja = out_dir / "chat_template.jinja"
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    jinja.unlink(missing_ok=True)
