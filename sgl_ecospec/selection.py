"""Choosing the verify set: which draft-tree candidates the target verifies in one pass.

Shape legend: B = requests in the batch, N = candidate nodes per request, L = MoE layers,
W = int64 words per layer bitmap (ceil(E / 64)), budget = nodes verified per request
(the root / bonus token is verified anyway and is not a candidate).

Both policies grow an ancestor-closed set one node at a time from the frontier (nodes whose
parent is the root or already selected):

- "confidence": the frontier node with the highest score. On trees whose scores never rise
  from parent to child (cumulative draft probabilities, as SGLang builds them) this is the
  top-``budget`` of all scores, i.e. SGLang's ``organize_draft_results``.
- "ecospec": the frontier node with the highest S = P / (DeltaCost + eps), where DeltaCost is
  the number of the node's predicted experts not yet in the expert buffer, summed over
  layers (each layer weighted by ``layer_weights`` when given); the buffer starts with the
  root experts and takes each selected node's experts.

Ties go to the lowest node index. When fewer than ``budget`` nodes are reachable, the
output row ends with -1 padding.
"""

import math

import torch

from sgl_ecospec import _native
from sgl_ecospec._checks import (
    INDEX_DTYPES,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
)
from sgl_ecospec.bitmaps import bitmap_popcount_reference

POLICIES = ("confidence", "ecospec")
DEFAULT_EPS = 0.1
_SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def select_verify_set(
    scores: torch.Tensor,
    parents: torch.Tensor,
    node_experts: torch.Tensor,
    budget: int,
    *,
    root_experts: torch.Tensor | None = None,
    policy: str = "ecospec",
    eps: float = DEFAULT_EPS,
    share_buffer: bool = False,
    layer_weights: torch.Tensor | None = None,
    validate: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Selects ``budget`` candidates per request for the verify pass.

    Args:
        scores: float, shape ``[B, N]``: cumulative draft probability of each candidate
            (>= 0, no NaN).
        parents: int32 or int64, shape ``[B, N]``: index in [0, N) of each candidate's
            parent, or -1 for a child of the root. Must form a forest (no cycles).
        node_experts: int64, shape ``[B, N, L, W]``: predicted expert bitmaps per candidate.
        budget: candidates to select per request (>= 0).
        root_experts: int64, shape ``[B, L, W]``, or None (empty): experts the verify pass
            loads anyway (each request's root token).
        policy: "confidence" or "ecospec".
        eps: > 0, added to DeltaCost so fully covered nodes keep a finite score.
        share_buffer: one buffer for the whole batch, seeded with every request's root
            experts; requests then pick one node each in turn (request 0 first), so every
            request gets its budget. Only "ecospec" reads the buffer.
        layer_weights: float, shape ``[L]``, >= 0, or None (all ones).
        validate: check values (NaN or negative scores, parents out of range, cycles);
            costs host syncs on GPU. Shapes and dtypes are always checked.
        impl: "auto" (compiled op when built), "native" or "reference".

    Returns:
        int64, shape ``[B, budget]``: selected candidate indices, ascending, every selected
        node's parent selected or the root; rows with fewer reachable nodes than
        ``budget`` end with -1.
    """
    _check_inputs(scores, parents, node_experts, budget, root_experts, policy, eps, layer_weights)
    if validate:
        _check_values(scores, parents)
    if _native.use_native(impl, "select_verify_set", scores.device):
        return _native.ops().select_verify_set(
            scores.contiguous(),
            parents.contiguous(),
            node_experts.contiguous(),
            budget,
            None if root_experts is None else root_experts.contiguous(),
            policy,
            float(eps),
            bool(share_buffer),
            None if layer_weights is None else layer_weights.contiguous(),
        )
    return select_verify_set_reference(
        scores,
        parents,
        node_experts,
        budget,
        root_experts=root_experts,
        policy=policy,
        eps=eps,
        share_buffer=share_buffer,
        layer_weights=layer_weights,
    )


def _check_inputs(scores, parents, node_experts, budget, root_experts, policy, eps, layer_weights):
    check_tensor("scores", scores, ndim=2, dtypes=_SCORE_DTYPES)
    batch, num_nodes = scores.shape
    check_tensor("parents", parents, ndim=2, dtypes=INDEX_DTYPES)
    check_shape("parents", parents, (batch, num_nodes), "[B, N] like scores")
    check_tensor("node_experts", node_experts, ndim=4, dtypes=(torch.int64,))
    if tuple(node_experts.shape[:2]) != (batch, num_nodes):
        raise ValueError(
            f"node_experts must have shape [B, N, L, W] = [{batch}, {num_nodes}, L, W] like "
            f"scores, got {tuple(node_experts.shape)}"
        )
    layers, words = node_experts.shape[2:]
    if root_experts is not None:
        check_tensor("root_experts", root_experts, ndim=3, dtypes=(torch.int64,))
        check_shape("root_experts", root_experts, (batch, layers, words), "[B, L, W]")
    if layer_weights is not None:
        check_tensor("layer_weights", layer_weights, ndim=1, dtypes=_SCORE_DTYPES)
        check_shape("layer_weights", layer_weights, (layers,), "[L]")
        if not bool(torch.isfinite(layer_weights).all()) or bool((layer_weights < 0).any()):
            raise ValueError("layer_weights must be finite and >= 0")
    check_same_device(
        scores=scores,
        parents=parents,
        node_experts=node_experts,
        root_experts=root_experts,
        layer_weights=layer_weights,
    )
    check_int("budget", budget)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")


def _check_values(scores: torch.Tensor, parents: torch.Tensor):
    if scores.numel() == 0:
        return
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN: draft probabilities must be numbers >= 0")
    if bool((scores < 0).any()):
        raise ValueError(
            f"scores must be probabilities >= 0, got {float(scores.min())}: pass cumulative "
            "draft probabilities, not log-probabilities"
        )
    num_nodes = scores.shape[1]
    bad = (parents < -1) | (parents >= num_nodes)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"parents[{b}, {i}] = {int(parents[b, i])} is outside [-1, {num_nodes}): a parent is "
            "a candidate index or -1 for a child of the root"
        )
    in_cycle = _nodes_in_cycles(parents.long())
    if bool(in_cycle.any()):
        b, i = (int(x) for x in in_cycle.nonzero()[0])
        raise ValueError(
            f"parents of request {b} contain a cycle through node {i}: the candidates must "
            "form a tree under the root"
        )


def _nodes_in_cycles(parents: torch.Tensor) -> torch.Tensor:
    """bool ``[B, N]``: nodes whose ancestor chain never reaches the root (-1)."""
    ancestor = parents.clone()
    # Pointer doubling: after k rounds each node points 2**k steps up its chain, so
    # ceil(log2(N)) + 1 rounds reach the root from any node of an acyclic tree.
    for _ in range(max(1, parents.shape[1]).bit_length() + 1):
        ancestor = torch.where(ancestor >= 0, ancestor.gather(1, ancestor.clamp(min=0)), ancestor)
    return ancestor >= 0


def select_verify_set_reference(
    scores: torch.Tensor,
    parents: torch.Tensor,
    node_experts: torch.Tensor,
    budget: int,
    *,
    root_experts: torch.Tensor | None = None,
    policy: str = "ecospec",
    eps: float = DEFAULT_EPS,
    share_buffer: bool = False,
    layer_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch version of :func:`select_verify_set` (same arguments, no validation).

    Vectorised over requests; one loop iteration per selected node (and per request in
    turn with ``share_buffer``).
    """
    batch, num_nodes = scores.shape
    device = scores.device
    prob = scores.double()
    parents = parents.long()
    weights = None if layer_weights is None else layer_weights.double()
    buffer = (
        torch.zeros((batch, *node_experts.shape[2:]), dtype=torch.int64, device=device)
        if root_experts is None
        else root_experts.clone()
    )
    if share_buffer:
        buffer = _or_reduce(buffer)[None].expand_as(buffer).clone()
    selected = torch.zeros((batch, num_nodes), dtype=torch.bool, device=device)

    def pick(rows: torch.Tensor) -> None:
        sel = selected[rows]
        parent_selected = sel.gather(1, parents[rows].clamp(min=0)) | (parents[rows] < 0)
        available = parent_selected & ~sel
        if policy == "confidence":
            priority = prob[rows]
        else:
            missing = node_experts[rows] & ~buffer[rows][:, None]
            delta = _weighted_layer_sum(bitmap_popcount_reference(missing), weights)
            priority = prob[rows] / (delta + eps)
        priority = priority.masked_fill(~available, -math.inf)
        best = priority.argmax(1) if num_nodes else torch.zeros_like(rows)
        found = available.any(1)
        chosen_rows, chosen = rows[found], best[found]
        selected[chosen_rows, chosen] = True
        if policy == "ecospec" and chosen.numel():
            gained = node_experts[chosen_rows, chosen]
            if share_buffer:
                buffer[:] = buffer[0] | _or_reduce(gained)
            else:
                buffer[chosen_rows] |= gained

    all_rows = torch.arange(batch, device=device)
    for _ in range(budget):
        if share_buffer:
            for b in range(batch):
                pick(all_rows[b : b + 1])
        else:
            pick(all_rows)
    return _selected_to_indices(selected, budget)


def _weighted_layer_sum(counts: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[..., L]`` int64 -> ``[...]`` float64, summed over layers in order (as the C++ op)."""
    if weights is None:
        return counts.sum(-1).double()
    if counts.shape[-1] == 0:
        return counts.sum(-1).double()
    # cumsum adds left to right, the same order as the native loop, so the floats agree.
    return (counts.double() * weights).cumsum(-1)[..., -1]


def _or_reduce(bitmaps: torch.Tensor) -> torch.Tensor:
    """Bitwise OR over the first dim: ``[R, ...]`` -> ``[...]`` (zeros when R = 0)."""
    out = torch.zeros(bitmaps.shape[1:], dtype=bitmaps.dtype, device=bitmaps.device)
    for row in bitmaps:
        out |= row
    return out


def _selected_to_indices(selected: torch.Tensor, budget: int) -> torch.Tensor:
    """bool ``[B, N]`` -> int64 ``[B, budget]``: selected indices ascending, then -1."""
    batch, num_nodes = selected.shape
    index = torch.arange(num_nodes, device=selected.device).expand(batch, num_nodes)
    # Unselected nodes sort after every selected one; stable sort keeps index order.
    key = torch.where(selected, index, index + num_nodes)
    order = key.sort(dim=1, stable=True).values
    out = torch.where(order < num_nodes, order, torch.full_like(order, -1))
    if budget <= num_nodes:
        return out[:, :budget].contiguous()
    pad = torch.full((batch, budget - num_nodes), -1, dtype=torch.int64, device=selected.device)
    return torch.cat([out, pad], 1)
