"""Policy "adaptive" in SGLang's fixed-width verify: copies of a chosen leaf fill the unused
slots, are taken out of the sibling chains SGLang builds (so neither greedy nor sampling
verification ever counts them), and the routing check counts copies routed differently."""

from types import SimpleNamespace

import torch
from sglang_ecospec import fixed_width
from sglang_ecospec_cpu.ops import FULL_MASK, build_tree_kernel_efficient, verify_tree_greedy

from sgl_ecospec.step import fill_unused_slots

TOPK, DEPTH = 2, 3


def _tree_links(parent_list, selected, seq_len=5):
    """SGLang's tree links (CPU port of build_tree_kernel_efficient) of one request."""
    nodes = selected.shape[1] + 1
    links = torch.full((3, 1, nodes), -1, dtype=torch.long)
    mask = torch.ones(nodes * (seq_len + nodes), dtype=torch.bool)
    positions = torch.empty(nodes, dtype=torch.long)
    index, first_child, next_sibling = links
    build_tree_kernel_efficient(
        parent_list,
        selected,
        torch.tensor([seq_len]),
        mask,
        positions,
        index,
        first_child,
        next_sibling,
        TOPK,
        DEPTH,
        nodes,
        FULL_MASK,
    )
    return index, first_child, next_sibling, positions


def _greedy(tokens, links, target):
    index, first_child, next_sibling, _ = links
    nodes = tokens.shape[1]
    predicts = torch.zeros(nodes, dtype=torch.int32)
    accept_index = torch.full((1, DEPTH + 1), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    verify_tree_greedy(
        predicts, accept_index, accept_num, tokens, index, first_child, next_sibling, target
    )
    return accept_index, accept_num


# Candidates 0, 1 under the root; 2, 3 under 0 (expanded at step 1); 4, 5 under 1.
PARENT_LIST = torch.tensor([[-1, 0, 1]])
PARENTS = torch.tensor([[-1, -1, 0, 0, 1, 1]])
SCORES = torch.tensor([[0.6, 0.3, 0.4, 0.1, 0.2, 0.05]])
TOKENS = torch.tensor([[11, 12, 13, 14, 15, 16]])  # the candidates' tokens


def test_copy_rows_mark_the_repeats():
    filled = torch.tensor([[0, 2, 2, 2], [0, 1, 2, 3]])
    assert fixed_width.copy_rows(filled).tolist() == [
        [False, False, False, True, True],
        [False, False, False, False, False],
    ]


def test_copies_are_unlinked_and_verification_is_unchanged():
    selected = torch.tensor([[0, 2, -1, -1]])  # "adaptive" chose two of four slots
    filled = fill_unused_slots(selected, SCORES, PARENTS)  # [[0, 2, 2, 2]]
    copies = fixed_width.copy_rows(filled)
    links = _tree_links(PARENT_LIST, filled)
    # As SGLang builds it, node 2 (candidate 2) has siblings 3 and 4: its copies.
    assert links[2].tolist() == [[-1, -1, 3, 4, -1]]
    fixed_width.unlink_copies(links[2], copies)
    assert links[2].tolist() == [[-1, -1, -1, -1, -1]]
    # Copies sit at their original's depth (same position, same routing).
    assert links[3].tolist() == [5, 6, 7, 7, 7]
    root = torch.tensor([[10]])
    tokens = torch.cat([root, torch.gather(TOKENS, 1, filled)], 1)  # [1, D]
    reference = _tree_links(PARENT_LIST, torch.tensor([[0, 2, 3, 5]]))  # distinct nodes
    for target_tokens in ([11, 13, 99, 99, 99], [11, 99, 99, 99, 99], [12, 0, 0, 0, 0]):
        target = torch.tensor([target_tokens])
        accepted, count = _greedy(tokens, links, target)
        assert (accepted[accepted >= 0] < 3).all()  # a copy (rows 3, 4) is never accepted
        distinct_tokens = torch.cat(
            [root, torch.gather(TOKENS, 1, torch.tensor([[0, 2, 3, 5]]))], 1
        )
        expected, expected_count = _greedy(distinct_tokens, reference, target)
        assert count.tolist() == expected_count.tolist()


def test_a_chain_of_siblings_keeps_its_real_members():
    # Root children 0 and 1 chosen, copies of 1 fill the rest: 0 -> 1 stays, copies go.
    filled = fill_unused_slots(torch.tensor([[0, 1, -1, -1]]), SCORES, PARENTS)
    assert filled.tolist() == [[0, 1, 1, 1]]
    links = _tree_links(PARENT_LIST, filled)
    fixed_width.unlink_copies(links[2], fixed_width.copy_rows(filled))
    assert links[2].tolist() == [[-1, 2, -1, -1, -1]]


def test_copy_check_counts_copies_routed_differently():
    check = fixed_width.CopyCheck("cpu")
    routing = torch.tensor([[[1, 2]], [[3, 4]], [[4, 3]], [[3, 5]]])  # [4 rows, L=1, K=2]
    copies = torch.tensor([False, False, True, True])
    check.update(routing, copies)
    assert check.totals.tolist() == [2, 1]  # row 2 equals row 1 as a set; row 3 does not


def test_hook_unlinks_the_active_selections_copies():
    filled = torch.tensor([[0, 2, 2, 2]])
    selector = SimpleNamespace(copy_rows=fixed_width.copy_rows(filled))
    next_sibling = torch.tensor([[-1, -1, 3, 4, -1]])
    result = (None, None, None, None, next_sibling, None)
    fixed_width.slot.activate(selector)
    try:
        assert fixed_width.unlink_hook(result) is result
    finally:
        fixed_width.slot.deactivate_if(selector)
    assert next_sibling.tolist() == [[-1, -1, -1, -1, -1]]
    untouched = torch.tensor([[-1, -1, 3, 4, -1]])
    fixed_width.unlink_hook((None,) * 4 + (untouched, None))  # no selector: SGLang's tree
    assert untouched.tolist() == [[-1, -1, 3, 4, -1]]
