"""EVICT's rule, the benchmark's ``evict`` peer: confidence selection cut to the prefix of
its order that maximises expected tokens per predicted step time (``../shared/docs/PEERS.md``).

Per step and request:

1. the confidence choice at the budget (``select_verify_set(policy="confidence")``, SGLang's
   top scores) is put in the order confidence takes its nodes: the frontier node with the
   highest cumulative draft probability first, ties to the lowest index, so every prefix of
   the order is ancestor-closed (:func:`confidence_order`);
2. k in 0..budget is the prefix length maximising
   (step_tokens + the first k nodes' probabilities) / step_seconds[k] (:func:`evict_prefix`):
   the draft's own estimate of the tokens the step yields over the step's predicted
   seconds when every request verifies its root and k candidates. The seconds depend on the
   number of verified tokens only (no expert awareness); ties go to the smaller k;
3. the rest of the row becomes -1 padding, as "adaptive" pads (:func:`evict_selection`): the
   engine runs padding rows apart, never accepts them and counts neither their tokens nor
   their experts.

The output is lossless like any verify set: verification is unchanged.

Shape legend: B = requests, N = candidates per request, S = budget (candidates verified per
request), L = MoE layers, K = experts per token.
"""

import dataclasses

import torch

from sgl_ecospec.step import StepSelection, batch_index, verify_rows

EVICT = "evict"


def confidence_order(
    scores: torch.Tensor, parents: torch.Tensor, selected: torch.Tensor
) -> torch.Tensor:
    """The nodes of each request's confidence choice in the order confidence takes them.

    Greedy over the frontier of ``selected`` (nodes whose parent is the root or already
    taken), highest score first, ties to the lowest index: on the whole tree that greedy
    takes exactly these nodes in this order, so the result is confidence selection's own
    order and each of its prefixes is ancestor-closed.

    Args:
        scores: float ``[B, N]``: cumulative draft probabilities.
        parents: int32 or int64 ``[B, N]``: parent candidate of each node, -1 for the root.
        selected: int64 ``[B, S]``: an ancestor-closed set per request (ascending, -1
            padding), e.g. confidence's choice.

    Returns:
        int64 ``[B, S]``: the same nodes in taking order, -1 padding at the end.
    """
    batch, budget = selected.shape
    num_nodes = scores.shape[1]
    # Padding is scattered into an extra last column, then dropped.
    member = torch.zeros(batch, num_nodes + 1, dtype=torch.bool, device=scores.device)
    member.scatter_(1, torch.where(selected >= 0, selected, num_nodes), True)
    member = member[:, :num_nodes]
    parent = parents.long()
    taken = torch.zeros_like(member)
    order = torch.full_like(selected, -1)
    every = torch.arange(batch, device=scores.device)
    lowest = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    for position in range(budget):
        parent_taken = taken.gather(1, parent.clamp_min(0)) | (parent < 0)
        frontier = member & ~taken & parent_taken
        best = torch.where(frontier, scores, lowest).argmax(1)  # first maximum: lowest index
        found = frontier[every, best]
        order[:, position] = torch.where(found, best, -1)
        taken[every, best] |= found
    return order


def evict_prefix(
    scores: torch.Tensor,
    order: torch.Tensor,
    step_seconds: torch.Tensor,
    step_tokens: float = 1.0,
) -> torch.Tensor:
    """int64 ``[B]``: each request's best prefix length k of ``order``.

    k maximises (step_tokens + sum of the first k nodes' scores) / step_seconds[k] over the
    k whose first k entries are nodes (not padding); the first maximum (smallest k) wins.

    Args:
        scores: float ``[B, N]``: cumulative draft probabilities.
        order: int64 ``[B, S]``: nodes in taking order, -1 padding at the end
            (:func:`confidence_order`).
        step_seconds: float ``[S + 1]``, > 0: predicted seconds of a step in which every
            request verifies its root and k candidates, k = 0..S.
        step_tokens: tokens a request's step yields before any candidate (1: the bonus).
    """
    batch, budget = order.shape
    if step_seconds.shape != (budget + 1,):
        shape = tuple(step_seconds.shape)
        raise ValueError(f"step_seconds must have shape [S + 1] = [{budget + 1}], got {shape}")
    is_node = order >= 0
    gains = torch.where(is_node, scores.gather(1, order.clamp_min(0)).double(), 0.0)
    zero = gains.new_zeros(batch, 1)
    expected = step_tokens + torch.cat([zero, gains.cumsum(1)], 1)  # [B, S + 1]
    rate = expected / step_seconds.to(device=order.device, dtype=torch.float64)
    reachable = torch.cat([torch.ones_like(is_node[:, :1]), is_node], 1)
    return rate.masked_fill(~reachable, float("-inf")).argmax(1)


def evict_selection(
    scores: torch.Tensor,
    parents: torch.Tensor,
    selected: torch.Tensor,
    step_seconds: torch.Tensor,
    step_tokens: float = 1.0,
) -> torch.Tensor:
    """int64 ``[B, S]``: ``selected`` (confidence's choice) cut to EVICT's prefix,
    ascending, -1 padding at the end (the layout of ``select_verify_set``).

    Args: as :func:`confidence_order` and :func:`evict_prefix`.
    """
    num_nodes = scores.shape[1]
    order = confidence_order(scores, parents, selected)
    length = evict_prefix(scores, order, step_seconds, step_tokens)  # [B]
    position = torch.arange(order.shape[1], device=order.device)
    kept = torch.where(position < length[:, None], order, num_nodes).sort(1).values
    return kept.masked_fill(kept == num_nodes, -1)


def evict_step(chosen: StepSelection, step_seconds: tuple[float, ...]) -> StepSelection:
    """``chosen`` (a confidence step) with its verify set cut by EVICT's rule and the verify
    rows' predictions ``[B, 1 + S, L, K]`` taken anew for the cut set.

    Args:
        chosen: the step of ``select_step`` with policy "confidence".
        step_seconds: S + 1 predicted step seconds, k = 0..S candidates per request
            (``SpecConfig.evict_seconds``).
    """
    seconds = torch.tensor(step_seconds, dtype=torch.float64, device=chosen.scores.device)
    selected = evict_selection(chosen.scores, chosen.parents, chosen.selected, seconds)
    rows = verify_rows(selected)
    return dataclasses.replace(
        chosen, selected=selected, verify_predicted=chosen.predicted[batch_index(rows), rows]
    )


def reselect(chosen: StepSelection, spec, arguments: tuple) -> torch.Tensor:
    """Another selection's verify set int64 ``[B, spec.budget]`` on ``chosen``'s tree and
    predictions (a paired comparison), EVICT's cut applied when ``spec`` is evict's.

    Args:
        chosen: the step that was verified.
        spec: the compared ``SpecConfig``.
        arguments: its (``SelectionOptions``, ``select_step`` keywords).
    """
    options, extra = arguments
    other = chosen.reselect(spec.budget, options, **extra)
    if spec.policy == EVICT:
        other = evict_step(dataclasses.replace(chosen, selected=other), spec.evict_seconds).selected
    return other
