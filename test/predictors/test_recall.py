"""topk_recall and multi_hot (sgl_ecospec/predictors/base.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ecospec.predictors import (
    multi_hot,
    topk_recall,
)

L, E, K = 3, 16, 2


def ids(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_recall_hand_examples():
    true = ids([[[0, 1]], [[2, 3]]])
    assert topk_recall(true, true, 8) == 1.0
    assert topk_recall(ids([[[4, 5]], [[6, 7]]]), true, 8) == 0.0
    assert topk_recall(ids([[[0, 5]], [[3, 7]]]), true, 8) == 0.5
    # Order within a row does not matter.
    assert topk_recall(ids([[[1, 0]], [[3, 2]]]), true, 8) == 1.0


def test_recall_duplicates_count_once():
    # A repeated true id is one expert, so {1} fully covers [1, 1].
    assert topk_recall(ids([[[1, 2]]]), ids([[[1, 1]]]), 8) == 1.0
    # A repeated predicted id does not count twice: 1 of {1, 2} found.
    assert topk_recall(ids([[[1, 1]]]), ids([[[1, 2]]]), 8) == 0.5


def test_recall_mean_over_layers_and_different_k():
    pred = ids([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    true = ids([[[0, 9], [8, 9]]])  # layer 0: 1/2, layer 1: 0/2
    assert topk_recall(pred, true, 16) == 0.25


def test_recall_bad_inputs():
    with pytest.raises(ValueError, match=r"agree on \[T, L\]"):
        topk_recall(ids([[[0, 1]]]), ids([[[0, 1]], [[0, 1]]]), 8)
    with pytest.raises(ValueError, match="3 dims"):
        topk_recall(ids([[0, 1]]), ids([[0, 1]]), 8)
    with pytest.raises(ValueError, match="outside"):
        topk_recall(ids([[[0, 8]]]), ids([[[0, 1]]]), 8)
    with pytest.raises(ValueError, match="at least one token"):
        topk_recall(torch.zeros(0, 1, 2, dtype=torch.int64), torch.zeros(0, 1, 2).long(), 8)


@st.composite
def recall_cases(draw):
    num_experts = draw(st.integers(1, 130))
    tokens, layers = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    expert = st.integers(0, num_experts - 1)

    def id_lists(k):
        row = st.lists(expert, min_size=k, max_size=k)
        return st.lists(
            st.lists(row, min_size=layers, max_size=layers), min_size=tokens, max_size=tokens
        )

    return num_experts, draw(id_lists(draw(st.integers(1, 4)))), draw(id_lists(2))


@settings(max_examples=60, deadline=None)
@given(recall_cases())
def test_recall_matches_python_sets(case):
    num_experts, pred, true = case
    expected = [
        len(set(p) & set(t)) / len(set(t))
        for ptok, ttok in zip(pred, true, strict=True)
        for p, t in zip(ptok, ttok, strict=True)
    ]
    got = topk_recall(ids(pred), ids(true), num_experts)
    assert 0.0 <= got <= 1.0
    assert got == pytest.approx(sum(expected) / len(expected), abs=1e-12)


def test_multi_hot():
    hot = multi_hot(ids([[[0, 3], [2, 2]]]), 4)
    assert hot.dtype == torch.float32 and hot.shape == (1, 2, 4)
    assert hot.tolist() == [[[1, 0, 0, 1], [0, 0, 1, 0]]]
    with pytest.raises(ValueError, match="outside"):
        multi_hot(ids([[[0, 4]]]), 4)
