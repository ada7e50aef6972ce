"""Token data from ShareGPT: packed chat-template chunks for calibration and perplexity.

Shape legend: B = chunks, L = chunk length in tokens.
"""

import math

import torch


def render(tokenizer, conversation: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def packed_chunks(tokenizer, conversations: list[list[dict]], num_chunks: int, length: int):
    """Renders conversations in order, concatenates them, cuts ``num_chunks`` chunks.

    Returns:
        int64 ``[num_chunks, length]``.

    Raises:
        ValueError: the conversations hold too few tokens.
    """
    need = num_chunks * length
    ids: list[int] = []
    for conv in conversations:
        ids.extend(render(tokenizer, conv))
        if len(ids) >= need:
            return torch.tensor(ids[:need]).view(num_chunks, length)
    raise ValueError(f"{len(conversations)} conversations hold {len(ids)} tokens, need {need}")


def token_counts(tokenizer, conversations: list[list[dict]]) -> torch.Tensor:
    """float64 ``[V]``: how often each token id occurs in the conversations' messages."""
    counts = torch.zeros(len(tokenizer), dtype=torch.float64)
    for conv in conversations:
        text = "\n".join(message["content"] for message in conv)
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        counts += torch.bincount(ids, minlength=len(counts)).double()
    return counts


@torch.no_grad()
def perplexity(model, chunks: torch.Tensor, batch: int = 8) -> float:
    """exp(mean next-token NLL) of a causal LM over ``chunks`` int64 ``[B, L]``."""
    total, count = 0.0, 0
    for b in range(0, len(chunks), batch):
        ids = chunks[b : b + batch]
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total, count = total + nll.item(), count + ids[:, 1:].numel()
    return math.exp(total / count)
