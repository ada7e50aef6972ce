"""An EAGLE-3 draft head in the checkpoint format SGLang 0.5.23 loads for EAGLE3.

SGLang's draft class is ``LlamaForCausalLMEagle3`` (``srt/models/llama_eagle3.py``): one decoder
layer ("midlayer") that reads the target's token embedding and the target's auxiliary hidden
states. This module computes the same function in plain PyTorch, for training and for the
offline engine, and saves/loads the exact checkpoint layout SGLang reads:

- ``config.json``: a LlamaConfig with ``architectures = ["LlamaForCausalLMEagle3"]``,
  ``num_hidden_layers = 1``, ``vocab_size`` (target), ``draft_vocab_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids``.
- ``model.safetensors``: ``fc.weight``, ``midlayer.*`` (SGLang renames ``midlayer`` to
  ``layers.0`` and stacks q/k/v and gate/up itself), ``norm.weight``, ``lm_head.weight``,
  ``d2t`` (int64: target id = draft id + d2t[draft id]) and ``t2d`` (bool, read by no one in
  SGLang but kept for other loaders). No embedding: the draft uses the target's.

One draft step, for a token row (SGLang's layer, input-layer branch):

    g = fc(aux) if aux is A*H wide else aux        # target aux states, or the draft's own
    attn = self_attn(cat(input_layernorm(embed), hidden_norm(g)))   # 2H in, rotary positions
    h = attn + g
    out = mlp(post_attention_layernorm(h)) + h     # pre-norm output: the next step's hidden
    logits = lm_head(norm(out))                    # over the draft vocabulary

Aux hidden states: for ``eagle_aux_hidden_state_layer_ids = [a, b, c]`` SGLang marks target
layers a+1, b+1, c+1 and captures the residual stream entering them, i.e. the OUTPUTS of
target layers a, b, c (Hugging Face ``output_hidden_states[a + 1]``; ids must be <= L - 2),
concatenated in that order.

Alignment (as SGLang's draft extend after prefill, which shifts the input ids left by one):
the draft row at position t reads the target's aux state g_t (computed over tokens x_0..x_t)
and the embedding of token x_{t+1}, and predicts token x_{t+2}. Its rotary position is t.
:func:`training_pairs` builds these rows from a target sequence.

Shape legend: B = batch, T = new token rows, C = cached rows, H = hidden size, A = aux layers,
V = target vocabulary, D = draft vocabulary, Q = attention heads, G = key/value heads,
Dh = head dim, I = MLP intermediate size.
"""

import dataclasses
import json
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
IGNORE_INDEX = -100


@dataclasses.dataclass
class Eagle3Config:
    """Sizes of an EAGLE-3 draft head (the fields of its ``config.json``).

    ``hidden_size`` must equal the target's hidden size: the draft reads the target's token
    embeddings and projects A target hidden states of that width with ``fc``.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got "
                f"{self.draft_vocab_size}"
            )
        if not self.aux_layer_ids or min(self.aux_layer_ids) < 0:
            raise ValueError(
                f"aux_layer_ids must list target layer ids >= 0, got {self.aux_layer_ids}"
            )
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]

    @property
    def num_aux(self) -> int:
        """A, the target hidden states concatenated into the draft's ``fc`` input."""
        return len(self.aux_layer_ids)

    def to_hf_config(self, dtype: torch.dtype | None = None) -> dict:
        """The ``config.json`` dict SGLang reads (a LlamaConfig plus the EAGLE-3 fields)."""
        config = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "attention_bias": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
        }
        if dtype is not None:
            config["torch_dtype"] = str(dtype).removeprefix("torch.")
        return config

    @classmethod
    def from_hf_config(cls, config: dict) -> "Eagle3Config":
        """Reads a ``config.json`` dict written by :meth:`to_hf_config` (or by SpecForge)."""
        if config.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"only one-layer EAGLE-3 drafts are supported, got num_hidden_layers="
                f"{config['num_hidden_layers']}"
            )
        for flag in ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output"):
            if config.get(flag) or (config.get("eagle_config") or {}).get(flag):
                raise ValueError(f"EAGLE-3 config option {flag!r} is not supported")
        layer_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not layer_ids:
            raise ValueError(
                "config has no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang would "
                "fall back to its own default layers; write the ids explicitly"
            )
        rope_theta = config.get("rope_theta")
        if rope_theta is None:
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            aux_layer_ids=layer_ids,
            head_dim=config.get("head_dim"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
        )


class Eagle3Output(NamedTuple):
    """What one draft forward returns.

    logits: ``[B, T, D]`` over the draft vocabulary.
    hidden: ``[B, T, H]`` pre-norm output, the hidden input of the next draft step.
    key, value: ``[B, G, T, Dh]`` the new rows' attention keys (rotary applied) and values,
        for the caller's KV cache.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as SGLang does. Shape ``[..., H]`` -> same."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over cat(embed, hidden) (2H input) with neox-style rotary."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        heads, kv_heads, head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope_theta = config.rope_theta
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)

    def forward(self, x, positions, past, attn_mask):
        """x ``[B, T, 2H]``, positions ``[B, T]``, past (key, value) ``[B, G, C, Dh]`` or None,
        attn_mask bool ``[B, T, C + T]`` (True = attend) or None (causal). Returns the output
        ``[B, T, H]`` and the new key, value ``[B, G, T, Dh]``."""
        batch, rows, _ = x.shape
        q = self.q_proj(x).view(batch, rows, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, rows, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, rows, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self._rotary(positions, x.dtype)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        keys, values = k, v
        if past is not None:
            keys, values = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        if attn_mask is None:
            cached = keys.shape[2] - rows
            attn_mask = torch.ones(rows, cached + rows, dtype=torch.bool, device=x.device)
            attn_mask = attn_mask.tril(cached).expand(batch, rows, -1)
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q,
            keys.repeat_interleave(groups, 1),
            values.repeat_interleave(groups, 1),
            attn_mask=attn_mask[:, None],
        )
        out = out.transpose(1, 2).reshape(batch, rows, self.heads * self.head_dim)
        return self.o_proj(out), k, v

    def _rotary(self, positions, dtype):
        # cos/sin [B, 1, T, Dh] in float32, the frequencies halves repeated (neox layout).
        exponents = torch.arange(0, self.head_dim, 2, device=positions.device).float()
        inv_freq = 1.0 / (self.rope_theta ** (exponents / self.head_dim))
        freqs = positions.float()[..., None] * inv_freq
        angles = torch.cat([freqs, freqs], -1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), ``[..., H]`` -> ``[..., H]``."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single decoder layer; attribute names are the checkpoint's ``midlayer.*`` keys."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft head (parameter names = SGLang checkpoint names).

    Buffers: ``d2t`` int64 ``[D]`` (target id = draft id + d2t[draft id]) and ``t2d`` bool
    ``[V]`` (True for target tokens in the draft vocabulary). Both start as the identity on
    the first D target ids; set them with :meth:`set_vocab_maps`.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_aux * hidden, hidden, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Installs vocabulary maps from :func:`build_vocab_maps` (``[D]`` int64, ``[V]`` bool)."""
        check_vocab_maps(d2t, t2d, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape, int64) -> target-vocabulary ids (same shape)."""
        return draft_ids + self.d2t[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, or -100 (cross-entropy ignore) where the
        token is outside the draft vocabulary."""
        inverse = torch.full(
            (self.config.vocab_size,), IGNORE_INDEX, dtype=torch.int64, device=self.d2t.device
        )
        draft = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        inverse[draft + self.d2t] = draft
        return inverse[target_ids]

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        *,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> Eagle3Output:
        """One draft forward over T new rows, incremental over a KV cache.

        Args:
            embeds: ``[B, T, H]`` target embeddings of the row tokens (x_{t+1} for row t).
            hidden: ``[B, T, A*H]`` target aux states, or ``[B, T, H]`` the draft's own
                previous outputs (``fc`` is skipped when the width is already H, as in SGLang).
            positions: int, ``[B, T]`` rotary positions.
            past: cached (key, value), each ``[B, G, C, Dh]``, or None (C = 0).
            attn_mask: bool ``[B, T, C + T]`` (True = row may attend to that cached-then-new
                column), or None: every cached column plus causal over the new rows. Every
                row must attend to at least one column.

        Returns:
            :class:`Eagle3Output` (logits ``[B, T, D]``, hidden ``[B, T, H]``, new key/value).
        """
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        attn, key, value = layer.self_attn(x, positions, past, attn_mask)
        h = attn + hidden
        out = layer.mlp(layer.post_attention_layernorm(h)) + h
        return Eagle3Output(self.lm_head(self.norm(out)), out, key, value)

    def forward_sequence(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced causal forward over whole sequences, for training.

        Args:
            embeds: ``[B, T, H]``: row t holds the embedding of token x_{t+1}.
            hidden: ``[B, T, A*H]``: row t holds the target aux state g_t (see the module
                docstring; :func:`training_pairs` builds both).
            positions: int ``[B, T]``, default 0..T-1.

        Returns:
            logits ``[B, T, D]`` (row t predicts x_{t+2}) and pre-norm hidden ``[B, T, H]``.
        """
        if positions is None:
            positions = torch.arange(embeds.shape[1], device=embeds.device).expand(
                embeds.shape[0], -1
            )
        out = self(embeds, hidden, positions)
        return out.logits, out.hidden

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Writes ``config.json`` and ``model.safetensors`` (weights cast to ``dtype`` when
        given; ``d2t``/``t2d`` keep int64/bool)."""
        os.makedirs(path, exist_ok=True)
        weights = {}
        for name, tensor in self.state_dict().items():
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            weights[name] = tensor.detach().cpu().contiguous()
        save_file(weights, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
        config_dtype = dtype or self.fc.weight.dtype
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(self.config.to_hf_config(config_dtype), f, indent=2)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> "Eagle3Draft":
        """Loads a directory written by :meth:`save_pretrained` (or an SGLang-format EAGLE-3
        checkpoint with the same keys). ``dtype`` None keeps the stored float dtype."""
        config_path = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no EAGLE-3 draft config at {os.fspath(config_path)!r}")
        with open(config_path) as f:
            config = Eagle3Config.from_hf_config(json.load(f))
        weights = load_file(os.path.join(path, WEIGHTS_FILE), device=str(device))
        model = cls(config).to(device)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # A checkpoint without t2d is valid for SGLang (it ignores t2d): rebuild it from d2t.
        missing = [name for name in missing if name != "t2d"]
        if missing or unexpected:
            raise ValueError(
                f"draft checkpoint at {os.fspath(path)!r} does not match the EAGLE-3 layout: "
                f"missing {missing}, unexpected {unexpected}"
            )
        if "t2d" not in weights:
            model.t2d.zero_()
            model.t2d[model.to_target_ids(torch.arange(config.draft_vocab_size))] = True
        float_dtype = dtype or weights["fc.weight"].dtype
        return model.to(float_dtype)


def training_pairs(
    token_ids: torch.Tensor, aux_hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forcing rows from a target sequence (SGLang's draft-extend alignment).

    Args:
        token_ids: int ``[B, T]``: tokens x_0..x_{T-1} the target read.
        aux_hidden: ``[B, T, A*H]``: target aux state g_t at every position.

    Returns:
        input_ids ``[B, T-2]`` (x_{t+1}), hidden ``[B, T-2, A*H]`` (g_t) and labels
        ``[B, T-2]`` (x_{t+2}, target vocabulary) for rows t = 0..T-3 at positions t.
    """
    if token_ids.shape[1] < 3:
        raise ValueError(f"need at least 3 tokens per sequence, got {token_ids.shape[1]}")
    return token_ids[:, 1:-1], aux_hidden[:, :-2], token_ids[:, 2:]


def build_vocab_maps(
    token_counts: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft vocabulary = the ``draft_vocab_size`` most frequent target tokens.

    Args:
        token_counts: ``[V]`` counts (or any frequency) per target token; ties go to the
            lower token id.
        draft_vocab_size: D.

    Returns:
        d2t int64 ``[D]`` (target id = draft id + d2t[draft id]; draft ids follow ascending
        target ids) and t2d bool ``[V]``.
    """
    vocab = token_counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab}], got {draft_vocab_size}")
    # A stable sort on the negated counts keeps lower ids first among equal counts.
    order = torch.sort(-token_counts.double(), stable=True).indices
    chosen = order[:draft_vocab_size].sort().values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.long(), t2d


def check_vocab_maps(d2t, t2d, draft_vocab_size: int, vocab_size: int) -> None:
    """Raises ValueError unless d2t ``[D]`` maps draft ids one-to-one onto the True entries
    of t2d ``[V]``."""
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        raise ValueError(
            f"d2t must have shape ({draft_vocab_size},) and t2d ({vocab_size},), got "
            f"{tuple(d2t.shape)} and {tuple(t2d.shape)}"
        )
    target = d2t.long().cpu() + torch.arange(draft_vocab_size)
    if target.min() < 0 or target.max() >= vocab_size or target.unique().numel() != len(target):
        raise ValueError("d2t must map draft ids to distinct target ids in [0, vocab_size)")
    selected = torch.zeros(vocab_size, dtype=torch.bool)
    selected[target] = True
    if not torch.equal(selected, t2d.bool().cpu()):
        raise ValueError("t2d must be True exactly on the target ids that d2t maps to")


def init_weights(model: Eagle3Draft, std: float = 0.02, seed: int = 0) -> Eagle3Draft:
    """Random normal(0, std) linear weights and unit norms (a fresh, untrained draft)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model
