"""What the engine records per decode step, and the results it returns.

Shape legend: T = verified tokens, L = MoE layers, K = experts per token.
"""

import dataclasses

import torch

from sgl_ecospec.bitmaps import bitmap_popcount, topk_to_bitmap


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
    """

    batch_size: int
    verified_tokens: int
    accepted: list[int]
    unique_experts: list[int]
    recall: float | None = None
    request_ids: list[int] = dataclasses.field(default_factory=list)


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


def unique_experts(routing: torch.Tensor, num_experts: int) -> list[int]:
    """Distinct experts per layer over a set of tokens.

    Args:
        routing: int64 ``[T, L, K]``: the experts each token was routed to.
        num_experts: E.

    Returns:
        ``L`` counts in [K, E] (for T >= 1).
    """
    # One row per layer holding every token's ids: its bitmap is the union over tokens.
    per_layer = routing.permute(1, 0, 2).reshape(routing.shape[1], -1)
    return bitmap_popcount(topk_to_bitmap(per_layer, num_experts, validate=False)).tolist()
