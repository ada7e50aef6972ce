"""Draft-tree growth as SGLang's EAGLE-3 worker does it, and the verify tree built from it.

Growth (SGLang 0.5.23 ``select_top_k_tokens`` + ``organize_draft_results`` semantics):

- step 0: the root's top-k draft tokens are the first k candidates, each a beam with score
  p (its draft probability); parents -1 (children of the root).
- step i >= 1: the draft runs once on the k beams; each beam's top-k children get the
  cumulative score beam_score * p. All k*k children become candidates (in beam-major order);
  the k best of them by cumulative score become the next beams.
- after num_steps steps: N = k + (num_steps - 1) * k^2 candidates; the draft runs
  num_steps - 1 times.

Candidate i's parent is the index of the beam node it extends (-1 for the root), the
convention of :func:`sgl_ecospec.select_verify_set`; parents always precede children.

Shape legend: B = requests, k = topk, N = candidates, S = selected candidates (budget),
T = S + 1 verify rows (the root first).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch


class DraftTree(NamedTuple):
    """scores float ``[B, N]`` (cumulative draft probabilities), tokens int64 ``[B, N]``
    (target vocabulary), parents int64 ``[B, N]`` (-1 = child of the root), hidden float
    ``[B, N, H]``: the draft state that proposed each candidate (the root's for step 0, the
    parent beam's after it), what :class:`sgl_ecospec.predictors.LowRankExpertHead` reads."""

    scores: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    hidden: torch.Tensor


# expand(step, beam_tokens [B, k], parent_beam [B, k]) -> (probs [B, k, k], tokens [B, k, k],
# hidden [B, k, H]): runs the draft on the beams of ``step`` (parent_beam: which beam of
# step - 1 each extends; unused at step 0, where every beam extends the root) and returns each
# beam's top-k children and the beam's draft state, which proposed them.
Expand = Callable[
    [int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


def num_candidates(topk: int, num_steps: int) -> int:
    """N = topk + (num_steps - 1) * topk^2."""
    return topk + (num_steps - 1) * topk * topk


def grow_tree(
    root_probs: torch.Tensor,
    root_tokens: torch.Tensor,
    root_hidden: torch.Tensor,
    expand: Expand,
    num_steps: int,
) -> DraftTree:
    """Grows the candidate tree of every request.

    Args:
        root_probs: float ``[B, k]``: the root's top-k draft probabilities, descending.
        root_tokens: int64 ``[B, k]``: their target token ids.
        root_hidden: float ``[B, H]``: the draft state that proposed them.
        expand: runs one draft step on the current beams (see ``Expand``).
        num_steps: draft depth (>= 1).
    """
    batch, topk = root_probs.shape
    beam_scores, beam_tokens = root_probs, root_tokens
    beam_nodes = torch.arange(topk, device=root_probs.device).expand(batch, topk)
    parent_beam = beam_nodes
    scores, tokens, parents = [root_probs], [root_tokens], [torch.full_like(root_tokens, -1)]
    hidden = [root_hidden[:, None].expand(-1, topk, -1)]
    for step in range(1, num_steps):
        probs, children, beam_hidden = expand(step - 1, beam_tokens, parent_beam)
        cumulative = (beam_scores[:, :, None] * probs).flatten(1)  # [B, k*k]
        children = children.flatten(1)
        scores.append(cumulative)
        tokens.append(children)
        parents.append(beam_nodes.repeat_interleave(topk, 1))
        hidden.append(beam_hidden.repeat_interleave(topk, 1))
        beam_scores, best = torch.topk(cumulative, topk, dim=-1)
        beam_tokens = children.gather(1, best)
        parent_beam = best // topk
        beam_nodes = num_candidates(topk, step) + best
    return DraftTree(
        torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(hidden, 1)
    )


class VerifyTree(NamedTuple):
    """The rows one request sends to the target: the root, then the selected candidates.

    tokens int64 ``[B, T]``; parent int64 ``[B, T]`` (row index, -1 for the root and for
    padding); depth int64 ``[B, T]`` (0 = root); valid bool ``[B, T]`` (False for padding
    of requests with fewer than S reachable candidates); mask bool ``[B, T, T]`` (row r sees
    row c iff c is r or an ancestor of r; padding rows see only themselves).
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor


def build_verify_tree(
    root_tokens: torch.Tensor, tree: DraftTree, selected: torch.Tensor
) -> VerifyTree:
    """Verify rows from a selection.

    Args:
        root_tokens: int64 ``[B]``: each request's root (last verified) token.
        tree: the candidates.
        selected: int64 ``[B, S]``: ascending, ancestor-closed candidate indices, -1 padded
            (what :func:`sgl_ecospec.select_verify_set` returns).
    """
    batch, budget = selected.shape
    valid = torch.cat([torch.ones_like(root_tokens[:, None], dtype=torch.bool), selected >= 0], 1)
    nodes = selected.clamp_min(0)
    tokens = torch.cat([root_tokens[:, None], tree.tokens.gather(1, nodes)], 1)
    # Verify row of each selected candidate; padding writes into an extra last column.
    num_nodes = tree.tokens.shape[1]
    row_of = torch.full((batch, num_nodes + 1), -1, dtype=torch.int64, device=selected.device)
    rows = torch.arange(1, budget + 1, device=selected.device).expand(batch, -1)
    row_of.scatter_(1, torch.where(selected >= 0, selected, num_nodes), rows)
    node_parent = tree.parents.gather(1, nodes)
    parent = torch.where(node_parent >= 0, row_of.gather(1, node_parent.clamp_min(0)), 0)
    parent = torch.cat([torch.full_like(root_tokens[:, None], -1), parent], 1)
    parent = torch.where(valid, parent, -1)
    # Parents precede children, so one pass in row order fills depth and ancestry.
    size = budget + 1
    mask = torch.eye(size, dtype=torch.bool, device=selected.device).repeat(batch, 1, 1)
    depth = torch.zeros_like(tokens)
    every = torch.arange(batch, device=selected.device)
    for r in range(1, size):
        has_parent = parent[:, r] >= 0
        p = parent[:, r].clamp_min(0)
        mask[:, r] |= mask[every, p] & has_parent[:, None]
        depth[:, r] = torch.where(has_parent, depth[every, p] + 1, 0)
    return VerifyTree(tokens, parent, depth, valid, mask)


def greedy_accept(verify: VerifyTree, predictions: torch.Tensor) -> torch.Tensor:
    """Longest root path whose tokens equal the target's greedy predictions.

    Starting at the root, repeatedly move to the child row whose token equals the target's
    argmax at the current row; stop when none does.

    Args:
        verify: the verified rows.
        predictions: int64 ``[B, T]``: the target's argmax at each row.

    Returns:
        int64 ``[B, D + 1]``: rows of the accepted path (root first), -1 padded; D is the
        deepest accepted draft. Accepted draft tokens per request = (path >= 0).sum(1) - 1;
        the tokens to emit are ``predictions`` at the path rows (accepted drafts + bonus).
    """
    batch = predictions.shape[0]
    every = torch.arange(batch, device=predictions.device)
    current = torch.zeros(batch, dtype=torch.int64, device=predictions.device)
    alive = torch.ones(batch, dtype=torch.bool, device=predictions.device)
    path = [current]
    while True:
        wanted = predictions[every, current]
        match = (verify.parent == current[:, None]) & verify.valid
        match &= verify.tokens == wanted[:, None]
        found = match.any(1) & alive
        if not bool(found.any()):
            break
        current = torch.where(found, match.int().argmax(1), current)
        path.append(torch.where(found, current, -1))
        alive = found
    return torch.stack(path, 1)


def accepted_within(whole: VerifyTree, predictions: torch.Tensor, selected: torch.Tensor):
    """Draft tokens each request would get accepted verifying only ``selected``, read from
    one pass over the whole tree: greedy acceptance never looks outside the verified set,
    and every row sees the same prefix and ancestors in either pass.

    Args:
        whole: the verify tree of every candidate (``build_verify_tree`` with all of them,
            row 1 + i = candidate i).
        predictions: int64 ``[B, 1 + N]``: the target's argmax at each row of ``whole``.
        selected: int64 ``[B, S]``: candidate indices, -1 padded.

    Returns:
        int64 ``[B]``.
    """
    kept = torch.zeros_like(whole.valid)
    kept[:, 0] = True
    columns = torch.where(selected >= 0, selected + 1, 0)
    kept.scatter_(1, columns, True)
    path = greedy_accept(whole._replace(valid=whole.valid & kept), predictions)
    return (path >= 0).sum(1) - 1
