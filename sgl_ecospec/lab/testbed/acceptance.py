"""Acceptance length of the draft on the target's own greedy text, tree drafting simulated.

Greedy speculative decoding is lossless, so the verified text IS the target's greedy
continuation, and every verify step can be replayed offline on it: with root x_p (the last
verified token), the draft's cache holds teacher-forced rows 0..p-1 (row t: aux state g_t,
embedding of x_{t+1}); the tree is grown from row p-1 as SGLang's EAGLE-3 worker grows it
(top-k children per beam, the k best beams expanded per step, ``num_steps`` deep), the
``budget`` best candidates by cumulative draft probability are verified (confidence
selection), and the accepted length is 1 (bonus) + the depth of the longest selected path
that matches the continuation. Tree rows attend to the prefix and their true ancestors.

This is the quick in-build measurement; the offline engine (``sgl_ecospec.lab.engine``) is the
reference implementation.

Shape legend: T = sequence length, k = topk, H = hidden size, D = draft vocab.
"""

from dataclasses import dataclass

import torch

from sgl_ecospec.lab.testbed.draft_training import Sample
from sgl_ecospec.models import eagle3


@dataclass(frozen=True)
class TreeShape:
    """Draft tree parameters, named as SGLang's server flags."""

    topk: int = 4  # --speculative-eagle-topk
    num_steps: int = 3  # --speculative-num-steps
    budget: int = 4  # --speculative-num-draft-tokens minus the root


@dataclass
class Node:
    token: int  # target vocabulary id
    score: float  # cumulative draft probability
    parent: int  # index in the node list, -1 for children of the root
    depth: int  # 1 for children of the root


@torch.no_grad()
def replay(
    draft: eagle3.Eagle3Draft, embed, sample: Sample, prompt_len: int, shape: TreeShape
) -> list[int]:
    """Accepted lengths (bonus included) of every verify step over the sample's answer.

    Args:
        sample: target-read prompt + greedy answer; ``prompt_len`` tokens are the prompt.
    """
    tokens = sample.tokens
    rows = len(tokens) - 1
    positions = torch.arange(rows)[None]
    base = draft(embed(tokens[None, 1:]), sample.aux[None, :-1].float(), positions)
    accepted, p = [], prompt_len
    while p < len(tokens) - 1:
        nodes = _grow(draft, embed, base, p - 1, shape)
        accepted.append(accept_length(nodes, shape.budget, tokens[p + 1 :].tolist()))
        p += accepted[-1]
    return accepted


def accept_length(nodes: list[Node], budget: int, continuation: list[int]) -> int:
    """Tokens one verify step yields: 1 (bonus) + the depth of the longest path of the
    ``budget`` best-scored nodes whose tokens match ``continuation`` (the target's tokens
    after the root)."""
    chosen = sorted(range(len(nodes)), key=lambda i: -nodes[i].score)[:budget]
    depth, parent = 0, -1
    while depth < len(continuation):
        match = [
            i for i in chosen if nodes[i].parent == parent and nodes[i].token == continuation[depth]
        ]
        if not match:
            break
        depth, parent = depth + 1, match[0]
    return depth + 1


def _grow(draft, embed, base: eagle3.Eagle3Output, row: int, shape: TreeShape) -> list[Node]:
    """Candidate tree below the root, grown from teacher-forced draft row ``row``."""
    k = shape.topk
    prefix = (base.key[:, :, : row + 1], base.value[:, :, : row + 1])
    probs, ids = torch.softmax(base.logits[0, row].float(), -1).topk(k)
    nodes = [
        Node(int(t), float(s), -1, 1) for t, s in zip(draft.to_target_ids(ids), probs, strict=True)
    ]
    beams = list(range(k))  # node indices expanded by the next forward
    beam_hidden = base.hidden[0, row].expand(k, -1)  # hidden each beam's row reads
    tree_keys = []  # per earlier tree forward: (key, value, node ids of its rows)
    for step in range(1, shape.num_steps):
        beam_tokens = torch.tensor([nodes[i].token for i in beams])
        mask = [torch.ones(k, row + 1, dtype=torch.bool)]
        for _, _, row_nodes in tree_keys:
            mask.append(
                torch.tensor([[_is_ancestor(nodes, r, b) for r in row_nodes] for b in beams])
            )
        mask.append(torch.eye(k, dtype=torch.bool))
        past = (
            torch.cat([prefix[0]] + [kv[0] for kv in tree_keys], 2),
            torch.cat([prefix[1]] + [kv[1] for kv in tree_keys], 2),
        )
        out = draft(
            embed(beam_tokens)[None],
            beam_hidden[None],
            torch.full((1, k), row + step),
            past=past,
            attn_mask=torch.cat(mask, 1)[None],
        )
        tree_keys.append((out.key, out.value, list(beams)))
        probs, ids = torch.softmax(out.logits[0].float(), -1).topk(k)  # [k, k]
        scores = torch.tensor([nodes[b].score for b in beams])[:, None] * probs
        first = len(nodes)
        for j, b in enumerate(beams):
            for c in range(k):
                token = int(draft.to_target_ids(ids[j, c]))
                nodes.append(Node(token, float(scores[j, c]), b, nodes[b].depth + 1))
        best = scores.flatten().topk(k).indices.tolist()
        beams = [first + i for i in best]
        beam_hidden = out.hidden[0, [i // k for i in best]]
    return nodes


def _is_ancestor(nodes: list[Node], candidate: int, node: int) -> bool:
    while node >= 0:
        if node == candidate:
            return True
        node = nodes[node].parent
    return False


def mean_acceptance(lengths: list[list[int]]) -> float:
    """Mean accepted tokens per verify step over all steps of all samples."""
    flat = [a for per_sample in lengths for a in per_sample]
    return sum(flat) / max(len(flat), 1)
