"""Whether two checkpoints of one function decode the same greedy text, and if not, why.

Two checkpoints that compute one function up to summation order (the bandwidth-bound
testbed and the full one) can still pick different greedy tokens where two candidates'
logits are closer than the rounding noise. :func:`compare_greedy` decodes each prompt
greedily with the reference, then reads prompt and continuation with both models in one
forward each (teacher-forced): the candidate decodes the same text exactly when its argmax
at every continuation position is the reference's token. Every first difference is
classified: a **near-tie** when the two tokens' logits are within ``near_tie`` of each
other in both models (the order flipped by noise), otherwise a **divergence** (a real
change of function). One forward instead of a decode loop keeps the large candidate cheap.
"""

from collections.abc import Callable

import torch
from torch import nn

# Logit gap (nats) below which a flipped greedy choice counts as a near-tie: float32
# summation-order noise is far smaller (the report gives the largest logit difference
# measured between the models next to it).
NEAR_TIE = 1e-3


@torch.no_grad()
def greedy(model: nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Up to ``new_tokens`` greedy tokens after ``prompt``, the end-of-sequence token
    included when it comes first (a KV-cached ``generate``). Not forced past it: with EOS
    suppressed the continuation is not the model's argmax, and the teacher-forced reading
    would report that as a difference."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def continuation_logits(model: nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 ``[len(tokens), V]``: the logits that predict each of ``tokens`` after
    ``prompt`` (one teacher-forced forward)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def compare_greedy(
    reference: nn.Module,
    candidate: nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    near_tie: float = NEAR_TIE,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Greedy continuations of every prompt, the reference's against the candidate's.

    Args:
        reference, candidate: causal LMs (transformers ``generate`` and ``.logits``).
        prompts: token ids of each prompt.
        new_tokens: tokens decoded per prompt (fewer where the reference ends first).
        near_tie: the logit gap below which a difference is a near-tie.
        log: receives one line per prompt.

    Returns:
        ``{"prompts", "identical", "near_ties", "divergences", "max_logit_diff",
        "differences"}``: prompt counts, the largest |logit difference| between the models
        over every continuation position, and per differing prompt its index, first
        differing position, both tokens and both models' logit gap between them there.
    """
    report = {"prompts": len(prompts), "identical": 0, "near_ties": 0, "divergences": 0}
    differences, max_diff = [], 0.0
    for index, prompt in enumerate(prompts):
        tokens = greedy(reference, prompt, new_tokens)
        ours = continuation_logits(reference, prompt, tokens)  # [new_tokens, V]
        theirs = continuation_logits(candidate, prompt, tokens)  # [new_tokens, V]
        max_diff = max(max_diff, (ours - theirs).abs().max().item())
        differ = (theirs.argmax(-1) != torch.tensor(tokens)).nonzero()
        if len(differ) == 0:
            report["identical"] += 1
            log(f"  prompt {index}: identical")
            continue
        position = int(differ[0])
        pair = [tokens[position], int(theirs[position].argmax())]
        gaps = [
            abs(row[pair[0]] - row[pair[1]]).item() for row in (ours[position], theirs[position])
        ]
        tie = max(gaps) <= near_tie
        report["near_ties" if tie else "divergences"] += 1
        kind = "near-tie" if tie else "DIVERGENCE"
        log(f"  prompt {index}: {kind} at token {position} {pair}, logit gaps {gaps}")
        differences.append(
            {
                "prompt": index,
                "position": position,
                "tokens": pair,
                "logit_gaps": gaps,
                "near_tie": tie,
            }
        )
    return {**report, "max_logit_diff": max_diff, "differences": differences}
