"""Helpers of the selection tests (test/ops/test_selection*.py): random trees, a plain
Python greedy to compare with, the invariants of a selection, bitmaps from id lists."""

import torch

from sgl_ecospec import topk_to_bitmap
from sgl_ecospec.ops.bitmaps import bitmap_to_ids
from sgl_ecospec.ops.options import SelectionOptions
from sgl_ecospec.ops.selection_reference import resolve_ranks
from sgl_ecospec.synthetic import random_draft_tree


def experts(*layers, num_experts=8):
    """Bitmaps int64 [L, W] from one list of expert ids per layer."""
    width = max(len(ids) for ids in layers)
    padded = [ids + ids[:1] * (width - len(ids)) for ids in layers]  # repeats set no new bit
    return topk_to_bitmap(torch.tensor(padded), num_experts)


def random_tree(gen, batch, num_nodes, layers, num_experts, top_k, *, tie_levels=0):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    tree = random_draft_tree(
        batch, num_nodes, layers, num_experts, top_k, seed=seed, tie_levels=tie_levels
    )
    return tree.scores, tree.parents, tree.node_experts, tree.root_experts


def python_greedy(
    scores,
    parents,
    node_experts,
    budget,
    num_experts,
    *,
    root_experts=None,
    layer_weights=None,
    expert_rank=None,
    num_ranks=None,
    options=None,
    **option_keywords,
):
    """The selection rule written with Python sets: an independent check of the reference
    (arguments as ``select_verify_set``'s, with E = ``num_experts``)."""
    options = SelectionOptions.of(options, option_keywords)
    num_ranks, total_weight = resolve_ranks(expert_rank, num_ranks, options.total_weight)
    policy, eps, share_buffer = options.policy, options.eps, options.share_buffer
    round_sync = options.round_sync
    weights, min_score = layer_weights, options.min_score
    candidate_cost, candidate_decay = options.candidate_cost, options.candidate_decay
    step_tokens, step_cost = options.step_tokens, options.step_cost or 0.0  # "adaptive" only
    batch, num_nodes = scores.shape
    layers = node_experts.shape[2]
    sets = [
        [
            [set(bitmap_to_ids(node_experts[b, i, layer], num_experts)) for layer in range(layers)]
            for i in range(num_nodes)
        ]
        for b in range(batch)
    ]
    roots = [
        [
            set(bitmap_to_ids(root_experts[b, layer], num_experts))
            if root_experts is not None
            else set()
            for layer in range(layers)
        ]
        for b in range(batch)
    ]
    buffers = roots
    if share_buffer:
        union = [set().union(*(roots[b][layer] for b in range(batch))) for layer in range(layers)]
        buffers = [union] * batch
    rank = None
    if expert_rank is not None:
        rank = [
            [int(r) for r in (expert_rank if expert_rank.dim() == 1 else expert_rank[layer])]
            for layer in range(layers)
        ]
    # The adaptive account: [tokens, cost] per request, or one shared by the batch.
    requests = batch if share_buffer else 1
    shared_account = [step_tokens * requests, step_cost * requests]
    accounts = [shared_account if share_buffer else [step_tokens, step_cost] for _ in range(batch)]
    chosen = [[] for _ in range(batch)]

    def layer_cost(fresh, buffer, layer):
        if rank is None:
            return len(fresh)
        loads = [sum(rank[layer][e] == r for e in buffer) for r in range(num_ranks)]
        adds = [sum(rank[layer][e] == r for e in fresh) for r in range(num_ranks)]
        rise = max(a + b for a, b in zip(loads, adds, strict=True)) - max(loads)
        return rise + total_weight * (len(fresh) - rise)

    def pick(b, take=True):
        """Request b's choice (None: none); taken unless ``take`` is False."""
        best, best_priority, best_cost = -1, None, 0.0
        price = candidate_cost  # of request b's next candidate: times the decay per take
        for _ in chosen[b]:
            price *= candidate_decay
        beyond = eps + price
        for i in range(num_nodes):
            p = int(parents[b, i])
            if i in chosen[b] or (p >= 0 and p not in chosen[b]):
                continue
            if float(scores[b, i]) < min_score:
                continue
            priority, cost = float(scores[b, i]), 0.0
            if policy != "confidence":
                for layer in range(layers):
                    fresh = sets[b][i][layer] - buffers[b][layer]
                    c = layer_cost(fresh, buffers[b][layer], layer)
                    cost += c if weights is None else float(weights[layer]) * c
                priority = priority / (cost + beyond)
            if best < 0 or priority > best_priority:
                best, best_priority, best_cost = i, priority, cost
        if best < 0:
            return None
        if policy == "adaptive" and best_priority < accounts[b][0] / accounts[b][1]:
            return None
        choice = (b, best, best_cost + beyond)
        if take:
            enter(choice)
        return choice

    def enter(choice):
        b, best, cost = choice
        if policy == "adaptive":
            accounts[b][0] += float(scores[b, best])
            accounts[b][1] += cost
        chosen[b].append(best)
        for layer in range(layers):
            buffers[b][layer] |= sets[b][best][layer]

    for _ in range(budget):
        if round_sync:  # every request chooses against the round's start, then all enter
            for choice in [pick(b, take=False) for b in range(batch)]:
                if choice is not None:
                    enter(choice)
        else:
            for b in range(batch):
                pick(b)
    return [sorted(c) + [-1] * (budget - len(c)) for c in chosen]


# --- the worked example of METHOD.md (EcoSpec Fig. 3, gamma = 2) -------------------------


def assert_valid_selection(out, parents, budget, *, full=True):
    batch, num_nodes = parents.shape
    assert out.shape == (batch, budget) and out.dtype == torch.int64
    for b, row in enumerate(out.tolist()):
        chosen = [i for i in row if i >= 0]
        assert row == chosen + [-1] * (budget - len(chosen)), "padding only at the end"
        assert chosen == sorted(set(chosen)), "ascending, no repeats"
        if full:
            assert len(chosen) == min(budget, num_nodes), "every reachable node can be chosen"
        for i in chosen:
            p = int(parents[b, i])
            assert p == -1 or p in chosen, "ancestor-closed"
