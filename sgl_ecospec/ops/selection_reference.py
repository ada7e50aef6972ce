"""Plain PyTorch reference of ``select_verify_set`` (the C++ and CUDA ops must equal it).

Graph-safe like the native ops: no host sync, no boolean-mask indexing, no data-dependent
shape (masks and ``torch.where``), so ``torch.compile(fullgraph=True)`` traces it and a
captured graph replays it on new values (test/ops/test_graph_safety.py). Only a call without
``num_ranks`` reads ``expert_rank.max()`` back (the public op always passes it).

Shape legend: as :mod:`sgl_ecospec.ops.selection`.
"""

import math

import torch

from sgl_ecospec.ops.bitmaps import WORD_BITS, bitmap_popcount_reference
from sgl_ecospec.ops.options import SelectionOptions


def resolve_ranks(
    expert_rank: torch.Tensor | None, num_ranks: int | None, total_weight: float | None
) -> tuple[int, float]:
    """(R, total weight) of an EP placement with their defaults filled in: R =
    ``expert_rank.max() + 1`` (a host sync on GPU) and 1 / R; (1, 0.0) without a placement."""
    if expert_rank is None:
        return 1, 0.0
    if num_ranks is None:
        num_ranks = max(int(expert_rank.max()) + 1 if expert_rank.numel() else 1, 1)
    return num_ranks, 1.0 / num_ranks if total_weight is None else float(total_weight)


def select_verify_set_reference(
    scores: torch.Tensor,
    parents: torch.Tensor,
    node_experts: torch.Tensor,
    budget: int,
    *,
    root_experts: torch.Tensor | None = None,
    layer_weights: torch.Tensor | None = None,
    expert_rank: torch.Tensor | None = None,
    num_ranks: int | None = None,
    options: SelectionOptions | None = None,
    **option_keywords,
) -> torch.Tensor:
    """Plain PyTorch version of :func:`select_verify_set` (same arguments, ``options=`` or
    the option keywords; no checks of the tensors; ``num_ranks`` and ``total_weight``
    default as there).

    Vectorised over requests; one loop iteration per selected node (and per request in
    turn with ``share_buffer``, unless ``round_sync``: then a round's requests pick at once
    against the buffer and account of the round's start). With ``expert_rank`` the rank
    loads are recounted from the buffer at every step rather than kept up to date, as the
    native ops do.
    """
    options = SelectionOptions.of(options, option_keywords)
    policy, eps, share_buffer = options.policy, options.eps, options.share_buffer
    turn_by_turn = share_buffer and not options.round_sync
    batch, num_nodes = scores.shape
    device = scores.device
    prob = scores.double()
    eligible = prob >= options.min_score  # [B, N]: the floor, fixed for the whole selection
    parents = parents.long()
    weights = None if layer_weights is None else layer_weights.double()
    placement = None
    if expert_rank is not None:
        layers, num_experts = node_experts.shape[2], expert_rank.shape[-1]
        num_ranks, total_weight = resolve_ranks(expert_rank, num_ranks, options.total_weight)
        placement = (expert_rank.long().expand(layers, num_experts), num_ranks, total_weight)
    buffer = (
        torch.zeros((batch, *node_experts.shape[2:]), dtype=torch.int64, device=device)
        if root_experts is None
        else root_experts.clone()
    )
    if share_buffer:
        buffer = _or_reduce(buffer)[None].expand_as(buffer).clone()
    selected = torch.zeros((batch, num_nodes), dtype=torch.bool, device=device)
    # The adaptive policy's account: expected tokens and predicted cost of the step so far,
    # per request, or one for the batch with share_buffer.
    accounts = 1 if share_buffer else batch
    requests = batch if share_buffer else 1
    if policy == "adaptive":
        tokens = torch.full(
            (accounts,), options.step_tokens * requests, dtype=torch.float64, device=device
        )
        cost = torch.full(
            (accounts,), options.step_cost * requests, dtype=torch.float64, device=device
        )
    # Each request's next candidate's scheduled cost, times candidate_decay after each take
    # (the same multiplications as the native ops'); eps + price is what it costs beyond
    # DeltaCost.
    price = torch.full((batch, 1), options.candidate_cost, dtype=torch.float64, device=device)

    def pick(rows: slice) -> None:
        # rows: every request at once, or one in turn with share_buffer (without
        # round_sync). Masks and where instead of boolean indexing: no data-dependent
        # shapes, no host sync.
        sel = selected[rows]  # view [B', N]
        parent = parents[rows]
        available = (sel.gather(1, parent.clamp(min=0)) | (parent < 0)) & ~sel & eligible[rows]
        cost_beyond = eps + price[rows]  # [B', 1]
        if policy == "confidence":
            priority = prob[rows]
        else:
            delta = _delta_cost(node_experts[rows], buffer[rows], weights, placement)
            priority = prob[rows] / (delta + cost_beyond)
        priority = priority.masked_fill(~available, -math.inf)
        best = priority.argmax(1, keepdim=True)  # [B', 1]
        take = available.any(1, keepdim=True)  # [B', 1]
        if policy == "adaptive":
            account = slice(0, 1) if share_buffer else rows
            best_priority = priority.gather(1, best)
            take &= best_priority >= (tokens[account] / cost[account])[:, None]
            gained_tokens = torch.where(take, prob[rows].gather(1, best), 0.0)[:, 0]
            gained_cost = torch.where(take, delta.gather(1, best) + cost_beyond, 0.0)[:, 0]
            if share_buffer:  # one account: a round's takes join it in request order
                tokens[account] = _ordered_sum(tokens[account], gained_tokens)
                cost[account] = _ordered_sum(cost[account], gained_cost)
            else:
                tokens[account] += gained_tokens
                cost[account] += gained_cost
        sel.scatter_(1, best, sel.gather(1, best) | take)
        price[rows] = torch.where(take, price[rows] * options.candidate_decay, price[rows])
        if policy != "confidence":
            chosen = node_experts[rows]  # [B', N, L, W]
            index = best[:, :, None, None].expand(-1, 1, *chosen.shape[2:])
            gained = chosen.gather(1, index)[:, 0] * take[:, :, None].long()  # [B', L, W]
            if share_buffer:
                buffer[:] = buffer[0] | _or_reduce(gained)
            else:
                buffer[rows] |= gained

    for _ in range(budget if num_nodes and batch else 0):
        if turn_by_turn:
            for b in range(batch):
                pick(slice(b, b + 1))
        else:
            pick(slice(None))
    return _selected_to_indices(selected, budget)


def _delta_cost(
    node_experts: torch.Tensor,
    buffer: torch.Tensor,
    weights: torch.Tensor | None,
    placement: tuple[torch.Tensor, int, float] | None,
) -> torch.Tensor:
    """DeltaCost of every candidate: float64 ``[B', N]`` from ``node_experts [B', N, L, W]``
    and ``buffer [B', L, W]``; ``placement`` = (rank int64 ``[L, E]``, R, total_weight)."""
    missing = node_experts & ~buffer[:, None]
    if placement is None:
        return _weighted_layer_sum(bitmap_popcount_reference(missing), weights)
    rank, num_ranks, total_weight = placement
    num_experts = rank.shape[-1]
    loads = rank_loads(_unpack_bits(buffer, num_experts), rank, num_ranks)  # [B', L, R]
    fresh = _unpack_bits(missing, num_experts)  # [B', N, L, E]
    fresh_loads = rank_loads(fresh, rank, num_ranks)  # [B', N, L, R]
    # Rise of the busiest rank, per layer; the new peak can only be at or above the old.
    rise = (loads[:, None] + fresh_loads).amax(-1) - loads.amax(-1)[:, None]  # [B', N, L]
    added = fresh.sum(-1)
    per_layer = rise.double() + total_weight * (added - rise).double()
    return _layer_sum(per_layer, weights)


def _unpack_bits(bitmaps: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[..., W]`` -> bool ``[..., E]``: bit e of the layer (bits >= E dropped)."""
    shifts = torch.arange(WORD_BITS, device=bitmaps.device)
    bits = (bitmaps[..., None] >> shifts) & 1  # arithmetic shift: the & 1 still reads bit k
    return bits.flatten(-2)[..., :num_experts].bool()


def rank_loads(bits: torch.Tensor, rank: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Experts set per rank: bool ``[..., L, E]`` with rank ``[E]`` or ``[L, E]`` -> int64
    ``[..., L, R]``."""
    out = torch.zeros((*bits.shape[:-1], num_ranks), dtype=torch.int64, device=bits.device)
    return out.scatter_add_(-1, rank.expand(bits.shape), bits.long())


def _weighted_layer_sum(counts: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[..., L]`` int64 -> ``[...]`` float64, summed over layers in order (as the C++ op)."""
    if weights is None:
        return counts.sum(-1).double()
    return _layer_sum(counts.double(), weights)


def _layer_sum(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[..., L]`` float64, times ``weights`` ``[L]`` when given, summed over layers in
    order (as the C++ op)."""
    if weights is not None:
        values = values * weights
    if values.shape[-1] == 0:
        return values.sum(-1)
    # cumsum adds left to right, the same order as the native loop, so the floats agree.
    return values.cumsum(-1)[..., -1]


def _ordered_sum(start: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """``start`` float64 ``[1]`` plus ``terms`` ``[B']`` added one after another in order (as
    the native ops' running account), as ``[1]``."""
    return torch.cat([start, terms]).cumsum(0)[-1:]


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
