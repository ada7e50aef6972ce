"""What the engine records per decode step, and the results it returns.

Shape legend: T = verified tokens, L = MoE layers, K = experts per token, E = experts per
layer, W = ceil(E / 64) bitmap words, R = expert-parallel (EP) ranks.
"""

import dataclasses

import torch

from sgl_ecospec.ops.bitmaps import WORD_BITS, bitmap_popcount, topk_to_bitmap
from sgl_ecospec.step import batch_index, verify_rows


@dataclasses.dataclass
class StepStats:
    """One target forward of the decode loop (prefill is not a step).

    Attributes:
        batch_size: requests in the step.
        verified_tokens: tokens the target ran (root + selected candidates of every request;
            one per request in greedy decoding).
        accepted: per request, draft tokens accepted (the bonus token not counted).
        unique_experts: per MoE layer, distinct experts routed over all verified tokens of
            the batch (what the verify pass loads).
        recall: predictor top-K recall on the verified tokens, None without a predictor.
        request_ids: index in the prompt list of each request of the step.
        expert_bitmap: int64 ``[L, W]`` on the CPU: per MoE layer, the union of experts
            ``unique_experts`` counts, as a bitmap (``sgl_ecospec.ops.bitmaps`` layout); what
            :meth:`busiest_rank_experts` reads. None when not recorded.
        paired_bitmaps: int64 ``[1 + C, L, W]`` on the CPU, only with C paired selections
            (``OfflineEngine.generate_speculative(compare=...)``): the true expert union
            of the batch's verify set, then of the ones the compared selections picked on
            the same tree, all from one target pass over the whole tree.
        paired_scores: with ``paired_bitmaps``: the sets' summed cumulative draft
            probabilities (the draft's estimate of the accepted tokens each can yield).
        paired_accepted: with ``paired_bitmaps``: the sets' accepted draft tokens,
            summed over the batch, from the same pass (``tree.accepted_within``).
        paired_verified: with ``paired_bitmaps``: the sets' verified tokens (roots and
            candidates), summed over the batch.
        predicted_accepted: per request, the draft tokens its verify set was expected to
            get accepted under the calibrated acceptance probabilities, as they stood before
            this step's result was learnt (``sgl_ecospec.acceptance``); None when not
            recorded.
        predicted_accepted_raw: the same under the raw cumulative draft probabilities.
    """

    batch_size: int
    verified_tokens: int
    accepted: list[int]
    unique_experts: list[int]
    recall: float | None = None
    request_ids: list[int] = dataclasses.field(default_factory=list)
    expert_bitmap: torch.Tensor | None = None
    paired_bitmaps: torch.Tensor | None = None
    paired_scores: list[float] | None = None
    paired_accepted: list[int] | None = None
    paired_verified: list[int] | None = None
    predicted_accepted: list[float] | None = None
    predicted_accepted_raw: list[float] | None = None

    def busiest_rank_experts(self, expert_rank: torch.Tensor, num_ranks: int) -> list[int]:
        """Per MoE layer, the most experts of the step's union that one EP rank holds.

        Under expert parallelism each rank loads only its own experts, and the pass waits
        for the busiest rank: this is the load that sets the pace.

        Args:
            expert_rank: int32 or int64 ``[E]`` (every layer) or ``[L, E]``: the rank of
                each expert, in [0, R).
            num_ranks: R (>= 1).

        Returns:
            ``L`` counts, each in [ceil(unique / R), unique]; equal to ``unique_experts``
            with R = 1.
        """
        if self.expert_bitmap is None:
            raise ValueError("this step recorded no expert_bitmap")
        return rank_loads(self.expert_bitmap, expert_rank, num_ranks).amax(-1).tolist()


@dataclasses.dataclass
class GreedyResult:
    """outputs: generated tokens per prompt; steps: one entry per decode step."""

    outputs: list[list[int]]
    steps: list[StepStats]


@dataclasses.dataclass
class SpecResult:
    """outputs: generated tokens per prompt; steps: one per verify step; predictor_recall:
    top-K recall over all verified tokens of the run (None when nothing was verified)."""

    outputs: list[list[int]]
    steps: list[StepStats]
    predictor_recall: float | None


def union_bitmap(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per layer, the union of the experts a set of tokens was routed to.

    Args:
        routing: int64 ``[T, L, K]``: the experts each token was routed to.
        num_experts: E.

    Returns:
        int64 ``[L, W]`` bitmaps.
    """
    # One row per layer holding every token's ids: its bitmap is the union over tokens.
    per_layer = routing.permute(1, 0, 2).reshape(routing.shape[1], -1)
    return topk_to_bitmap(per_layer, num_experts, validate=False)


def unique_experts(routing: torch.Tensor, num_experts: int) -> list[int]:
    """Distinct experts per layer over a set of tokens.

    Args:
        routing: int64 ``[T, L, K]``: the experts each token was routed to.
        num_experts: E.

    Returns:
        ``L`` counts in [K, E] (for T >= 1).
    """
    return bitmap_popcount(union_bitmap(routing, num_experts)).tolist()


def rank_loads(bitmap: torch.Tensor, expert_rank: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Experts of each layer's bitmap that each EP rank holds.

    Args:
        bitmap: int64 ``[..., L, W]``.
        expert_rank: int32 or int64 ``[E]`` or ``[L, E]``, ranks in [0, R); E fixes how
            many bits are read (bits >= E are ignored).
        num_ranks: R (>= 1).

    Returns:
        int64 ``[..., L, R]``: per layer and rank, the experts set that the rank holds.
    """
    num_experts = expert_rank.shape[-1]
    if bitmap.shape[-1] * WORD_BITS < num_experts:
        raise ValueError(
            f"expert_rank covers {num_experts} experts but the bitmaps hold only "
            f"{bitmap.shape[-1] * WORD_BITS} bits per layer"
        )
    rank = expert_rank.long().to(bitmap.device)
    if bool(((rank < 0) | (rank >= num_ranks)).any()):
        raise ValueError(f"expert_rank values must lie in [0, num_ranks={num_ranks})")
    shifts = torch.arange(WORD_BITS, device=bitmap.device)
    # Arithmetic shift keeps the sign, but & 1 still reads exactly bit k.
    bits = ((bitmap[..., None] >> shifts) & 1).flatten(-2)[..., :num_experts]  # [..., L, E]
    rank = rank.expand(bits.shape[-2:]).expand(bits.shape)
    loads = torch.zeros((*bits.shape[:-1], num_ranks), dtype=torch.int64, device=bitmap.device)
    return loads.scatter_add_(-1, rank, bits)


def step_stats(routing: torch.Tensor, num_experts: int, **fields) -> StepStats:
    """A step's record from the routing ``[T, L, K]`` of its verified tokens: the union
    bitmap per layer (kept on the CPU) and its counts; ``fields`` fill the rest."""
    bitmap = union_bitmap(routing, num_experts)
    return StepStats(
        batch_size=len(fields["accepted"]),
        verified_tokens=routing.shape[0],
        unique_experts=bitmap_popcount(bitmap).tolist(),
        expert_bitmap=bitmap.cpu(),
        **fields,
    )


def selection_union(truth: torch.Tensor, selected: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[L, W]``: the union over the batch of the true routing ``truth [B, 1 + N, L, K]``
    of every root and every candidate in ``selected [B, S]`` (-1 padding skipped)."""
    rows = verify_rows(selected)  # padding lands on the root, in the union anyway
    return union_bitmap(truth[batch_index(rows), rows].flatten(0, 1), num_experts)


def selected_score(scores: torch.Tensor, selected: torch.Tensor) -> float:
    """Sum over the batch of the cumulative draft probabilities ``scores [B, N]`` of the
    candidates in ``selected [B, S]`` (-1 padding skipped): the draft's own estimate of
    the accepted tokens the set can yield."""
    taken = scores.gather(1, selected.clamp_min(0)).double()
    return float(taken.masked_fill(selected < 0, 0).sum())


def overall_recall(steps: list[StepStats]) -> float | None:
    """Recall over all verified tokens: the step recalls weighted by verified tokens."""
    tokens = sum(step.verified_tokens for step in steps)
    return sum(step.recall * step.verified_tokens for step in steps) / tokens if steps else None
