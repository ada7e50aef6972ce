"""greedy_check.compare_greedy on tiny Qwen2-MoE targets: the same function decodes
identically, a flipped near-tie and a real divergence are told apart."""

import copy

import pytest
import torch
from _models import tiny_target

from sgl_ecospec.lab.greedy_check import compare_greedy, continuation_logits

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 300]]


@pytest.fixture(scope="module")
def reference():
    return tiny_target()


def test_a_copy_decodes_identically(reference):
    lines = []
    report = compare_greedy(reference, copy.deepcopy(reference), PROMPTS, 6, log=lines.append)
    assert report["identical"] == 2 and report["prompts"] == 2
    assert lines == ["  prompt 0: identical", "  prompt 1: identical"]
    assert report["near_ties"] == report["divergences"] == 0 and report["differences"] == []
    assert report["max_logit_diff"] == 0.0


def test_a_flipped_near_tie_is_told_from_a_divergence(reference):
    prompt = PROMPTS[0]
    first, second = continuation_logits(reference, prompt, [0])[0].topk(2).indices.tolist()
    # Both models see the first two candidates within 1e-5 of each other, in opposite order.
    tied, flipped = copy.deepcopy(reference), copy.deepcopy(reference)
    with torch.no_grad():
        head = reference.lm_head.weight
        tied.lm_head.weight[second] = head[first] * (1 - 1e-6)
        flipped.lm_head.weight[second] = head[first] * (1 + 1e-6)
    report = compare_greedy(tied, flipped, [prompt], 4)
    assert report["near_ties"] == 1 and report["identical"] == report["divergences"] == 0
    (difference,) = report["differences"]
    assert difference["position"] == 0 and difference["tokens"] == [first, second]
    assert difference["near_tie"] and max(difference["logit_gaps"]) <= 1e-3
    # Against the unmodified reference, whose two candidates are far apart: a divergence.
    other = compare_greedy(reference, flipped, [prompt], 4)
    assert other["divergences"] == 1 and not other["differences"][0]["near_tie"]
