"""MoEfication: split each dense SwiGLU FFN of SmolLM2 into a Qwen2-MoE block.

Per layer, in order (layer l is calibrated on the hidden states produced by the already
MoEfied layers 0..l-1, so each router sees the inputs it will see at inference):

1. SwiGLU activations of the N dense neurons on calibration tokens.
2. Shared expert: the S neurons with the largest mean contribution (always hot).
3. Routed experts: the remaining neurons split into E equal groups by balanced k-means on
   their co-activation profiles (neurons that fire on the same tokens share an expert).
4. Router trained on the experts' activation mass (``routers.py``), logits scaled so the
   top-K weights stay near 1/K.
5. Down projections refitted by ridge least squares so that the MoE block, with its actual
   routing and weights, reproduces the dense FFN output; anchored at K x the dense down
   projection (routed) and 2 x (shared, whose gate is sigmoid(0) = 0.5).

Shape legend: T = tokens, H = hidden size, N = dense FFN neurons, E = routed experts,
I = neurons per routed expert, S = shared-expert neurons, K = experts per token.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sgl_ecospec.lab.testbed import routers


@dataclass(frozen=True)
class MoeSpec:
    """The MoE shape and calibration schedule (a slice of the recipe)."""

    num_experts: int
    top_k: int
    shared_neurons: int
    cluster_tokens: int
    cluster_iters: int
    router_steps: int
    router_batch: int
    router_lr: float
    router_spread: float
    refit_ridge: float
    holdout_fraction: float


class MoeMLP(nn.Module):
    """A Qwen2-MoE sparse block, computed densely (all experts, then masked): the reference.

    Same math as transformers' ``Qwen2MoeSparseMoeBlock``: softmax router, top-K,
    renormalised weights, routed experts, plus sigmoid(shared_expert_gate(x)) * shared(x).
    Running every expert and zeroing the unchosen ones costs the same as the dense FFN,
    which on CPU is far faster than a per-expert loop.

    Parameters (float32): ``gate`` [E, H]; ``gate_proj``, ``up_proj`` [E, I, H];
    ``down_proj`` [E, H, I]; ``shared_gate_proj``, ``shared_up_proj`` [S, H];
    ``shared_down_proj`` [H, S]; ``shared_expert_gate`` [1, H].
    """

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, shared: int):
        super().__init__()
        self.top_k = top_k
        z = torch.zeros
        self.gate = nn.Parameter(z(num_experts, hidden), requires_grad=False)
        self.gate_proj = nn.Parameter(z(num_experts, inter, hidden), requires_grad=False)
        self.up_proj = nn.Parameter(z(num_experts, inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(z(num_experts, hidden, inter), requires_grad=False)
        self.shared_gate_proj = nn.Parameter(z(shared, hidden), requires_grad=False)
        self.shared_up_proj = nn.Parameter(z(shared, hidden), requires_grad=False)
        self.shared_down_proj = nn.Parameter(z(hidden, shared), requires_grad=False)
        self.shared_expert_gate = nn.Parameter(z(1, hidden), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [T, H] -> (weights float32 [T, K], expert ids int64 [T, K])."""
        return routers.route(x @ self.gate.T, self.top_k)

    def routed_features(self, x: torch.Tensor) -> torch.Tensor:
        """Routed-expert activations times routing weight, zero for unchosen experts.

        Returns float32 ``[T, E, I]``; the routed output is
        ``einsum("tei,ehi->th", features, down_proj)``.
        """
        experts, inter, hidden = self.gate_proj.shape
        weights, ids = self.route(x)
        dense_w = torch.zeros(len(x), experts).scatter_(1, ids, weights)  # [T, E]
        g = x @ self.gate_proj.reshape(experts * inter, hidden).T  # [T, E*I]
        u = x @ self.up_proj.reshape(experts * inter, hidden).T
        act = (nn.functional.silu(g) * u).view(len(x), experts, inter)
        return act * dense_w[:, :, None]

    def shared_features(self, x: torch.Tensor) -> torch.Tensor:
        """Shared-expert activations times its sigmoid gate: float32 ``[T, S]``."""
        act = nn.functional.silu(x @ self.shared_gate_proj.T) * (x @ self.shared_up_proj.T)
        return act * torch.sigmoid(x @ self.shared_expert_gate.T)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [..., H] -> [..., H]."""
        x = hidden.reshape(-1, hidden.shape[-1])
        experts, width, inter = self.down_proj.shape
        routed = self.routed_features(x).reshape(len(x), experts * inter)
        down = self.down_proj.permute(0, 2, 1).reshape(experts * inter, width)
        out = routed @ down + self.shared_features(x) @ self.shared_down_proj.T
        return out.view(hidden.shape)


def swiglu(x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """Dense SwiGLU activations of a Llama MLP: ``x`` [T, H] -> float32 [T, N]."""
    return nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)


def balanced_kmeans(
    features: torch.Tensor, num_clusters: int, iters: int, generator: torch.Generator
) -> torch.Tensor:
    """Splits rows into equal-size clusters by cosine similarity (spherical k-means).

    Each iteration assigns rows to centroids under a capacity of rows/clusters: rows
    propose to their most similar non-full cluster, clusters keep their most similar
    proposers, repeat until all rows are placed (at most ``num_clusters`` rounds).

    Args:
        features: float32 ``[R, D]``, one row per neuron; R divisible by ``num_clusters``.

    Returns:
        int64 ``[num_clusters, R // num_clusters]``: row ids of each cluster, sorted.
    """
    rows = len(features)
    cap = rows // num_clusters
    assert cap * num_clusters == rows, (rows, num_clusters)
    feats = nn.functional.normalize(features, dim=1)
    centroids = feats[torch.randperm(rows, generator=generator)[:num_clusters]]
    for _ in range(iters):
        assign = _capacity_assign(feats @ centroids.T, cap)
        sums = torch.zeros_like(centroids).index_add_(0, assign, feats)
        centroids = nn.functional.normalize(sums, dim=1)
    order = torch.argsort(assign * rows + torch.arange(rows))  # grouped by cluster, stable
    return order.view(num_clusters, cap)


def _capacity_assign(sim: torch.Tensor, cap: int) -> torch.Tensor:
    # sim [R, C]; every cluster takes exactly cap rows.
    rows, clusters = sim.shape
    assign = torch.full((rows,), -1, dtype=torch.long)
    room = torch.full((clusters,), cap, dtype=torch.long)
    while (assign < 0).any():
        free = (assign < 0).nonzero().squeeze(1)
        s = sim[free].masked_fill(room[None, :] == 0, float("-inf"))
        best_sim, best = s.max(dim=1)
        # Rank proposers within each cluster by similarity; accept the first room[c].
        order = torch.argsort(best * 4.0 - best_sim.clamp(-1, 1), stable=True)
        best, free = best[order], free[order]
        first = torch.searchsorted(best, torch.arange(clusters))
        rank = torch.arange(len(best)) - first[best]
        keep = rank < room[best]
        assign[free[keep]] = best[keep]
        room -= torch.bincount(best[keep], minlength=clusters)
    return assign


def split_neurons(
    act: torch.Tensor, down_norm: torch.Tensor, spec: MoeSpec, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chooses shared-expert neurons and clusters the rest into routed experts.

    Args:
        act: float32 ``[T, N]`` SwiGLU activations on calibration tokens.
        down_norm: float32 ``[N]`` dense down-projection column norms.

    Returns:
        (shared int64 ``[S]``, experts int64 ``[E, I]``): dense neuron ids.
    """
    contrib = act.abs() * down_norm  # [T, N]
    hot = contrib.mean(0).argsort(descending=True)
    shared, rest = hot[: spec.shared_neurons].sort().values, hot[spec.shared_neurons :]
    sample = contrib[: spec.cluster_tokens, rest]  # [T', N - S]
    # Co-activation profile: each neuron's contribution over the sample tokens, centred so
    # that similarity measures firing together rather than being large on average.
    profile = (sample - sample.mean(0)).T
    groups = balanced_kmeans(profile, spec.num_experts, spec.cluster_iters, generator)
    return shared, rest[groups].sort(dim=1).values


def refit_down(
    block: MoeMLP, x: torch.Tensor, target: torch.Tensor, ridge: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge least squares for the down projections, routing and up/gate fixed.

    Solves min ||F W - target||^2 + lam ||W - W0||^2, where F = [routed features, shared
    features] and W0 the block's current down projections; lam = ridge * mean diag(F^T F).

    Args:
        x: float32 ``[T, H]`` block inputs; target: float32 ``[T, H]`` dense FFN outputs.

    Returns:
        (down_proj float32 ``[E, H, I]``, shared_down_proj float32 ``[H, S]``).
    """
    experts, hidden, inter = block.down_proj.shape
    routed = experts * inter
    feats = torch.cat(
        [block.routed_features(x).reshape(len(x), routed), block.shared_features(x)], dim=1
    )  # [T, E*I + S]
    w0 = torch.cat(
        [block.down_proj.permute(0, 2, 1).reshape(routed, hidden), block.shared_down_proj.T]
    )
    gram = feats.T @ feats
    lam = ridge * gram.diagonal().mean()
    sol = torch.linalg.solve(gram + lam * torch.eye(len(gram)), feats.T @ target + lam * w0)
    down = sol[:routed].reshape(experts, inter, hidden).permute(0, 2, 1).contiguous()
    return down, sol[routed:].T.contiguous()


@dataclass
class LayerStats:
    """Held-out quality of one MoEfied layer (floats in [0, 1] unless noted)."""

    router_recall: float  # |router top-K ∩ mass top-K| / K
    mass_captured: float  # chosen experts' mass / all routed mass
    oracle_mass: float  # same, for the mass top-K (the best a router could do)
    rel_error: float  # ||MoE out - dense out|| / ||dense out||
    max_load: float  # share of tokens routed to the busiest expert (uniform: K/E)


def moefy_layer(
    mlp: nn.Module, x: torch.Tensor, spec: MoeSpec, generator: torch.Generator
) -> tuple[MoeMLP, LayerStats]:
    """Builds the MoE block for one dense Llama MLP from its calibration inputs.

    Args:
        mlp: the dense ``LlamaMLP`` (gate_proj, up_proj [N, H]; down_proj [H, N]).
        x: float32 ``[T, H]``: its inputs on calibration tokens (post-attention RMSNorm);
            the last ``holdout_fraction`` of them is held out for the stats.
    """
    n_fit = int(len(x) * (1 - spec.holdout_fraction))
    x_fit, x_out = x[:n_fit], x[n_fit:]
    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    act = swiglu(x, mlp)  # [T, N]
    down_norm = wd.norm(dim=0)
    shared, experts = split_neurons(act[:n_fit], down_norm, spec, generator)
    mass = routers.expert_mass(act, down_norm, experts)  # [T, E]

    num_experts, inter = experts.shape
    block = MoeMLP(num_experts, spec.top_k, x.shape[1], inter, len(shared))
    gate = routers.train_router(
        x_fit,
        mass[:n_fit],
        steps=spec.router_steps,
        batch=spec.router_batch,
        lr=spec.router_lr,
        generator=generator,
    )
    block.gate.copy_(
        gate * routers.scale_for_spread(x_fit @ gate.T, spec.top_k, spec.router_spread)
    )
    block.gate_proj.copy_(wg[experts])
    block.up_proj.copy_(wu[experts])
    block.down_proj.copy_(spec.top_k * wd[:, experts].permute(1, 0, 2))
    block.shared_gate_proj.copy_(wg[shared])
    block.shared_up_proj.copy_(wu[shared])
    block.shared_down_proj.copy_(2.0 * wd[:, shared])

    dense_out = act @ wd.T  # [T, H]
    down, shared_down = refit_down(block, x_fit, dense_out[:n_fit], spec.refit_ridge)
    block.down_proj.copy_(down)
    block.shared_down_proj.copy_(shared_down)
    return block, _layer_stats(block, x_out, mass[n_fit:], dense_out[n_fit:])


def _layer_stats(block: MoeMLP, x: torch.Tensor, mass: torch.Tensor, dense_out: torch.Tensor):
    _, ids = block.route(x)
    oracle = mass.topk(block.top_k, dim=-1).indices
    total = mass.sum(-1)
    load = torch.bincount(ids.flatten(), minlength=mass.shape[1]).float() / len(x)
    err = (block(x) - dense_out).norm() / dense_out.norm()
    return LayerStats(
        router_recall=routers.topk_recall(ids, oracle),
        mass_captured=(mass.gather(1, ids).sum(-1) / total).mean().item(),
        oracle_mass=(mass.gather(1, oracle).sum(-1) / total).mean().item(),
        rel_error=err.item(),
        max_load=load.max().item(),
    )


def _after_attention(layer: nn.Module, hidden: torch.Tensor, rope, batch: int) -> torch.Tensor:
    # Residual stream after the layer's attention, ``hidden`` [B, L, H] in chunks of batch.
    mid = torch.empty_like(hidden)
    for b in range(0, len(hidden), batch):
        h = hidden[b : b + batch]
        attn, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(h),
            position_embeddings=tuple(r.expand(len(h), -1, -1) for r in rope),
            attention_mask=None,  # sdpa: causal, as every chunk is unpadded
        )
        mid[b : b + batch] = h + attn
    return mid


def round_weights(module: nn.Module, dtype: torch.dtype) -> None:
    """Rounds every parameter to ``dtype`` in place (kept float32), so that float32 compute
    on the module gives exactly what the exported ``dtype`` checkpoint gives."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(param.to(dtype).float())


@dataclass
class MoefyResult:
    """What :func:`moefy` measured and captured on the calibration chunks.

    stats: one :class:`LayerStats` per layer.
    aux: bfloat16 ``[B, L, A*H]``: outputs of the ``capture`` layers, concatenated.
    final: float32 ``[B, L, H]``: the last layer's output (before the final norm).
    """

    stats: list[LayerStats]
    aux: torch.Tensor
    final: torch.Tensor


@torch.no_grad()
def moefy(
    model: nn.Module,
    calib_ids: torch.Tensor,
    spec: MoeSpec,
    generator: torch.Generator,
    *,
    dtype: torch.dtype,
    capture: tuple[int, ...],
    log: Callable[[str], None] = print,
    batch: int = 8,
) -> MoefyResult:
    """Replaces every ``model.model.layers[l].mlp`` by a calibrated :class:`MoeMLP`, in place.

    Each new block is rounded to ``dtype`` (the checkpoint's) before the next layer is
    calibrated, so with a ``model`` already rounded the hidden states computed here are
    those of the exported model, and the captured layer outputs are valid draft data.

    Args:
        model: a ``LlamaForCausalLM`` (float32, eval).
        calib_ids: int64 ``[B, L]`` packed calibration token chunks (no padding).
        capture: layer ids whose outputs to return (EAGLE-3 aux layers).
        batch: chunks per attention forward.
    """
    inner = model.model
    hidden = inner.embed_tokens(calib_ids)  # [B, L, H]
    positions = torch.arange(calib_ids.shape[1])[None]
    rope = inner.rotary_emb(hidden, positions)
    stats, captured = [], {}
    for idx, layer in enumerate(inner.layers):
        start = time.perf_counter()
        mid = _after_attention(layer, hidden, rope, batch)  # [B, L, H]
        x = layer.post_attention_layernorm(mid).reshape(-1, hidden.shape[-1])  # [B*L, H]
        block, layer_stats = moefy_layer(layer.mlp, x, spec, generator)
        round_weights(block, dtype)
        layer.mlp = block
        hidden = mid + block(x).view_as(mid)
        if idx in capture:
            captured[idx] = hidden.to(torch.bfloat16)
        stats.append(layer_stats)
        log(
            f"  layer {idx:2d}: recall {layer_stats.router_recall:.3f} "
            f"mass {layer_stats.mass_captured:.3f}/{layer_stats.oracle_mass:.3f} "
            f"rel_err {layer_stats.rel_error:.3f} max_load {layer_stats.max_load:.3f} "
            f"({time.perf_counter() - start:.1f}s)"
        )
    return MoefyResult(stats, torch.cat([captured[i] for i in capture], -1), hidden)
