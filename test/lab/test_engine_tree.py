"""The offline engine's building blocks: SGLang's draft tree, verify tree, accept, KV cache."""

import pytest
import torch

from sgl_ecospec import select_verify_set
from sgl_ecospec.lab.engine.tree import (
    DraftTree,
    accepted_within,
    build_verify_tree,
    greedy_accept,
    grow_tree,
    num_candidates,
)
from sgl_ecospec.models.kvcache import BatchKVCache

# --- the tree is SGLang's -----------------------------------------------------------------


def beam_states(batch, topk, step):
    """``[B, k, 1]`` draft states of a step's beams, each its flat row id + 100 * step."""
    return (torch.arange(batch * topk).float() + 100 * step).view(batch, topk, 1)


def random_expand(batch, topk, steps, seed):
    """Draft stand-in: per step, random descending probabilities and token ids for each
    beam's children, and as each beam's draft state its flat row id plus 100 * step;
    records the beams it is asked to expand."""
    gen = torch.Generator().manual_seed(seed)
    draws = [
        (
            torch.rand(batch, topk, topk, generator=gen).sort(-1, descending=True).values,
            torch.randint(0, 1000, (batch, topk, topk), generator=gen),
        )
        for _ in range(steps)
    ]
    calls = []

    def expand(step, beam_tokens, parent_beam):
        calls.append((beam_tokens.clone(), parent_beam.clone()))
        return *draws[step], beam_states(batch, topk, step)

    return draws, calls, expand


@pytest.mark.parametrize(
    "batch, topk, steps, num_draft", [(1, 4, 3, 5), (3, 2, 4, 6), (2, 8, 3, 16), (2, 3, 1, 3)]
)
def test_tree_equals_sglang_select_top_k_tokens(batch, topk, steps, num_draft):
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    gen = torch.Generator().manual_seed(batch * 10 + topk)
    root_p = torch.rand(batch, topk, generator=gen).sort(-1, descending=True).values
    root_ids = torch.randint(0, 1000, (batch, topk), generator=gen)
    draws, calls, expand = random_expand(batch, topk, steps, seed=topk)
    root_hidden = -1.0 - torch.arange(batch).float()[:, None]
    tree = grow_tree(root_p, root_ids, root_hidden, expand, steps)

    lists = ([], [], [])
    topk_p, topk_index, scores = root_p, root_ids, None
    hidden = root_hidden
    proposers = []  # [B, candidates of the step, 1]: the state each candidate came from
    with torch.compiler.set_stance("force_eager"):
        for i in range(steps):
            per_request = hidden.view(batch, -1, 1)  # [B, 1 or k, 1]
            proposers.append(per_request.repeat_interleave(topk, 1))
            input_ids, hidden, scores, info = select_top_k_tokens(
                i, topk_p, topk_index, hidden, scores, topk
            )
            for store, item in zip(lists, info, strict=True):
                store.append(item)
            if i == steps - 1:
                break
            beam_tokens, parent_beam = calls[i]
            assert torch.equal(input_ids, beam_tokens.flatten())
            if i > 0:  # which previous beam's draft output each beam reads
                offsets = torch.arange(batch)[:, None] * topk
                rows = hidden.flatten().long() - 100 * (i - 1)
                assert torch.equal(rows, (parent_beam + offsets).flatten())
            # The draft "runs" on the beams (states from beam_states).
            topk_p, topk_index = draws[i][0].flatten(0, 1), draws[i][1].flatten(0, 1)
            hidden = beam_states(batch, topk, i).flatten(0, 1)
    assert len(calls) == steps - 1
    assert tree.scores.shape == (batch, num_candidates(topk, steps))
    assert torch.equal(tree.scores, torch.cat(lists[0], 1).flatten(1))
    assert torch.equal(tree.tokens, torch.cat(lists[1], 1))
    assert torch.equal(tree.hidden, torch.cat(proposers, 1))

    parent_list, top_index, draft_tokens = organize_draft_results(*lists, num_draft)
    if steps > 1:
        # SGLang's candidate x hangs under parent_list[x // topk] (-1 = the root).
        slots = torch.arange(tree.scores.shape[1]).expand(batch, -1) // topk
        assert torch.equal(tree.parents, parent_list.gather(1, slots))
    else:
        assert (tree.parents == -1).all()
    node_experts = torch.zeros((*tree.scores.shape, 1, 1), dtype=torch.long)
    selected = select_verify_set(
        tree.scores, tree.parents, node_experts, num_draft - 1, policy="confidence"
    )
    assert torch.equal(selected, top_index)
    assert torch.equal(tree.tokens.gather(1, selected), draft_tokens)


# --- building blocks ----------------------------------------------------------------------


def test_verify_tree_and_greedy_accept():
    # Candidates: 0, 1 under the root; 2 under 0; 3 under 2; 4 under 1.
    tree = DraftTree(
        scores=torch.tensor([[0.6, 0.3, 0.5, 0.4, 0.2]]),
        tokens=torch.tensor([[10, 11, 12, 13, 14]]),
        parents=torch.tensor([[-1, -1, 0, 2, 1]]),
        hidden=torch.zeros(1, 5, 2),
    )
    verify = build_verify_tree(torch.tensor([9]), tree, torch.tensor([[0, 1, 2, 3, -1]]))
    assert verify.tokens[:, :5].tolist() == [[9, 10, 11, 12, 13]]  # the padding row is arbitrary
    assert verify.parent.tolist() == [[-1, 0, 0, 1, 3, -1]]
    assert verify.depth.tolist() == [[0, 1, 1, 2, 3, 0]]
    assert verify.valid.tolist() == [[True] * 5 + [False]]
    expected_mask = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert verify.mask.int().tolist() == [expected_mask]
    # The target agrees with 10 then 12 but wants 77 after 12: accept rows 0, 1, 3.
    predictions = torch.tensor([[10, 12, 5, 77, 6, 10]])
    assert greedy_accept(verify, predictions).tolist() == [[0, 1, 3]]
    # Disagreeing at the root accepts nothing.
    assert greedy_accept(verify, torch.tensor([[55, 0, 0, 0, 0, 0]])).tolist() == [[0]]


@pytest.mark.parametrize("seed", range(6))
def test_acceptance_of_a_subset_read_from_the_whole_tree(seed):
    """What a selection would accept, read from one pass over the whole tree, equals greedy
    acceptance over that selection's own verify tree (same argmax at each node)."""
    gen = torch.Generator().manual_seed(seed)
    batch, n, vocab = 3, 12, 3  # a small vocabulary: the argmax often matches a child
    parents = torch.stack(
        [torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)])] * batch
    )
    tree = DraftTree(
        scores=torch.rand(batch, n, generator=gen),
        tokens=torch.randint(0, vocab, (batch, n), generator=gen),
        parents=parents,
        hidden=torch.zeros(batch, n, 1),
    )
    roots = torch.randint(0, vocab, (batch,), generator=gen)
    whole = build_verify_tree(roots, tree, torch.arange(n).expand(batch, -1))
    predictions = torch.randint(0, vocab, (batch, n + 1), generator=gen)
    deepest = accepted_within(whole, predictions, torch.arange(n).expand(batch, -1))
    for budget in (0, 2, 5, n):
        scores = torch.rand(batch, n, generator=gen)
        selected = select_verify_set(
            scores,
            tree.parents,
            torch.zeros(batch, n, 1, 1, dtype=torch.int64),
            budget,
            policy="confidence",
        )
        sub = build_verify_tree(roots, tree, selected)
        rows = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), selected + 1], 1)
        sub_predictions = predictions.gather(1, rows.clamp_min(0))
        want = (greedy_accept(sub, sub_predictions) >= 0).sum(1) - 1
        assert torch.equal(accepted_within(whole, predictions, selected), want), budget
        assert bool((want <= deepest).all())  # a subset never accepts more than the tree


def test_kv_cache_commit_and_select():
    cache = BatchKVCache(2, 3)
    # Committed: request lengths 2, 4, 1 over width 4 (values = column id + 10 * request).
    base = torch.arange(4).float() + 10 * torch.arange(3)[:, None]
    for layer in range(2):
        cache.update(
            base[:, None, :, None].expand(3, 2, 4, 5).clone(),
            base[:, None, :, None].expand(3, 2, 4, 5).clone(),
            layer,
        )
    cache.commit(torch.tensor([[0, 1, -1, -1], [0, 1, 2, 3], [0, -1, -1, -1]]))
    cache.commit(torch.empty(3, 0, dtype=torch.int64))  # nothing pending: a no-op
    assert cache.lengths.tolist() == [2, 4, 1]
    new = 100 + torch.arange(3).float()[None].expand(3, 3) + 10 * torch.arange(3)[:, None]
    for layer in range(2):
        cache.update(
            new[:, None, :, None].expand(3, 2, 3, 5),
            new[:, None, :, None].expand(3, 2, 3, 5),
            layer,
        )
    assert cache.pending == 3
    mask = cache.attention_mask(torch.ones(3, 3, 3, dtype=torch.bool))
    assert mask[:, 0, :4].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    cache.commit(torch.tensor([[0, 2], [1, -1], [-1, -1]]))
    assert cache.lengths.tolist() == [4, 5, 1] and cache.width == 5
    keys = cache.keys[1][:, 0, :, 0]
    assert keys[0, :4].tolist() == [0, 1, 100, 102]
    assert keys[1, :5].tolist() == [10, 11, 12, 13, 111]
    assert keys[2, :1].tolist() == [20]
    cache.select(torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [1, 4] and cache.width == 4
    assert cache.values[0][:, 0, :, 0][1].tolist() == [0, 1, 100, 102]
