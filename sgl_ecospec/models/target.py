"""The target model: a transformers MoE causal LM run over a BatchKVCache with any mask.

The model comes loaded (``AutoModelForCausalLM.from_pretrained``, by the caller): this module
drives it through transformers' calling convention and imports torch only.

Every forward also returns what the engine records:

- routing: the expert ids each MoE layer's router picked for each row (forward hooks on the
  layers' ``mlp.gate``, a transformers ``*TopKRouter`` returning (logits, weights, ids));
- aux: the EAGLE-3 auxiliary hidden states, the outputs of the target layers listed in the
  draft's ``eagle_aux_hidden_state_layer_ids`` (forward hooks on those decoder layers; equal
  to ``output_hidden_states[id + 1]``, what SGLang captures with its +1 shift).

Shape legend: B = requests, T = new rows, P = pending cache columns, V = vocabulary,
L = MoE layers, K = experts per token, A = aux layers, H = hidden size.
"""

from typing import NamedTuple

import torch
from torch import nn

from sgl_ecospec.models.kvcache import BatchKVCache


class TargetOutput(NamedTuple):
    """logits ``[B, T, V]``; aux ``[B, T, A*H]`` (None without aux layers); routing int64
    ``[B, T, L, K]``."""

    logits: torch.Tensor
    aux: torch.Tensor | None
    routing: torch.Tensor


class TargetModel:
    """A Hugging Face MoE causal LM (Qwen2-MoE, Qwen3-MoE layout) with routing capture.

    Args:
        model: the loaded transformers model (``attn_implementation`` "sdpa" or "eager"; both
            take the additive 4D tree mask).
        device: where it runs (it is moved there).
    """

    def __init__(self, model: nn.Module, *, device: str | torch.device = "cpu"):
        self.model = model
        self.model.to(device).eval()
        self.device = torch.device(device)
        self.config = self.model.config
        layers = self.model.model.layers
        self.moe_layers = [
            i for i, layer in enumerate(layers) if hasattr(getattr(layer, "mlp", None), "gate")
        ]
        if not self.moe_layers:
            raise ValueError(
                f"{self.config.name_or_path!r} has no MoE layers (no decoder layer has mlp.gate)"
            )
        self.num_experts = self.config.num_experts
        self.top_k = self.config.num_experts_per_tok
        self._routing: dict[int, torch.Tensor] = {}
        self._aux: dict[int, torch.Tensor] = {}
        self.aux_layer_ids: list[int] = []
        for i in self.moe_layers:
            layers[i].mlp.gate.register_forward_hook(self._routing_hook(i))

    @property
    def num_layers(self) -> int:
        """Decoder layers of the target (all of them, MoE or dense)."""
        return self.config.num_hidden_layers

    def set_aux_layers(self, layer_ids: list[int]) -> None:
        """Captures the outputs of these decoder layers as EAGLE-3 aux states (in order)."""
        if self.aux_layer_ids:
            raise RuntimeError(f"aux layers are already set to {self.aux_layer_ids}")
        last = self.num_layers - 2
        if not all(0 <= i <= last for i in layer_ids):
            # SGLang captures the input of layer id + 1, which must exist.
            raise ValueError(
                f"EAGLE-3 aux layer ids must lie in [0, {last}] for a {self.num_layers}-layer "
                f"target, got {layer_ids}"
            )
        self.aux_layer_ids = list(layer_ids)
        for i in set(layer_ids):
            self.model.model.layers[i].register_forward_hook(self._aux_hook(i))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[..., H]`` of ids ``[...]`` (the draft reads them too)."""
        return self.model.get_input_embeddings()(token_ids)

    def new_cache(self, batch_size: int) -> BatchKVCache:
        return BatchKVCache(self.num_layers, batch_size, self.device)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: BatchKVCache,
        new_mask: torch.Tensor,
    ) -> TargetOutput:
        """Runs T new rows per request over the cache; their keys/values become pending.

        Args:
            input_ids: int64 ``[B, T]``.
            positions: int64 ``[B, T]`` rotary positions.
            cache: the requests' cache; committed columns ``< lengths[b]`` are visible.
            new_mask: bool ``[B, T, P + T]``: pending and new columns each row sees (every
                row must see at least itself).
        """
        visible = cache.attention_mask(new_mask)
        additive = torch.zeros(visible.shape, dtype=self.model.dtype, device=self.device)
        additive.masked_fill_(~visible, torch.finfo(self.model.dtype).min)
        # A dict of masks per attention type makes transformers use them as given.
        kinds = getattr(self.config, "layer_types", None) or ["full_attention"]
        masks = {kind: additive[:, None] for kind in set(kinds)}
        out = self.model(
            input_ids=input_ids,
            attention_mask=masks,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        batch, rows = input_ids.shape
        routing = torch.stack([self._routing.pop(i) for i in self.moe_layers], 1)
        aux = None
        if self.aux_layer_ids:
            aux = torch.cat([self._aux[i] for i in self.aux_layer_ids], -1)
            self._aux.clear()
        return TargetOutput(out.logits, aux, routing.view(batch, rows, len(self.moe_layers), -1))

    def _routing_hook(self, layer: int):
        def hook(module, inputs, output):
            self._routing[layer] = output[2].long()  # (logits, weights, ids [B*T, K])

        return hook

    def _aux_hook(self, layer: int):
        def hook(module, inputs, output):
            self._aux[layer] = output[0] if isinstance(output, tuple) else output

        return hook
