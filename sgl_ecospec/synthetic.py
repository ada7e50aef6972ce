"""Synthetic draft trees with skewed expert routing, for tests and benchmarks.

Shape legend: B = requests, N = candidates, L = MoE layers, K = experts per token,
E = experts per layer, W = ceil(E / 64).
"""

import math
from dataclasses import dataclass

import torch

from sgl_ecospec.ops.bitmaps import topk_to_bitmap


@dataclass
class DraftTree:
    """One batch of candidate trees, in the layout ``select_verify_set`` takes."""

    scores: torch.Tensor  # float32 [B, N], cumulative draft probabilities
    parents: torch.Tensor  # int64 [B, N], parent index or -1
    node_experts: torch.Tensor  # int64 [B, N, L, W]
    root_experts: torch.Tensor  # int64 [B, L, W]


def random_draft_tree(
    batch: int,
    num_nodes: int,
    layers: int,
    num_experts: int,
    top_k: int,
    *,
    seed: int = 0,
    tie_levels: int = 0,
    skew: float = 3.0,
) -> DraftTree:
    """Draws random trees whose scores never rise from parent to child.

    Each node's parent is uniform over the earlier nodes and the root. Experts are drawn
    from a popularity law ``u ** skew`` (u uniform), so some experts are shared often, as
    in real routing. ``tie_levels > 0`` rounds scores to that many levels (ties common)
    and then ignores the monotone order.
    """
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, num_nodes), -1, dtype=torch.long)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(-1, i, (batch,), generator=gen)
    if tie_levels:
        levels = torch.randint(0, tie_levels, (batch, num_nodes), generator=gen)
        scores = levels.float() / tie_levels
    else:
        scores = torch.empty(batch, num_nodes)
        step = torch.rand(batch, num_nodes, generator=gen)
        for i in range(num_nodes):
            parent = parents[:, i]
            above = torch.where(
                parent >= 0, scores.gather(1, parent.clamp(min=0)[:, None])[:, 0], 1.0
            )
            scores[:, i] = above * step[:, i]
    popularity = torch.rand(num_experts, generator=gen) ** skew + 1e-3

    def draw(*shape: int) -> torch.Tensor:
        count = math.prod(shape)
        flat = torch.multinomial(popularity, max(1, count), replacement=True, generator=gen)
        return topk_to_bitmap(flat[:count].view(shape), num_experts)

    return DraftTree(
        scores, parents, draw(batch, num_nodes, layers, top_k), draw(batch, layers, top_k)
    )
