"""Choosing the verify set: which draft-tree candidates the target verifies in one pass.

Shape legend: B = requests in the batch, N = candidate nodes per request, L = MoE layers,
E = experts per layer, W = int64 words per layer bitmap (ceil(E / 64)), R = expert-parallel
(EP) ranks, budget = nodes verified per request (the root / bonus token is verified anyway
and is not a candidate).

Every policy grows an ancestor-closed set one node at a time from the frontier (nodes whose
parent is the root or already selected):

- "confidence": the frontier node with the highest score. On trees whose scores never rise
  from parent to child (cumulative draft probabilities, as SGLang builds them) this is the
  top-``budget`` of all scores, i.e. SGLang's ``organize_draft_results``.
- "ecospec": the frontier node with the highest S = P / (DeltaCost + eps), where DeltaCost is
  the number of the node's predicted experts not yet in the expert buffer, summed over
  layers (each layer weighted by ``layer_weights`` when given); the buffer starts with the
  root experts and takes each selected node's experts.
- "adaptive": "ecospec"'s choice, but a node is taken only while its gain per cost
  P / (DeltaCost + eps) is at least the step's tokens per cost so far,
  (step_tokens + sum P) / (step_cost + sum (DeltaCost + eps)): adding a node below that
  rate would lower the step's throughput, so the set stops short of ``budget``.

With ``candidate_cost`` a request's k-th candidate (k = 0, 1, ...) costs
``candidate_cost x candidate_decay^k`` on top of DeltaCost + eps, in every policy but
"confidence": the cost model's price of one more verified token per request, which falls as
a request's candidates fill the experts the step loads anyway (``costmodel.selection_cost``).

With ``expert_rank`` (expert parallelism) DeltaCost is the rise of the busiest rank's
expert count, per layer, plus ``total_weight`` times the rise of the other ranks' counts
(docs/selection.md).

With ``min_score`` > 0 a candidate whose score (cumulative draft probability) is below it
is never taken, in every policy: verifying it costs experts for a token that is rarely
accepted, so the set may stop short of ``budget``. Scores never rise from parent to child
in SGLang's trees, so the floor cuts whole subtrees.

Ties go to the lowest node index. When fewer than ``budget`` nodes are taken, the output
row ends with -1 padding.
"""

import torch

from sgl_ecospec.ops import native as _native
from sgl_ecospec.ops.bitmaps import num_words
from sgl_ecospec.ops.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
)
from sgl_ecospec.ops.options import (
    ADAPTIVE_EP_TOTAL_WEIGHT,
    DEFAULT_EPS,
    POLICIES,
    SelectionOptions,
)
from sgl_ecospec.ops.selection_reference import resolve_ranks, select_verify_set_reference

__all__ = [
    "ADAPTIVE_EP_TOTAL_WEIGHT",
    "DEFAULT_EPS",
    "POLICIES",
    "SelectionOptions",
    "native_arguments",
    "select_verify_set",
    "select_verify_set_reference",
]


def select_verify_set(
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
    validate: bool = True,
    impl: str = "auto",
    **option_keywords,
) -> torch.Tensor:
    """Selects up to ``budget`` candidates per request for the verify pass.

    The scalar options come either as ``options=`` (a :class:`SelectionOptions`, checked
    when it was built) or as keywords named like its fields (``policy="ecospec"``,
    ``eps=0.1``, ``share_buffer=``, ``total_weight=``, ``step_tokens=``, ``step_cost=``,
    ``candidate_cost=``, ``candidate_decay=``, ``min_score=``, ``round_sync=``; defaults and
    meanings as there), never both (TypeError).

    Args:
        scores: float, shape ``[B, N]``: cumulative draft probability of each candidate
            (>= 0, no NaN).
        parents: int32 or int64, shape ``[B, N]``: index in [0, N) of each candidate's
            parent, or -1 for a child of the root. Must form a forest (no cycles).
        node_experts: int64, shape ``[B, N, L, W]``: predicted expert bitmaps per candidate.
        budget: candidates to select per request (>= 0); "adaptive" may take fewer.
        root_experts: int64, shape ``[B, L, W]``, or None (empty): experts the verify pass
            loads anyway (each request's root token).
        layer_weights: float, shape ``[L]``, >= 0, or None (all ones).
        expert_rank: int32 or int64, shape ``[E]`` (every layer) or ``[L, E]``, or None:
            the EP rank in [0, R) that holds each (logical) expert, one replica each
            (``sgl_ecospec.placement.expert_rank_map`` builds it from SGLang's expert
            location metadata). With it DeltaCost is the expert-parallel cost, weighing the
            experts off the busiest rank by the options' ``total_weight``.
        num_ranks: R (>= 1), or None for ``expert_rank.max() + 1`` (a host sync on GPU).
            Only with ``expert_rank``.
        options: the policy and its numbers, or None for the option keywords.
        validate: check values (NaN or negative scores, parents out of range, cycles, ranks
            out of range, negative or non-finite layer weights); costs host syncs on GPU.
            Shapes and dtypes are always checked.
        impl: "auto" (compiled op when built), "native" or "reference".
        option_keywords: the options as keywords (see above). A keyword ``total_weight``
            needs ``expert_rank``; an ``options.total_weight`` is read only with it.

    Returns:
        int64, shape ``[B, budget]``: selected candidate indices, ascending, every selected
        node's parent selected or the root; rows with fewer selected nodes than ``budget``
        end with -1.
    """
    given_weight = option_keywords.get("total_weight")
    options = SelectionOptions.of(options, option_keywords)
    _check_inputs(scores, parents, node_experts, budget, root_experts, layer_weights)
    _check_placement(node_experts, expert_rank, num_ranks, given_weight)
    num_ranks, total_weight = resolve_ranks(expert_rank, num_ranks, options.total_weight)
    if validate:
        _check_values(scores, parents)
        if layer_weights is not None and not bool(
            (torch.isfinite(layer_weights) & (layer_weights >= 0)).all()
        ):
            raise ValueError("layer_weights must be finite and >= 0")
        if expert_rank is not None:
            _check_ranks(expert_rank, num_ranks)
    if _native.use_native(impl, "select_verify_set", scores.device):
        return _native.ops().select_verify_set(
            *native_arguments(
                scores,
                parents,
                node_experts,
                budget,
                root_experts,
                layer_weights,
                expert_rank,
                options,
                num_ranks,
                total_weight,
            )
        )
    return select_verify_set_reference(
        scores,
        parents,
        node_experts,
        budget,
        root_experts=root_experts,
        layer_weights=layer_weights,
        expert_rank=expert_rank,
        num_ranks=num_ranks,
        options=options,
    )


def native_arguments(
    scores: torch.Tensor,
    parents: torch.Tensor,
    node_experts: torch.Tensor,
    budget: int,
    root_experts: torch.Tensor | None,
    layer_weights: torch.Tensor | None,
    expert_rank: torch.Tensor | None,
    options: SelectionOptions,
    num_ranks: int,
    total_weight: float,
) -> list:
    """The arguments of ``torch.ops.sgl_ecospec.select_verify_set``, in its schema's order
    (csrc/ecospec_ops.h): the tensors contiguous (shapes and dtypes as
    :func:`select_verify_set`), ``options``' scalars, and the EP placement's resolved R and
    total weight (R = 1, 0.0 without ``expert_rank``)."""
    return [
        scores.contiguous(),
        parents.contiguous(),
        node_experts.contiguous(),
        budget,
        _contiguous(root_experts),
        options.policy,
        options.eps,
        options.share_buffer,
        _contiguous(layer_weights),
        _contiguous(expert_rank),
        num_ranks,
        total_weight,
        options.step_tokens,
        options.step_cost,
        options.candidate_cost,
        options.candidate_decay,
        options.min_score,
        options.round_sync,
    ]


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _check_inputs(scores, parents, node_experts, budget, root_experts, layer_weights):
    check_tensor("scores", scores, ndim=2, dtypes=FLOAT_DTYPES)
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
        check_tensor("layer_weights", layer_weights, ndim=1, dtypes=FLOAT_DTYPES)
        check_shape("layer_weights", layer_weights, (layers,), "[L]")
    check_same_device(
        scores=scores,
        parents=parents,
        node_experts=node_experts,
        root_experts=root_experts,
        layer_weights=layer_weights,
    )
    check_int("budget", budget)


def _check_placement(node_experts, expert_rank, num_ranks, total_weight) -> None:
    """Checks the EP arguments (``total_weight``: the keyword form's, or None)."""
    if expert_rank is None:
        for name, value in (("num_ranks", num_ranks), ("total_weight", total_weight)):
            if value is not None:
                raise ValueError(f"{name} needs expert_rank (the expert -> EP rank placement)")
        return
    check_tensor("expert_rank", expert_rank, dtypes=INDEX_DTYPES)
    layers, words = node_experts.shape[2:]
    if expert_rank.dim() not in (1, 2) or (
        expert_rank.dim() == 2 and expert_rank.shape[0] != layers
    ):
        raise ValueError(
            f"expert_rank must have shape [E] or [L, E] = [{layers}, E], "
            f"got {tuple(expert_rank.shape)}"
        )
    num_experts = expert_rank.shape[-1]
    if num_words(num_experts) != words:
        raise ValueError(
            f"expert_rank covers E = {num_experts} experts, so node_experts needs "
            f"W = ceil(E / 64) = {num_words(num_experts)} words per layer, got W = {words}"
        )
    check_same_device(node_experts=node_experts, expert_rank=expert_rank)
    if num_ranks is not None:
        check_int("num_ranks", num_ranks, minimum=1)


def _check_ranks(expert_rank: torch.Tensor, num_ranks: int) -> None:
    bad = (expert_rank < 0) | (expert_rank >= num_ranks)
    if bool(bad.any()):
        where = tuple(int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"expert_rank{list(where)} = {int(expert_rank[where])} is outside "
            f"[0, num_ranks={num_ranks})"
        )


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
