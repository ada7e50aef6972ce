"""The one selection step: predict -> bitmaps -> ``select_verify_set`` -> the verify rows'
predictions. The offline engine (``sgl_ecospec.lab.engine``) and the SGLang plugin
(``sglang_ecospec.selection``) both call :func:`select_step`; neither repeats it.

A request's tree is laid out root first: row 0 is the root (the last verified token, which
the verify pass reads anyway), rows 1..N the draft candidates. Selection indices count
candidates only (0..N-1, -1 padding); :func:`verify_rows` maps them back to tree rows.

Graph safety: no host sync (``validate=False`` on the ops), static shapes, Python numbers
for every option; the only allocations are the op outputs.

Shape legend: B = requests, N = candidates per request, S = budget (candidates verified per
request), L = MoE layers, K = experts per token, W = int64 words per layer bitmap,
H = draft hidden size.
"""

import dataclasses
from typing import Protocol

import torch

from sgl_ecospec.ops.bitmaps import topk_to_bitmap
from sgl_ecospec.ops.checks import check_int
from sgl_ecospec.ops.selection import SelectionOptions, select_verify_set
from sgl_ecospec.predictors.base import ExpertPredictor
from sgl_ecospec.predictors.live_recall import LiveRecall


class RankPlacement(Protocol):
    """What selection reads of an EP placement: ``expert_rank`` int64 ``[E]`` or ``[L, E]``
    on the selection's device and R = ``num_ranks``. :class:`Placement` is one; the plugin's
    ``ExpertPlacement``, whose buffer EPLB refreshes in place, is another."""

    expert_rank: torch.Tensor
    num_ranks: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """A fixed EP placement (``sgl_ecospec.placement.expert_rank_map`` builds the ranks)."""

    expert_rank: torch.Tensor
    num_ranks: int

    def __post_init__(self):
        check_int("num_ranks", self.num_ranks, minimum=1)


@dataclasses.dataclass
class StepSelection:
    """One step's predictions and verify set.

    Attributes:
        scores: float ``[B, N]``, parents: int64 ``[B, N]``: the tree selected from.
        predicted: int ``[B, 1 + N, L, K]``: predicted experts, root first.
        bitmaps: int64 ``[B, 1 + N, L, W]``: the same as bitmaps (zero for masked requests).
        selected: int64 ``[B, S]``: chosen candidates, ascending, -1 padding.
        verify_predicted: int ``[B, 1 + S, L, K]``: the predictions of the verify rows, root
            then the chosen candidates (padding rows repeat the root), for recall.
        context: int64 ``[B, 1 + N]`` or None: each row's parent token (:func:`tree_context`),
            given to predictors that read it (``needs_context``); None for the others.
    """

    scores: torch.Tensor
    parents: torch.Tensor
    predicted: torch.Tensor
    bitmaps: torch.Tensor
    selected: torch.Tensor
    verify_predicted: torch.Tensor
    context: torch.Tensor | None = None

    def reselect(
        self,
        budget: int,
        options: SelectionOptions,
        *,
        placement: RankPlacement | None = None,
        layer_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Another policy's verify set ``[B, budget]`` on this step's tree and predictions
        (paired comparisons: the same steps, no second decode)."""
        return _select(
            self.scores, self.parents, self.bitmaps, budget, options, placement, layer_weights
        )


def tree_context(
    tokens: torch.Tensor, parents: torch.Tensor, root_context: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's parent token: the root's is ``root_context``, a candidate's the token of its
    parent in the draft tree (the root's token for a child of the root).

    Args:
        tokens: int64 ``[B, 1 + N]``: root token, then candidate tokens.
        parents: int ``[B, N]``: each candidate's parent candidate, -1 for the root.
        root_context: int ``[B]``: the last verified token before each root, or None
            (unknown: -1).

    Returns:
        int64 ``[B, 1 + N]``; -1 where unknown.
    """
    candidate_context = tokens.gather(1, parents.long() + 1)  # row 0 is the root
    if root_context is None:
        root = torch.full_like(tokens[:, :1], -1)
    else:
        root = root_context.to(tokens)[:, None]
    return torch.cat([root, candidate_context], 1)


def predict_tree(
    predictor: ExpertPredictor,
    tokens: torch.Tensor,
    states: torch.Tensor | None = None,
    context: torch.Tensor | None = None,
) -> torch.Tensor:
    """Predicted experts ``[B, 1 + N, L, K]`` of each request's root and candidates.

    Args:
        tokens: int64 ``[B, 1 + N]``: root token, then candidate tokens.
        states: float ``[B, 1 + N, H]``: the draft states behind each row, for predictors
            that read them (``needs_hidden``); None for the others.
        context: int64 ``[B, 1 + N]``: each row's parent token (:func:`tree_context`), for
            predictors that read it (``needs_context``); None for the others.
    """
    flat_states = None if states is None else states.flatten(0, 1)
    extra = {} if context is None else {"context_tokens": context.flatten()}
    flat = predictor.predict_topk(tokens.flatten(), flat_states, validate=False, **extra)
    return flat.view(*tokens.shape, *flat.shape[1:])


def select_step(
    predictor: ExpertPredictor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    budget: int,
    options: SelectionOptions,
    *,
    states: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    placement: RankPlacement | None = None,
    layer_weights: torch.Tensor | None = None,
    root_context: torch.Tensor | None = None,
    live_recall: LiveRecall | None = None,
    host_eps: bool = False,
) -> StepSelection:
    """Predicts every row's experts and picks each request's verify set.

    Args:
        predictor: the expert predictor (``predict_topk``).
        tokens: int64 ``[B, 1 + N]``: each request's root token, then its candidates.
        scores: float ``[B, N]``: cumulative draft probabilities of the candidates.
        parents: int ``[B, N]``: each candidate's parent candidate, -1 for the root.
        budget: S, candidates to verify per request ("adaptive" may take fewer).
        options: the policy and its numbers.
        states: float ``[B, 1 + N, H]`` or None: draft states, for predictors that read them.
        valid: bool ``[B]`` or None (all): requests whose predictions count; the others get
            empty bitmaps (e.g. padded rows of a CUDA-graph replay, roots not yet known).
        placement: the EP placement, or None (every expert priced alike).
        layer_weights: float ``[L]`` or None: each MoE layer's weight in DeltaCost.
        root_context: int ``[B]`` or None (unknown): the last verified token before each
            root, for predictors that read the tree's context (``needs_context``).
        live_recall: the predictor's live recall, or None: with it DeltaCost trusts only
            what the predictor knows (the recall-weighted cost, :meth:`LiveRecall.weigh`,
            ``layer_weights`` as its base).
        host_eps: with ``live_recall``, read the unpredicted cost on the host into eps
            (exact; one sync) instead of scaling the layer weights (graph-safe).
    """
    context = None
    if getattr(predictor, "needs_context", False):
        context = tree_context(tokens, parents, root_context)
    predicted = predict_tree(predictor, tokens, states, context)
    bitmaps = topk_to_bitmap(predicted, predictor.num_experts, validate=False)
    if valid is not None:
        bitmaps = bitmaps * valid.long()[:, None, None, None]
    if live_recall is not None:
        options, layer_weights = live_recall.weigh(options, layer_weights, host_eps=host_eps)
    selected = _select(scores, parents, bitmaps, budget, options, placement, layer_weights)
    rows = verify_rows(selected)
    verify_predicted = predicted[batch_index(rows), rows]
    return StepSelection(scores, parents, predicted, bitmaps, selected, verify_predicted, context)


def verify_rows(selected: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, 1 + S]``: the tree rows of each request's root and selected candidates
    (``selected [B, S]``, -1 padding) in the root-first ``[B, 1 + N]`` layout; padding maps
    to row 0, the root."""
    return torch.cat([torch.zeros_like(selected[:, :1]), 1 + selected], 1)


def fill_unused_slots(
    selected: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor
) -> torch.Tensor:
    """A verify set for a fixed-width verify pass (SGLang verifies
    ``speculative_num_draft_tokens`` rows per request, however few "adaptive" or a
    ``min_score`` floor chose).

    Every unused slot holds a copy of a leaf of the request's chosen set (the highest-index
    chosen candidate without a chosen child). A copy has the leaf's token, ancestors and
    position, so the target routes it to the leaf's experts (no expert load added); nothing
    hangs under it; and verification, which tries siblings in index order, meets the
    original first, so the output is unchanged. A request that chose nothing verifies its
    best child of the root (one node: a verify pass has no empty slot; the utility gate is
    the way to verify none).

    Args:
        selected: int64 ``[B, S]``: chosen candidates, -1 padding (``select_verify_set``).
        scores: float ``[B, N]``: the candidates' scores (picks the root child).
        parents: int ``[B, N]``: each candidate's parent candidate, -1 for the root.

    Returns:
        int64 ``[B, S]``, ascending, no -1 (graph-safe: no host sync).
    """
    batch, num_candidates = scores.shape
    index = selected.clamp_min(0)
    used = selected >= 0
    chosen = torch.zeros(batch, num_candidates, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, index, used)
    # Column 0 collects the root and the padding; a chosen candidate's parent marks column
    # parent + 1.
    parent_slot = torch.where(used, torch.gather(parents.long(), 1, index) + 1, 0)
    has_child = torch.zeros(batch, num_candidates + 1, dtype=torch.bool, device=scores.device)
    has_child.scatter_(1, parent_slot, True)
    leaf = chosen & ~has_child[:, 1:]
    order = torch.arange(1, num_candidates + 1, device=scores.device)
    last_leaf = (leaf.long() * order).argmax(1)  # [B]
    root_child = scores.float().masked_fill(parents >= 0, -torch.inf).argmax(1)  # [B]
    copy = torch.where(leaf.any(1), last_leaf, root_child)
    filled = torch.where(used, selected, copy[:, None])
    return filled.sort(dim=1).values


def batch_index(index: torch.Tensor) -> torch.Tensor:
    """Row numbers ``[B, 1]`` to pair with a ``[B, M]`` index in advanced indexing."""
    return torch.arange(index.shape[0], device=index.device)[:, None]


def _select(scores, parents, bitmaps, budget, options, placement, layer_weights=None):
    ep = {}
    if placement is not None:
        ep = {"expert_rank": placement.expert_rank, "num_ranks": placement.num_ranks}
    return select_verify_set(
        scores,
        parents,
        bitmaps[:, 1:],
        budget,
        root_experts=bitmaps[:, 0],
        layer_weights=layer_weights,
        options=options,
        validate=False,
        **ep,
    )
