"""Timing a loaded MoE target on its device, for the cost model's calibration: its forward
under controlled routing (exactly U experts per layer), a request's prompt prefill, the EAGLE-3
draft's step and the greedy accept step, and the target's ``ModelProfile`` counted from its
parameters.

Torch only: the target is a :class:`sgl_ecospec.models.target.TargetModel` (a transformers
model loaded by the caller), the draft a :class:`sgl_ecospec.models.eagle3.Eagle3Draft`.
:mod:`sgl_ecospec.costmodel.calibration_run` puts these timers on a grid and fits the model.

Shape legend: B = requests, T = new tokens per request, C = context tokens, L = MoE
layers, K = experts per token, E = experts per layer, H = hidden size, V = vocabulary.
"""

import statistics
import time

import torch

from sgl_ecospec.costmodel.calibration import (
    COMPUTE_DTYPE_OF,
    ForwardTiming,
    device_sync,
    median_seconds,
)
from sgl_ecospec.costmodel.profiles import ModelProfile

DRAFT_TOPK = 4  # children per beam the timed draft step picks (SGLang's --speculative-eagle-topk)


class ControlledRouting:
    """Forces every MoE layer's router to send each token to chosen experts.

    A forward hook on each MoE layer's ``mlp.gate`` (a transformers TopKRouter returning
    (logits, weights, ids)) replaces the ids (and sets equal weights 1 / K) while an
    assignment is set; it runs before any other hook, so the target's routing capture records
    the forced routing, and the experts module computes exactly the forced experts.

    Args:
        target: the :class:`sgl_ecospec.models.target.TargetModel`.
        seed: picks which experts each assignment uses.
    """

    def __init__(self, target, seed: int = 0):
        self.target = target
        self.num_experts, self.top_k = target.num_experts, target.top_k
        self.generator = torch.Generator().manual_seed(seed)
        self._ids: dict[int, torch.Tensor] = {}
        layers = target.model.model.layers
        self._handles = [
            layers[i].mlp.gate.register_forward_hook(self._hook(i), prepend=True)
            for i in target.moe_layers
        ]

    def assign(self, tokens: int, unique: int) -> None:
        """Routes the next forwards' ``tokens`` rows so that each MoE layer touches exactly
        ``unique`` experts: per layer a fresh random set of ``unique`` experts, token i taking
        the K of them at slots iK .. iK + K - 1 (mod ``unique``), so that no token repeats an
        expert and, as tokens x K >= unique, every slot is used."""
        k, e = self.top_k, self.num_experts
        if not k <= unique <= min(e, tokens * k):
            raise ValueError(
                f"{tokens} tokens of top-{k} routing can touch {k}..{min(e, tokens * k)} "
                f"experts per layer, not {unique}"
            )
        slots = (torch.arange(tokens)[:, None] * k + torch.arange(k)) % unique  # [B*T, K]
        device = self.target.device
        for layer in self.target.moe_layers:
            chosen = torch.randperm(e, generator=self.generator)[:unique]
            self._ids[layer] = chosen[slots].to(device)

    def clear(self) -> None:
        """Back to the router's own choice."""
        self._ids.clear()

    def remove(self) -> None:
        """Removes the hooks."""
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            forced = self._ids.get(layer)
            if forced is None:
                return None
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(
                    "controlled routing needs a router returning (logits, weights, ids), got "
                    f"{type(output).__name__} from {type(module).__name__}"
                )
            logits, weights, ids = output
            if ids.shape != forced.shape:
                raise RuntimeError(
                    f"layer {layer}: the forward routes {tuple(ids.shape)} ids, the assignment "
                    f"was made for {tuple(forced.shape)}"
                )
            return logits, torch.full_like(weights, 1.0 / self.top_k), forced

        return hook


def unique_experts_per_layer(routing: torch.Tensor) -> float:
    """Mean over layers of the distinct experts in ``routing`` (int64 ``[B, T, L, K]``)."""
    layers = routing.shape[2]
    counts = [routing[:, :, layer].unique().numel() for layer in range(layers)]
    return sum(counts) / layers


class TargetTimer:
    """Times target forwards under controlled routing over a prefilled context.

    Args:
        target: the ``TargetModel``.
        routing: its :class:`ControlledRouting`.
        context: C, committed tokens per request before each timed forward.
        repeats: timed forwards per point (median), after one warm-up.
        seed: input tokens.
    """

    def __init__(self, target, routing: ControlledRouting, context: int, repeats: int, seed=0):
        self.target, self.routing = target, routing
        self.context, self.repeats = context, repeats
        self.generator = torch.Generator().manual_seed(seed)
        self.sync = device_sync(target.device)
        self._caches: dict[int, object] = {}

    def _tokens(self, batch: int, rows: int) -> torch.Tensor:
        vocab = self.target.config.vocab_size
        ids = torch.randint(vocab, (batch, rows), generator=self.generator)
        return ids.to(self.target.device)

    def _cache(self, batch: int):
        """The prefilled cache of ``batch`` requests (C committed tokens each)."""
        if batch not in self._caches:
            cache = self.target.new_cache(batch)
            context, device = self.context, self.target.device
            positions = torch.arange(context, device=device).expand(batch, -1)
            causal = torch.ones(context, context, dtype=torch.bool, device=device).tril()
            self.target.forward(
                self._tokens(batch, context), positions, cache, causal.expand(batch, -1, -1)
            )
            cache.commit(torch.arange(context, device=device).expand(batch, -1))
            self._caches[batch] = cache
        return self._caches[batch]

    def __call__(self, batch: int, tokens: int, unique: int) -> ForwardTiming:
        """One grid point: median seconds of the forward, and the unique experts per layer
        its routing really had."""
        cache = self._cache(batch)
        device = self.target.device
        ids = self._tokens(batch, tokens)
        positions = (self.context + torch.arange(tokens, device=device)).expand(batch, -1)
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        mask = causal.expand(batch, -1, -1)
        drop_pending = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
        times, measured = [], []
        for repeat in range(self.repeats + 1):  # the first forward warms up
            self.routing.assign(batch * tokens, unique)
            self.sync()
            start = time.perf_counter()
            out = self.target.forward(ids, positions, cache, mask)
            self.sync()
            elapsed = time.perf_counter() - start
            self.routing.clear()
            cache.commit(drop_pending)
            measured.append(unique_experts_per_layer(out.routing))
            if repeat:
                times.append(elapsed)
        return ForwardTiming(statistics.median(times), sum(measured) / len(measured))


def prefill_timer(target, repeats: int, seed: int = 0):
    """tokens -> median seconds of one request's prefill of that many random prompt tokens
    (an empty cache, causal attention, the router's own routing), after one warm-up."""
    generator = torch.Generator().manual_seed(seed)
    sync, device = device_sync(target.device), target.device

    def time_prefill(tokens: int) -> float:
        ids = torch.randint(target.config.vocab_size, (1, tokens), generator=generator)
        positions = torch.arange(tokens, device=device)[None]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()[None]

        def prefill():
            target.forward(ids.to(device), positions, target.new_cache(1), causal)

        return median_seconds(prefill, repeats, sync)

    return time_prefill


def draft_timer(draft, target, context: int, repeats: int):
    """batch -> median seconds of one draft step (one row per request over C context rows,
    then its top-k children), the EAGLE-3 draft on the target's device."""
    hidden = draft.config.hidden_size
    sync = device_sync(target.device)

    def time_step(batch: int) -> float:
        device, dtype = target.device, next(draft.parameters()).dtype
        embeds = torch.randn(batch, context + 1, hidden, device=device, dtype=dtype)
        states = torch.randn(batch, context + 1, hidden, device=device, dtype=dtype)
        positions = torch.arange(context + 1, device=device).expand(batch, -1)
        with torch.no_grad():
            prefix = draft(embeds[:, :context], states[:, :context], positions[:, :context])

            def step():
                out = draft(
                    embeds[:, context:],
                    states[:, context:],
                    positions[:, context:],
                    past=(prefix.key, prefix.value),
                )
                out.logits.float().softmax(-1).topk(DRAFT_TOPK, -1)

            return median_seconds(step, repeats, sync)

    return time_step


def reject_timer(target, tokens: int, repeats: int):
    """batch -> median seconds of the greedy accept step over B x ``tokens`` verify logits
    (argmax, comparison with the drafts, accepted prefix length)."""
    sync = device_sync(target.device)
    vocab, device = target.config.vocab_size, target.device
    dtype = target.model.dtype

    def time_step(batch: int) -> float:
        logits = torch.randn(batch, tokens, vocab, device=device, dtype=dtype)
        drafts = torch.randint(vocab, (batch, tokens), device=device)

        def step():
            predicted = logits.argmax(-1)  # [B, T]
            matches = (predicted[:, :-1] == drafts[:, 1:]).long()
            matches.cumprod(1).sum(1)

        return median_seconds(step, repeats, sync)

    return time_step


def target_profile(target, name: str, dtype: torch.dtype, source: str) -> ModelProfile:
    """The cost model's ``ModelProfile`` of a loaded transformers MoE target, counted from
    its parameters: routed experts apart, the input embedding left out (a step gathers rows
    of it) unless tied to the lm_head."""
    model, config = target.model, target.config
    experts = [model.model.layers[i].mlp.experts for i in target.moe_layers]
    routed = sum(p.numel() for module in experts for p in module.parameters())
    per_expert = sum(p.numel() for p in experts[0].parameters()) // target.num_experts
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    dense = sum(p.numel() for p in model.parameters()) - routed
    dense -= 0 if tied else embedding.numel()
    element = embedding.element_size()
    dtype_name = str(dtype).removeprefix("torch.")
    return ModelProfile(
        name=name,
        moe_layers=len(target.moe_layers),
        num_experts=target.num_experts,
        top_k=target.top_k,
        hidden=config.hidden_size,
        moe_intermediate=config.moe_intermediate_size,
        bytes_per_expert=per_expert * element,
        dense_params=dense,
        bytes_per_dense_param=element,
        compute_dtype=COMPUTE_DTYPE_OF[dtype_name],
        vocab_size=config.vocab_size,
        notes=f"counted from the parameters of {source} loaded in {dtype_name}",
    )
