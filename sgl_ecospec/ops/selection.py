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

import dataclasses

import torch

from sgl_ecospec.ops import native as _native
from sgl_ecospec.ops.bitmaps import num_words
from sgl_ecospec.ops.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_finite,
    check_int,
    check_positive,
    check_same_device,
    check_shape,
    check_tensor,
)
from sgl_ecospec.ops.selection_reference import DEFAULT_EPS, select_verify_set_reference

POLICIES = ("confidence", "ecospec", "adaptive")
# The total_weight "adaptive" selects with under EP unless told otherwise (the SGLang plugin's
# default, and the sweep's): its stopping rule weighs a candidate against the step's time,
# and an EP step waits for its busiest rank only, so experts added on the other ranks cost
# it nothing. The op's own default (1 / R) hedges for a wrongly predicted busiest rank, but
# with "adaptive" the sweep predicts it too cautious at batch 1-2 (docs/RESULTS.md, sweep
# runs 6 and 7).
ADAPTIVE_EP_TOTAL_WEIGHT = 0.0


@dataclasses.dataclass(frozen=True)
class SelectionOptions:
    """The checked scalar options of :func:`select_verify_set` (the one place they are
    validated: the op builds one, and so do the engine's ``SpecConfig`` and the plugin's
    settings). Field meanings as in :func:`select_verify_set`; ``step_cost`` None means
    unused (required by "adaptive")."""

    policy: str = "ecospec"
    eps: float = DEFAULT_EPS
    share_buffer: bool = False
    total_weight: float | None = None
    step_tokens: float = 1.0
    step_cost: float | None = None
    candidate_cost: float = 0.0
    candidate_decay: float = 1.0
    min_score: float = 0.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        object.__setattr__(self, "eps", check_positive("eps", self.eps))
        if not isinstance(self.share_buffer, bool):
            raise TypeError(f"share_buffer must be a bool, got {self.share_buffer!r}")
        if self.total_weight is not None:
            weight = check_finite("total_weight", self.total_weight)
            if not 0 <= weight <= 1:
                raise ValueError(f"total_weight must lie in [0, 1], got {weight}")
        if check_finite("step_tokens", self.step_tokens) < 0:
            raise ValueError(f"step_tokens must be >= 0, got {self.step_tokens}")
        if check_finite("candidate_cost", self.candidate_cost) < 0:
            raise ValueError(f"candidate_cost must be >= 0, got {self.candidate_cost}")
        if not 0 <= check_finite("candidate_decay", self.candidate_decay) <= 1:
            raise ValueError(f"candidate_decay must lie in [0, 1], got {self.candidate_decay}")
        if check_finite("min_score", self.min_score) < 0:
            raise ValueError(f"min_score must be >= 0, got {self.min_score}")
        if self.step_cost is not None:
            check_positive("step_cost", self.step_cost)
        elif self.policy == "adaptive":
            raise ValueError(
                "policy 'adaptive' needs step_cost: a request's share of the step's cost "
                "before any candidate, in expert loads (sgl_ecospec.costmodel.selection_cost "
                "gives it)"
            )

    def op_keywords(self) -> dict:
        """The keywords of :func:`select_verify_set` these options set (``total_weight``
        goes with an EP placement only)."""
        return {
            "policy": self.policy,
            "eps": self.eps,
            "share_buffer": self.share_buffer,
            "step_tokens": self.step_tokens,
            "step_cost": self.step_cost,
            "candidate_cost": self.candidate_cost,
            "candidate_decay": self.candidate_decay,
            "min_score": self.min_score,
        }

    @property
    def stops_short(self) -> bool:
        """A request's set may hold fewer than ``budget`` candidates ("adaptive", or a
        ``min_score`` floor)."""
        return self.policy == "adaptive" or self.min_score > 0

    def with_eps(self, eps: float) -> "SelectionOptions":
        """These options with another eps (e.g. the cost model's for this batch size)."""
        return self if eps == self.eps else dataclasses.replace(self, eps=eps)


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
    expert_rank: torch.Tensor | None = None,
    num_ranks: int | None = None,
    total_weight: float | None = None,
    step_tokens: float = 1.0,
    step_cost: float | None = None,
    candidate_cost: float = 0.0,
    candidate_decay: float = 1.0,
    min_score: float = 0.0,
    validate: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Selects up to ``budget`` candidates per request for the verify pass.

    Args:
        scores: float, shape ``[B, N]``: cumulative draft probability of each candidate
            (>= 0, no NaN).
        parents: int32 or int64, shape ``[B, N]``: index in [0, N) of each candidate's
            parent, or -1 for a child of the root. Must form a forest (no cycles).
        node_experts: int64, shape ``[B, N, L, W]``: predicted expert bitmaps per candidate.
        budget: candidates to select per request (>= 0); "adaptive" may take fewer.
        root_experts: int64, shape ``[B, L, W]``, or None (empty): experts the verify pass
            loads anyway (each request's root token).
        policy: "confidence", "ecospec" or "adaptive".
        eps: > 0, added to DeltaCost so fully covered nodes keep a finite score. In units
            of one expert load in one layer: ``costmodel.selection_cost`` derives it.
        share_buffer: one buffer for the whole batch, seeded with every request's root
            experts; requests then pick one node each in turn (request 0 first), so every
            request gets its budget. Only "ecospec" and "adaptive" read the buffer;
            "adaptive" then keeps one account for the whole step.
        layer_weights: float, shape ``[L]``, >= 0, or None (all ones).
        expert_rank: int32 or int64, shape ``[E]`` (every layer) or ``[L, E]``, or None:
            the EP rank in [0, R) that holds each (logical) expert, one replica each
            (``sgl_ecospec.placement.expert_rank_map`` builds it from SGLang's expert
            location metadata). With it DeltaCost is the expert-parallel cost.
        num_ranks: R (>= 1), or None for ``expert_rank.max() + 1`` (a host sync on GPU).
            Only with ``expert_rank``.
        total_weight: in [0, 1], weight of the experts off the busiest rank (0: the busiest
            rank only; 1: every expert alike, i.e. plain "ecospec"); None for 1 / R. Only
            with ``expert_rank``.
        step_tokens: >= 0, expected tokens one request's step yields before any candidate
            (1: the bonus token). Only "adaptive" reads it.
        step_cost: > 0, one request's share of the step's predicted cost before any
            candidate (drafting, the verify pass over the roots, accept/reject), in the
            units of eps. Required by "adaptive", ignored by the other policies. With
            ``share_buffer`` the step's account starts at B x step_tokens and B x step_cost.
        candidate_cost: >= 0, what a request's first candidate costs beyond DeltaCost + eps,
            in the units of eps (0: nothing; ``selection_cost``'s ``candidate_cost``).
        candidate_decay: in [0, 1], the factor by which each candidate a request takes
            lowers its next one's ``candidate_cost`` share.
        min_score: >= 0, the lowest score a candidate may have to be taken (0: any).
        validate: check values (NaN or negative scores, parents out of range, cycles, ranks
            out of range, negative or non-finite layer weights); costs host syncs on GPU.
            Shapes and dtypes are always checked.
        impl: "auto" (compiled op when built), "native" or "reference".

    Returns:
        int64, shape ``[B, budget]``: selected candidate indices, ascending, every selected
        node's parent selected or the root; rows with fewer selected nodes than ``budget``
        end with -1.
    """
    SelectionOptions(
        policy,
        eps,
        bool(share_buffer),
        total_weight,
        step_tokens,
        step_cost,
        candidate_cost,
        candidate_decay,
        min_score,
    )  # checks the scalar options
    _check_inputs(scores, parents, node_experts, budget, root_experts, layer_weights)
    placement = _check_placement(node_experts, expert_rank, num_ranks, total_weight)
    step_tokens = float(step_tokens)
    step_cost = 1.0 if step_cost is None else float(step_cost)
    if validate:
        _check_values(scores, parents)
        if layer_weights is not None and not bool(
            (torch.isfinite(layer_weights) & (layer_weights >= 0)).all()
        ):
            raise ValueError("layer_weights must be finite and >= 0")
        if expert_rank is not None:
            _check_ranks(expert_rank, placement[0])
    num_ranks, total_weight = placement
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
            None if expert_rank is None else expert_rank.contiguous(),
            num_ranks,
            total_weight,
            step_tokens,
            step_cost,
            float(candidate_cost),
            float(candidate_decay),
            float(min_score),
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
        expert_rank=expert_rank,
        num_ranks=num_ranks,
        total_weight=total_weight,
        step_tokens=step_tokens,
        step_cost=step_cost,
        candidate_cost=float(candidate_cost),
        candidate_decay=float(candidate_decay),
        min_score=float(min_score),
    )


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


def _check_placement(node_experts, expert_rank, num_ranks, total_weight) -> tuple[int, float]:
    """Checks the EP arguments; returns (R, total_weight) with the defaults filled in
    ((1, 0.0) without ``expert_rank``)."""
    if expert_rank is None:
        for name, value in (("num_ranks", num_ranks), ("total_weight", total_weight)):
            if value is not None:
                raise ValueError(f"{name} needs expert_rank (the expert -> EP rank placement)")
        return 1, 0.0
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
    if num_ranks is None:
        num_ranks = int(expert_rank.max()) + 1 if expert_rank.numel() else 1
        num_ranks = max(num_ranks, 1)
    check_int("num_ranks", num_ranks, minimum=1)
    return num_ranks, 1.0 / num_ranks if total_weight is None else float(total_weight)


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
