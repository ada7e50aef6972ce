"""What the offline engine gives the expert predictor besides the candidate tokens: each
row's context (its parent token) and the live recall measured on every verify step (which
``SpecConfig.recall_weighted_cost`` selects with, ``LiveRecall.weigh``).

Shape legend: B = requests, N = candidates, S = budget, T = verified rows, L = MoE layers,
K = experts per token.
"""

import torch

from sgl_ecospec.predictors import ExpertPredictor, LiveRecall
from sgl_ecospec.step import StepSelection, batch_index, verify_rows


def last_prompt_tokens(prompts: list[list[int]], device) -> torch.Tensor:
    """int64 ``[B]``: each prompt's last token, the context of the first root."""
    return torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=device)


def next_root_context(roots: torch.Tensor, new_tokens: list[list[int]]) -> torch.Tensor:
    """int64 ``[B]``: the token before each next root (the last of ``new_tokens``): the one
    before it in ``new_tokens``, or the current root ``roots [B]`` when only the bonus token
    was added."""
    before = [tokens[-2] if len(tokens) > 1 else -1 for tokens in new_tokens]
    known = torch.tensor(before, dtype=torch.int64, device=roots.device)
    return torch.where(known >= 0, known, roots)


def verified_context(chosen: StepSelection, valid: torch.Tensor) -> dict:
    """``{"context_tokens": int64 [T]}``, the parent tokens of the verified rows (``valid``
    bool ``[B, 1 + S]`` marks them), for a predictor that reads context; ``{}`` otherwise."""
    if chosen.context is None:
        return {}
    rows = verify_rows(chosen.selected)
    return {"context_tokens": chosen.context[batch_index(rows), rows][valid]}


def record_recall(
    predictor: ExpertPredictor,
    chosen: StepSelection,
    valid: torch.Tensor,
    routing: torch.Tensor,
    *,
    budget: int | None = None,
    placement=None,
    total_weight: float | None = None,
) -> None:
    """Adds a verify step to the predictor's :class:`LiveRecall` (attached on first use):
    the recall on every verified row, the trust in the predicted new experts, and the new
    experts the verified candidates bring.

    Args:
        chosen: the step's selection (its ``verify_predicted`` ``[B, 1 + S, L, K]``).
        valid: bool ``[B, 1 + S]``: the verified rows (root first).
        routing: int ``[B, 1 + S, L, K]``: the target's routing of the verify rows.
        budget: S, candidates a request may verify, or None (``LiveRecall.update_novel``
            amortises the measured cost over a whole verify set).
        placement, total_weight: the EP placement selection prices with and its weight of
            the experts off the busiest rank, or None (``LiveRecall.update_novel``).
    """
    live = LiveRecall.of(predictor, routing.device)
    live.update(chosen.verify_predicted[valid], routing[valid])
    live.update_cost_fit(chosen.verify_predicted, routing, valid)
    live.update_novel(routing, valid, budget=budget, placement=placement, total_weight=total_weight)
