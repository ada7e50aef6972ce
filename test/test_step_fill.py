"""fill_unused_slots: a fixed-width verify's unused slots hold copies of a chosen leaf, which
add no expert to the step and cannot change which path verification accepts."""

import pytest
import torch

from sgl_ecospec.ops.selection import select_verify_set
from sgl_ecospec.step import fill_unused_slots


def _tree():
    # candidates: 0,1 under the root; 2,3 under 0; 4 under 1; 5 under 2.
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2]])
    scores = torch.tensor([[0.6, 0.3, 0.4, 0.1, 0.2, 0.3]])
    return scores, parents


@pytest.mark.parametrize(
    "selected, expected",
    [
        ([[0, 2, -1, -1]], [[0, 2, 2, 2]]),  # 2 is the chosen leaf
        ([[0, 1, 2, -1]], [[0, 1, 2, 2]]),  # leaves 1 and 2: the higher index
        ([[0, 2, 5, 1]], [[0, 1, 2, 5]]),  # nothing to fill: sorted as given
        ([[1, 4, -1, -1]], [[1, 4, 4, 4]]),
        ([[-1, -1, -1, -1]], [[0, 0, 0, 0]]),  # nothing chosen: the best root child
    ],
)
def test_unused_slots_copy_a_chosen_leaf(selected, expected):
    scores, parents = _tree()
    filled = fill_unused_slots(torch.tensor(selected), scores, parents)
    assert filled.tolist() == expected


def test_copies_add_no_expert_and_keep_each_row_a_tree():
    torch.manual_seed(0)
    batch, n, layers, experts = 6, 20, 3, 16
    parents = torch.full((batch, n), -1)
    for c in range(4, n):  # a random tree whose children follow their parents
        parents[:, c] = torch.randint(0, c, (batch,))
    scores = torch.rand(batch, n)
    for c in range(4, n):  # cumulative path probabilities, as a draft tree's
        scores[:, c] *= scores[torch.arange(batch), parents[:, c]]
    bitmaps = torch.ones(batch, n, layers, 1, dtype=torch.int64) << torch.randint(
        0, experts, (batch, n, layers, 1)
    )
    selected = select_verify_set(
        scores,
        parents,
        bitmaps,
        6,
        policy="adaptive",
        eps=0.5,
        step_cost=6.0,
        root_experts=torch.zeros(batch, layers, 1, dtype=torch.int64),
    )
    assert (selected < 0).any() and (selected >= 0).any()  # some slots used, some not
    filled = fill_unused_slots(selected, scores, parents)
    for b in range(batch):
        chosen = {c for c in selected[b].tolist() if c >= 0}
        row = filled[b].tolist()
        assert row == sorted(row) and min(row) >= 0
        if chosen:
            assert set(row) == chosen  # copies of chosen nodes only: the same expert union
            for c in row:  # ancestor-closed: every node's parent is the root or in the row
                assert parents[b, c] < 0 or parents[b, c].item() in set(row)
            copies = [c for c in set(row) if row.count(c) > 1]
            for c in copies:  # a copied node has no chosen child: nothing hangs under it
                assert not (parents[b, list(chosen)] == c).any()
        else:
            assert set(row) == {int(scores[b].masked_fill(parents[b] >= 0, -1).argmax())}


def test_graph_safe_under_torch_compile():
    scores, parents = _tree()
    compiled = torch.compile(fill_unused_slots, fullgraph=True, backend="eager")
    selected = torch.tensor([[0, 2, -1, -1]])
    assert torch.equal(
        compiled(selected, scores, parents), fill_unused_slots(selected, scores, parents)
    )
