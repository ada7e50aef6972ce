"""Offline training of :class:`LowRankExpertHead` on recorded draft states and routing."""

import torch

from sgl_ecospec.ops.checks import check_int
from sgl_ecospec.predictors.base import multi_hot
from sgl_ecospec.predictors.head import LowRankExpertHead, bce_loss


def train_expert_head(
    head: LowRankExpertHead,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    token_ids: torch.Tensor | None = None,
    *,
    epochs: int = 5,
    batch_size: int = 32,
    lr: float = 3e-3,
    val_fraction: float = 0.1,
    holdout: str = "random",
    seed: int = 0,
    init_bias: bool = True,
    progress: bool = True,
) -> list[dict]:
    """Trains ``head`` offline on recorded (hidden state, token, routing) triples.

    A random ``val_fraction`` of the tokens is held out; each epoch shuffles the rest,
    takes Adam steps of BCE-with-logits against multi-hot targets, then measures top-K
    recall on the held-out tokens.

    Args:
        head: the head to train (in place).
        hidden: float, shape ``[T, H]``: drafter hidden states.
        topk_ids: int32 or int64, shape ``[T, L, K]``: the target's expert ids per token.
        token_ids: int32 or int64, shape ``[T]``; required when the head has a token term.
        epochs: passes over the training tokens (>= 1).
        batch_size: tokens per step (>= 1).
        lr: Adam learning rate.
        val_fraction: share of tokens held out, in [0, 1).
        holdout: "random" (a random share) or "last" (the last tokens: with triples
            recorded in decoding order, whole later prompts, unseen contexts).
        seed: fixes the split and the shuffling.
        init_bias: first set the output bias to the logit of each (layer, expert)'s rate in
            the training routing (for a fresh head; False keeps a trained head's bias).
        progress: print one line per epoch.

    Returns:
        One dict per epoch: ``epoch`` (1-based), ``train_loss`` (mean over the epoch's
        tokens) and ``val_recall`` (:func:`topk_recall`; NaN when nothing is held out).
    """
    if not isinstance(head, LowRankExpertHead):
        raise TypeError(f"head must be a LowRankExpertHead, got {type(head).__name__}")
    num_tokens = head._check_inputs(token_ids, hidden, validate=True)
    head._check_topk_ids(topk_ids, num_tokens, validate=True)
    check_int("epochs", epochs, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    check_int("seed", seed, minimum=0)
    if not (isinstance(lr, int | float) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not (isinstance(val_fraction, int | float) and 0 <= val_fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if holdout not in ("random", "last"):
        raise ValueError(f"holdout must be 'random' or 'last', got {holdout!r}")
    num_val = int(num_tokens * val_fraction)
    if num_tokens - num_val < 1:
        raise ValueError(
            f"no training tokens left: {num_tokens} tokens with val_fraction={val_fraction}"
        )

    def tokens(index):
        return None if token_ids is None else token_ids[index]

    generator = torch.Generator().manual_seed(seed)
    if holdout == "last":
        order = torch.arange(num_tokens)
        train_idx, val_idx = order[: num_tokens - num_val], order[num_tokens - num_val :]
    else:
        order = torch.randperm(num_tokens, generator=generator)
        val_idx, train_idx = order[:num_val], order[num_val:]
    # Start every (layer, expert) logit at the training routing's base rate, so the steps go
    # to what distinguishes tokens and contexts rather than to the marginal.
    if init_bias:
        rate = multi_hot(topk_ids[train_idx], head.num_experts, validate=False).mean(0)  # [L, E]
        with torch.no_grad():
            head.up.bias.copy_(torch.logit(rate.clamp(1e-4, 1 - 1e-4)).flatten())
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    history = []
    for epoch in range(1, epochs + 1):
        head.train()
        shuffled = train_idx[torch.randperm(train_idx.numel(), generator=generator)]
        loss_sum = torch.zeros((), dtype=torch.float64, device=head.up.weight.device)
        for start in range(0, shuffled.numel(), batch_size):
            batch = shuffled[start : start + batch_size]
            loss = bce_loss(head, hidden[batch], tokens(batch), topk_ids[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # Summed on the device and read once per epoch, not synced once per step.
            loss_sum += loss.detach().double() * batch.numel()
        head.eval()
        val_recall = (
            head.recall(tokens(val_idx), topk_ids[val_idx], hidden[val_idx])
            if num_val
            else float("nan")
        )
        record = {
            "epoch": epoch,
            "train_loss": float(loss_sum) / train_idx.numel(),
            "val_recall": val_recall,
        }
        history.append(record)
        if progress:
            print(
                f"epoch {epoch}/{epochs}: train loss {record['train_loss']:.4f}, "
                f"val recall {val_recall:.3f}",
                flush=True,
            )
    return history
