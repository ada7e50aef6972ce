"""Calibrated acceptance: the probability that the target accepts each draft-tree node,
learnt online from verify results, in place of the draft's own cumulative probability.

The draft's cumulative probabilities are not acceptance probabilities: how far off they are
depends on the draft and the workload (issue 15 found an earlier testbed draft promising
about 4x the tokens it delivered; the shipped full-v1 draft is close at batch 1,
docs/RESULTS.md), and every rule that weighs P against cost (EcoSpec's
P / (DeltaCost + eps), the adaptive account) inherits the error.
:class:`AcceptanceCalibrator` corrects P with what verification shows.

Model. A node v with parent u (the root for depth 0) has the draft edge probability
q_v = score_v / score_u (score_root = 1): the draft's probability that the target, having
accepted u, picks v next. The calibrated edge acceptance is

    f_v = min(1, q_v * ratio[depth_v, bin(q_v)]),

where ``ratio`` is, per (depth, q bin), the tokens accepted over the tokens the draft
promised (the sum of q) among the nodes that were *tested*: verified with their parent
accepted (or the root as parent). A node is accepted only if its parent is, so by the chain
rule its calibrated acceptance probability is the product of f along its root path:
P(v) = f_v * P(u). Every factor is <= 1, so P never rises from parent to child and an
ancestor-closed selection on P stays valid; within a bin P keeps the draft's order.

Prior. Ratios shrink towards the pooled ratio one level up, w = ``prior_weight``
pseudo-tokens each: the global ratio towards 1, G = (A + w) / (P + w) over every bin; each
depth's towards G, R_d = (A_d + w G) / (P_d + w); each bin's towards its depth's,
ratio = (A_db + w R_d) / (P_db + w) (A: accepted, P: promised tokens). A cold calibrator
returns the raw draft probabilities (the uncalibrated behaviour, not a guess of its own);
after the first verify results every bin, even one not seen yet, follows the pooled ratio
(the draft's overconfidence is mostly shared), and a bin moves to its own measured ratio
once it has seen a few times w promised tokens. ``halve_every`` ages the counts so the
ratios follow a drifting workload.

Predicted acceptance length of a verify set: 1 (the bonus token) + the sum of its nodes'
acceptance probabilities (:func:`expected_accepted`).

Graph safety: with ``validate=False``, :meth:`AcceptanceCalibrator.calibrate` and
:meth:`AcceptanceCalibrator.observe` run a fixed number of batched kernels with static
shapes and no host sync; the count tables are persistent and updated in place
(``index_add_``), so a CUDA graph captured around ``calibrate`` keeps reading live counts.

Shape legend: B = requests, N = candidates per request, S = selected candidates per
request, A = accepted-path rows per request, D = ``max_depth`` (draft steps),
M = ``num_bins``.
"""

import torch

from sgl_ecospec.ops.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_int,
    check_positive,
    check_same_device,
    check_shape,
    check_tensor,
)


class AcceptanceCalibrator:
    """Per (depth, draft-probability bin) acceptance ratios, learnt from verify results.

    Args:
        max_depth: D, the deepest candidate depth + 1 (the draft steps: SGLang's
            ``--speculative-num-steps``); deeper trees are an error (``validate``).
        num_bins: M, equal-width bins of the edge probability q in [0, 1].
        prior_weight: w > 0, pseudo-tokens at ratio 1 per bin (cold start: the raw draft
            probabilities).
        halve_every: halve every count after this many ``observe`` calls; 0 = never.
        device: where the tables live.

    Attributes:
        accepted: float32 ``[D, M]``: tested nodes accepted, per depth and q bin.
        promised: float32 ``[D, M]``: the sum of q over the same tested nodes.
        observe_calls: ``observe`` calls so far (a Python int: aging needs no host sync).
    """

    def __init__(
        self,
        max_depth: int,
        *,
        num_bins: int = 10,
        prior_weight: float = 1.0,
        halve_every: int = 0,
        device: str | torch.device = "cpu",
    ):
        self.max_depth = check_int("max_depth", max_depth, minimum=1)
        self.num_bins = check_int("num_bins", num_bins, minimum=1)
        self.prior_weight = check_positive("prior_weight", prior_weight)
        self.halve_every = check_int("halve_every", halve_every, minimum=0)
        self.device = torch.device(device)
        shape = (self.max_depth, self.num_bins)
        self.accepted = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.promised = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.observe_calls = 0

    def ratios(self) -> torch.Tensor:
        """float32 ``[D, M]``: accepted over promised tokens per (depth, q bin), each shrunk
        towards its depth's pooled ratio, which is shrunk towards the global one (module
        docstring)."""
        weight = self.prior_weight
        pooled = (self.accepted.sum() + weight) / (self.promised.sum() + weight)  # []
        depth = (self.accepted.sum(1, keepdim=True) + weight * pooled) / (
            self.promised.sum(1, keepdim=True) + weight
        )  # [D, 1]
        return (self.accepted + weight * depth) / (self.promised + weight)

    def calibrate(
        self, scores: torch.Tensor, parents: torch.Tensor, *, validate: bool = True
    ) -> torch.Tensor:
        """Each candidate's calibrated probability of being accepted.

        Args:
            scores: float ``[B, N]``: cumulative draft probabilities (each node's path
                product), in [0, 1], never above the parent's.
            parents: int32 or int64 ``[B, N]``: parent candidate index, -1 for a child of
                the root; depth < D.
            validate: check values (host syncs on GPU); shapes and dtypes are always checked.

        Returns:
            ``[B, N]`` in ``scores``' dtype, in [0, 1]: P(node accepted), never above its
            parent's; the raw ``scores`` while every bin is cold.
        """
        self._check_tree(scores, parents, validate)
        edge, cell, has_parent, parent = self._edges(scores, parents)
        ratio = self.ratios().view(-1)[cell]  # [B, N]
        factor = (edge * ratio).clamp(max=1.0)  # [B, N], f_v
        probs = factor
        # Pointer-free path product: after d rounds every node of depth <= d is exact.
        for _ in range(self.max_depth - 1):
            above = torch.where(has_parent, probs.gather(1, parent), 1.0)
            probs = factor * above
        return probs.to(scores.dtype)

    def observe(
        self,
        scores: torch.Tensor,
        parents: torch.Tensor,
        selected: torch.Tensor,
        accepted_rows: torch.Tensor,
        *,
        valid: torch.Tensor | None = None,
        validate: bool = True,
    ) -> None:
        """Learns from one verify pass.

        Args:
            scores, parents: the tree, as :meth:`calibrate` (the raw draft scores).
            selected: int32 or int64 ``[B, S]``: the verified candidates, -1 padding (what
                ``select_verify_set`` returns).
            accepted_rows: int32 or int64 ``[B, A]``: the accepted path as verify rows in
                the root-first layout (row 0 the root, row r >= 1 the candidate
                ``selected[:, r - 1]``); row 0 and -1 padding are skipped.
            valid: bool ``[B]`` or None (all): requests whose results count (e.g. not the
                padded rows of a CUDA-graph replay).
            validate: check values (host syncs on GPU).
        """
        self._check_tree(scores, parents, validate)
        check_tensor("selected", selected, ndim=2, dtypes=INDEX_DTYPES)
        check_tensor("accepted_rows", accepted_rows, ndim=2, dtypes=INDEX_DTYPES)
        batch, num_nodes = scores.shape
        check_shape("selected", selected, (batch, selected.shape[1]), "[B, S]")
        check_shape(
            "accepted_rows", accepted_rows, (batch, accepted_rows.shape[1]), "[B, A] like scores"
        )
        if valid is not None:
            check_tensor("valid", valid, ndim=1, dtypes=(torch.bool,))
            check_shape("valid", valid, (batch,), "[B]")
        check_same_device(
            scores=scores, selected=selected, accepted_rows=accepted_rows, valid=valid
        )
        if validate:
            self._check_rows(selected, accepted_rows, num_nodes)
        verified = node_mask(selected.long(), num_nodes)  # [B, N]
        accepted = node_mask(accepted_candidates(selected, accepted_rows), num_nodes) & verified
        if valid is not None:
            verified = verified & valid[:, None]
            accepted = accepted & valid[:, None]
        edge, cell, has_parent, parent = self._edges(scores, parents)
        parent_accepted = torch.where(has_parent, accepted.gather(1, parent), True)
        tested = (verified & parent_accepted).float()  # [B, N]
        cells = cell.flatten()
        self.accepted.view(-1).index_add_(0, cells, (accepted.float() * tested).flatten())
        self.promised.view(-1).index_add_(0, cells, (edge.float() * tested).flatten())
        self.observe_calls += 1
        if self.halve_every and self.observe_calls % self.halve_every == 0:
            self.accepted.mul_(0.5)
            self.promised.mul_(0.5)

    def _edges(self, scores, parents):
        """Edge probability q float ``[B, N]``, table cell int64 ``[B, N]`` (depth * M + bin),
        has-parent bool ``[B, N]`` and parent index int64 ``[B, N]`` (0 for the root's
        children)."""
        parent = parents.long().clamp_min(0)
        has_parent = parents >= 0
        depth = torch.zeros_like(parent)
        for _ in range(self.max_depth - 1):
            depth = torch.where(has_parent, depth.gather(1, parent) + 1, 0)
        above = torch.where(has_parent, scores.gather(1, parent), 1.0)
        tiny = torch.finfo(scores.dtype).tiny
        edge = torch.where(above > 0, scores / above.clamp_min(tiny), 0.0).clamp(0.0, 1.0)
        bins = (edge.float() * self.num_bins).long().clamp(0, self.num_bins - 1)
        cell = depth.clamp(max=self.max_depth - 1) * self.num_bins + bins
        return edge, cell, has_parent, parent

    def _check_tree(self, scores, parents, validate: bool) -> None:
        check_tensor("scores", scores, ndim=2, dtypes=FLOAT_DTYPES)
        check_tensor("parents", parents, ndim=2, dtypes=INDEX_DTYPES)
        check_shape("parents", parents, tuple(scores.shape), "[B, N] like scores")
        check_same_device(scores=scores, parents=parents, calibrator_tables=self.accepted)
        if not validate or scores.numel() == 0:
            return
        if bool(torch.isnan(scores).any()) or bool((scores < 0).any()):
            raise ValueError("scores must be cumulative draft probabilities >= 0 (no NaN)")
        num_nodes = scores.shape[1]
        if bool(((parents < -1) | (parents >= num_nodes)).any()):
            raise ValueError(f"parents must be -1 or a candidate index in [0, {num_nodes})")
        ancestor = parents.long()
        for _ in range(self.max_depth - 1):
            ancestor = torch.where(
                ancestor >= 0, parents.long().gather(1, ancestor.clamp_min(0)), -1
            )
        if bool((ancestor >= 0).any()):
            raise ValueError(
                f"the tree is deeper than max_depth={self.max_depth} (or has a cycle): build "
                "the calibrator with max_depth = the draft steps (--speculative-num-steps)"
            )

    @staticmethod
    def _check_rows(selected, accepted_rows, num_nodes: int) -> None:
        if bool(((selected < -1) | (selected >= num_nodes)).any()):
            raise ValueError(f"selected must be -1 or a candidate index in [0, {num_nodes})")
        rows = selected.shape[1] + 1
        if bool(((accepted_rows < -1) | (accepted_rows >= rows)).any()):
            raise ValueError(
                f"accepted_rows must be -1 or a verify row in [0, {rows}) (row 0 the root, row "
                "r the candidate selected[:, r - 1])"
            )


def accepted_candidates(selected: torch.Tensor, accepted_rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, A]``: the candidate of each accepted verify row, -1 for the root and padding.

    Args:
        selected: int ``[B, S]``: the verified candidates, -1 padding.
        accepted_rows: int ``[B, A]``: verify rows (0 the root, r >= 1 ``selected[:, r - 1]``),
            -1 padding.
    """
    rows = accepted_rows.long()
    if selected.shape[1] == 0:
        return torch.full_like(rows, -1)
    picked = selected.long().gather(1, (rows - 1).clamp(0, selected.shape[1] - 1))
    return torch.where(rows >= 1, picked, -1)


def node_mask(nodes: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """bool ``[B, N]``: which of N candidates appear in ``nodes`` int64 ``[B, R]`` (-1 skipped)."""
    mask = torch.zeros(
        (nodes.shape[0], num_nodes + 1), dtype=torch.bool, device=nodes.device
    )  # the last column takes the padding
    mask.scatter_(1, torch.where(nodes >= 0, nodes, num_nodes), True)
    return mask[:, :num_nodes]


def expected_accepted(probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Expected accepted draft tokens of each request's verify set: the sum of its nodes'
    acceptance probabilities (predicted acceptance length = 1 + this).

    Args:
        probs: float ``[B, N]``: each candidate's acceptance probability (calibrated, or the
            raw cumulative draft probability for the draft's own estimate).
        selected: int ``[B, S]``: the verified candidates, -1 padding.

    Returns:
        float64 ``[B]``.
    """
    if selected.shape[1] == 0:
        return torch.zeros(probs.shape[0], dtype=torch.float64, device=probs.device)
    taken = probs.double().gather(1, selected.long().clamp_min(0))
    return taken.masked_fill(selected < 0, 0.0).sum(1)
