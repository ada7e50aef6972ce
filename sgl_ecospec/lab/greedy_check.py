"""Whether two checkpoints of one function decode the same greedy text, and if not, why.

Two checkpoints that compute one function up to summation order (the bandwidth-bound
testbed and the full one) can still pick different greedy tokens where two candidates'
logits are closer than the rounding noise. :func:`compare_greedy` decodes each prompt with
both, and classifies every first difference: a **near-tie** when, on the common prefix, the
two tokens' logits are within ``near_tie`` of each other in both models (the order flipped
by noise), otherwise a **divergence** (a real change of function).
"""

import torch
from torch import nn

# Logit gap (nats) below which a flipped greedy choice counts as a near-tie: float32
# summation-order noise after a 30-layer forward is orders of magnitude smaller (the
# comparison reports the largest logit difference it measured next to it).
NEAR_TIE = 1e-3


@torch.no_grad()
def greedy(model: nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` (a KV-cached ``generate``, no EOS stop)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def last_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """float32 ``[V]``: the next-token logits after ``ids`` (one full forward)."""
    return model(torch.tensor([ids])).logits[0, -1].float()


def compare_greedy(
    reference: nn.Module,
    candidate: nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    near_tie: float = NEAR_TIE,
) -> dict:
    """Greedy decoding of every prompt by both models, compared token by token.

    Args:
        reference, candidate: causal LMs (transformers ``generate`` and ``.logits``).
        prompts: token ids of each prompt.
        new_tokens: tokens decoded per prompt.
        near_tie: the logit gap below which a difference is a near-tie.

    Returns:
        ``{"prompts", "identical", "near_ties", "divergences", "max_logit_diff",
        "differences"}``: counts of prompts, the largest |logit difference| between the
        models after each full prompt, and per differing prompt its index, first
        differing position, both tokens and both models' gap between them there.
    """
    report = {"prompts": len(prompts), "identical": 0, "near_ties": 0, "divergences": 0}
    differences, max_diff = [], 0.0
    for index, prompt in enumerate(prompts):
        before, after = last_logits(reference, prompt), last_logits(candidate, prompt)
        max_diff = max(max_diff, (before - after).abs().max().item())
        ref_tokens = greedy(reference, prompt, new_tokens)
        cand_tokens = greedy(candidate, prompt, new_tokens)
        if ref_tokens == cand_tokens:
            report["identical"] += 1
            continue
        position = next(
            i for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens, strict=True)) if a != b
        )
        prefix = prompt + ref_tokens[:position]
        ours, theirs = ref_tokens[position], cand_tokens[position]
        gaps = [
            abs(logits[ours] - logits[theirs]).item()
            for logits in (last_logits(reference, prefix), last_logits(candidate, prefix))
        ]
        tie = max(gaps) <= near_tie
        report["near_ties" if tie else "divergences"] += 1
        differences.append(
            {
                "prompt": index,
                "position": position,
                "tokens": [ours, theirs],
                "logit_gaps": gaps,
                "near_tie": tie,
            }
        )
    return {**report, "max_logit_diff": max_diff, "differences": differences}
