"""select_verify_set with an EP placement: the busiest-rank cost and its edge cases."""

import pytest
import torch
from _selection import assert_valid_selection, experts, python_greedy, random_tree

from sgl_ecospec import has_native, select_verify_set
from sgl_ecospec.ops.selection import select_verify_set_reference
from sgl_ecospec.placement import expert_rank_map


def test_ep_cost_prefers_the_idle_rank(impl):
    # Two ranks, experts 0-3 on rank 0 and 4-7 on rank 1; the root loads 0 and 1 (rank 0
    # is the busiest with 2). Node 0 (P = 0.5) adds expert 2: the busiest rank rises to 3.
    # Node 1 (P = 0.4) adds experts 4 and 5 on the idle rank: the peak stays 2.
    scores = torch.tensor([[0.5, 0.4]])
    parents = torch.tensor([[-1, -1]])
    node_experts = torch.stack([experts([2]), experts([4, 5])])[None]
    roots = experts([0, 1])[None]
    rank = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    kwargs = dict(root_experts=roots, eps=0.1, impl=impl)
    plain = select_verify_set(scores, parents, node_experts, 1, **kwargs)
    ep = select_verify_set(
        scores, parents, node_experts, 1, expert_rank=rank, total_weight=0.0, **kwargs
    )
    assert plain.tolist() == [[0]]  # 0.5 / 1.1 > 0.4 / 2.1
    assert ep.tolist() == [[1]]  # 0.4 / 0.1 > 0.5 / 1.1
    # The total term: node 1 now costs 0 + tw x 2 = 1 and node 0 costs 1 + tw x 0 = 1,
    # so with tw = 0.5 the higher P wins again.
    half = select_verify_set(
        scores, parents, node_experts, 1, expert_rank=rank, total_weight=0.5, **kwargs
    )
    assert half.tolist() == [[0]]


@pytest.mark.parametrize("total_weight", [None, 0.0, 0.3, 1.0])
@pytest.mark.parametrize("share_buffer", [False, True])
@pytest.mark.parametrize("policy", ["ecospec", "adaptive"])
def test_one_rank_is_plain_ecospec(impl, total_weight, share_buffer, policy):
    # With R = 1 the busiest rank holds every expert: the rise is the new experts and the
    # total term (fresh - rise) is 0, so the cost is the plain one bit for bit.
    gen = torch.Generator().manual_seed(11)
    scores, parents, node_experts, roots = random_tree(gen, 4, 30, 5, 100, 6)
    kwargs = dict(
        root_experts=roots,
        policy=policy,
        share_buffer=share_buffer,
        layer_weights=torch.rand(5, generator=gen),
        step_cost=200.0,
        impl=impl,
    )
    plain = select_verify_set(scores, parents, node_experts, 12, **kwargs)
    one_rank = select_verify_set(
        scores,
        parents,
        node_experts,
        12,
        expert_rank=torch.zeros(5, 100, dtype=torch.long),
        total_weight=total_weight,
        **kwargs,
    )
    assert torch.equal(one_rank, plain)


def test_total_weight_one_ignores_the_placement(impl):
    # tw = 1 prices every fresh expert alike, wherever it lives: plain EcoSpec.
    gen = torch.Generator().manual_seed(12)
    scores, parents, node_experts, roots = random_tree(gen, 3, 40, 4, 256, 8)
    rank = torch.randint(0, 8, (4, 256), generator=gen)
    plain = select_verify_set(scores, parents, node_experts, 10, root_experts=roots, impl=impl)
    ep = select_verify_set(
        scores,
        parents,
        node_experts,
        10,
        root_experts=roots,
        expert_rank=rank,
        total_weight=1.0,
        impl=impl,
    )
    assert torch.equal(ep, plain)


def test_ep_edge_cases(impl):
    gen = torch.Generator().manual_seed(13)
    # E = 65 (not a multiple of 64), more ranks than experts, budget larger than the tree.
    scores, parents, node_experts, roots = random_tree(gen, 2, 6, 3, 65, 4)
    rank = torch.randint(0, 200, (65,), generator=gen)
    out = select_verify_set(
        scores, parents, node_experts, 9, root_experts=roots, expert_rank=rank, impl=impl
    )
    assert_valid_selection(out, parents, 9)
    assert torch.equal(
        out,
        select_verify_set_reference(
            scores, parents, node_experts, 9, root_experts=roots, expert_rank=rank
        ),
    )
    # Empty frontier, and all-zero probabilities (lowest index first).
    empty = select_verify_set(
        torch.zeros(2, 0),
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, 0, 3, 2, dtype=torch.long),
        2,
        expert_rank=torch.zeros(100, dtype=torch.long),
        num_ranks=4,
        impl=impl,
    )
    assert empty.tolist() == [[-1, -1]] * 2
    zeros = select_verify_set(
        torch.zeros(1, 5),
        torch.tensor([[-1, -1, 0, 2, 1]]),
        node_experts[:1, :5],
        3,
        expert_rank=rank,
        impl=impl,
    )
    assert zeros.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("share_buffer", [False, True])
def test_ep_cost_with_many_fresh_experts_per_layer(share_buffer):
    # Nodes that add more than 16 experts on more than 16 ranks in one layer: the native
    # ops' per-rank tally overflows and they count rank by rank instead.
    gen = torch.Generator().manual_seed(17)
    scores, parents, node_experts, roots = random_tree(gen, 3, 25, 3, 200, 48)
    for ranks in (64, 300):
        rank = torch.randint(0, ranks, (3, 200), generator=gen)
        kwargs = dict(
            root_experts=roots, expert_rank=rank, total_weight=0.0, share_buffer=share_buffer
        )
        expected = select_verify_set_reference(scores, parents, node_experts, 10, **kwargs)
        greedy = python_greedy(scores, parents, node_experts, 10, 200, num_ranks=ranks, **kwargs)
        assert expected.tolist() == greedy
        if has_native():
            native = select_verify_set(scores, parents, node_experts, 10, impl="native", **kwargs)
            assert torch.equal(native, expected)


def test_num_ranks_defaults_to_the_highest_rank_plus_one(impl):
    gen = torch.Generator().manual_seed(14)
    scores, parents, node_experts, roots = random_tree(gen, 2, 20, 3, 64, 4)
    rank = torch.randint(0, 4, (3, 64), generator=gen)
    rank[0, 0] = 5
    kwargs = dict(root_experts=roots, expert_rank=rank, impl=impl)
    assert torch.equal(
        select_verify_set(scores, parents, node_experts, 6, **kwargs),
        select_verify_set(
            scores, parents, node_experts, 6, num_ranks=6, total_weight=1 / 6, **kwargs
        ),
    )


def test_expert_rank_map_follows_sglang_layout():
    from sglang.srt.eplb.expert_location import _compute_gpu_id_of_physical_expert

    gen = torch.Generator().manual_seed(15)
    # 128 logical experts plus 32 redundant slots over 8 ranks: 20 slots per rank.
    physical = torch.randint(0, 160, (5, 128), generator=gen)
    ranks = expert_rank_map(physical, 160, 8)
    assert ranks.dtype == torch.int64 and ranks.shape == (5, 128)
    assert ranks.tolist() == [
        [_compute_gpu_id_of_physical_expert(int(p), 20) for p in row] for row in physical
    ]
    with pytest.raises(ValueError, match="multiple of ep_size"):
        expert_rank_map(physical, 161, 8)
    with pytest.raises(ValueError, match=r"slot -1, outside \[0, 160\)"):
        expert_rank_map(torch.tensor([0, -1]), 160, 8)


# --- adaptive budget -------------------------------------------------------------------------
