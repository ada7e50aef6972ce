"""select_verify_set's CUDA kernel, its own source (csrc/selection_cuda.cuh), run on the CPU
under test/ops/cuda_emulator.h and compared with the reference: the kernel's logic (turns,
frontier lists, warp reductions, EP loads, the workspace in shared or global memory) is
tested in every run, not only on a GPU, where test_cuda_ops.py runs the real kernel."""

import pytest
import torch
from _emulated import build, select_emulated
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cuda_ops import global_workspace_case
from test_selection import build_case, ep_cases, tree_cases

from sgl_ecospec.ops.selection_reference import select_verify_set_reference
from sgl_ecospec.synthetic import random_draft_tree

# Shared-memory limits: everything fits, nothing fits (all in global scratch), some fits.
LIMITS = [1 << 30, 0, 200, 3000]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    library = build(tmp_path_factory.mktemp("cuda_emulator"))
    if library is None:
        pytest.skip("no C++ compiler")
    return library


def assert_matches(lib, args, kwargs, shared_limit=1 << 30):
    expected = select_verify_set_reference(*args, **kwargs)
    got, where = select_emulated(lib, *args, shared_limit=shared_limit, **kwargs)
    assert torch.equal(got, expected), (got, expected)
    return where


@settings(max_examples=60, deadline=None)
@given(case=tree_cases, limit=st.sampled_from(LIMITS))
def test_emulated_kernel_matches_reference(lib, case, limit):
    assert_matches(lib, *build_case(case), shared_limit=limit)


@settings(max_examples=25, deadline=None)
@given(case=ep_cases, limit=st.sampled_from(LIMITS))
def test_emulated_kernel_matches_reference_with_ep(lib, case, limit):
    assert_matches(lib, *build_case(case), shared_limit=limit)


def ep_kwargs(layers, experts, ranks, seed, per_layer=True):
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, experts) if per_layer else (experts,)
    return dict(expert_rank=torch.randint(0, ranks, shape, generator=gen), num_ranks=ranks)


# How the buffer is kept: one per request, one for the batch turn by turn, or round_sync.
BUFFER_MODES = {
    "per_request": dict(share_buffer=False),
    "turns": dict(share_buffer=True),
    "rounds": dict(share_buffer=True, round_sync=True),
}


@pytest.mark.parametrize("mode", list(BUFFER_MODES))
@pytest.mark.parametrize(
    "policy, ranks, weighted",
    [
        ("confidence", None, False),
        ("ecospec", None, False),
        ("ecospec", None, True),
        ("ecospec", 8, False),
        ("ecospec", 8, True),
        ("adaptive", 4, False),
    ],
)
@pytest.mark.parametrize(
    "batch, nodes, layers, experts, budget",
    [
        (4, 36, 94, 128, 7),  # Qwen3-235B layers, SGLang's candidate count at topk 4, steps 3
        (3, 36, 58, 256, 7),  # DeepSeek-V3
        (3, 10, 3, 100, 20),  # budget above the tree, E not a multiple of 64
        (0, 8, 4, 64, 4),  # no request
        (2, 0, 3, 64, 3),  # no candidate
        (2, 5, 2, 64, 0),  # budget 0
    ],
)
def test_emulated_kernel_at_serving_shapes_and_edges(
    lib, mode, policy, ranks, weighted, batch, nodes, layers, experts, budget
):
    tree = random_draft_tree(batch, nodes, layers, experts, 8, seed=nodes + layers)
    kwargs = dict(root_experts=tree.root_experts, policy=policy, **BUFFER_MODES[mode])
    if weighted:
        kwargs["layer_weights"] = torch.rand(layers, generator=torch.Generator().manual_seed(1))
    if ranks is not None:
        kwargs.update(ep_kwargs(layers, experts, ranks, seed=ranks))
    if policy == "adaptive":
        kwargs["step_cost"] = 20.0 * layers  # some rows stop early, some do not
    args = (tree.scores, tree.parents, tree.node_experts, budget)
    for limit in LIMITS[:2] if batch and nodes else LIMITS[:1]:
        assert_matches(lib, args, kwargs, shared_limit=limit)


@pytest.mark.parametrize("policy", ["ecospec", "adaptive"])
def test_emulated_kernel_with_wide_frontiers_and_ties(lib, policy):
    # Every candidate a child of the root: frontiers of 50 nodes, more than the block's
    # warps, so warps take several candidates; scores tied in 3 levels, so ties decide.
    tree = random_draft_tree(3, 50, 5, 65, 4, seed=5, tie_levels=3)
    parents = torch.full_like(tree.parents, -1)
    kwargs = dict(root_experts=tree.root_experts, policy=policy, share_buffer=True)
    kwargs.update(ep_kwargs(5, 65, 3, seed=2, per_layer=False))
    if policy == "adaptive":
        kwargs.update(step_cost=30.0)
    args = (tree.scores, parents, tree.node_experts, 12)
    for limit in LIMITS:
        assert_matches(lib, args, kwargs, shared_limit=limit)


@pytest.mark.parametrize(
    "ranks, total_weight", [(1, None), (300, None), (8, 0.0), (8, 1.0), (2000, 0.25)]
)
def test_emulated_kernel_with_extreme_placements(lib, ranks, total_weight):
    # One rank (plain ecospec), more ranks than experts, the busiest rank only, every expert
    # alike; R = 2000 puts the loads ([L, R]) beyond 48 KiB of shared memory.
    tree = random_draft_tree(4, 20, 7, 128, 8, seed=ranks)
    kwargs = dict(root_experts=tree.root_experts, share_buffer=True, total_weight=total_weight)
    kwargs.update(ep_kwargs(7, 128, ranks, seed=ranks))
    args = (tree.scores, tree.parents, tree.node_experts, 6)
    where = assert_matches(lib, args, kwargs, shared_limit=48 * 1024)
    assert where == (3 if ranks == 2000 else 1)


def test_emulated_kernel_ignores_ranks_out_of_range(lib):
    # validate=False lets ranks outside [0, R) through: like the C++ op, the kernel gives
    # such experts no load. With total_weight = 1 the cost counts the fresh experts that
    # have a rank, so the choice is plain ecospec's on bitmaps without those experts.
    tree = random_draft_tree(2, 16, 4, 64, 6, seed=9)
    rank = torch.randint(0, 4, (4, 64), generator=torch.Generator().manual_seed(3))
    rank[:, ::7] = 4  # out of range for R = 4
    args = (tree.scores, tree.parents, tree.node_experts, 5)
    base = dict(root_experts=tree.root_experts, share_buffer=True)
    got, _ = select_emulated(lib, *args, expert_rank=rank, num_ranks=4, total_weight=1.0, **base)
    keep = sum(1 << e for e in range(64) if e % 7)
    keep = torch.tensor(keep - (1 << 64) if keep >= 1 << 63 else keep)  # as int64
    expected = select_verify_set_reference(
        tree.scores,
        tree.parents,
        tree.node_experts & keep,
        5,
        root_experts=tree.root_experts & keep,
        share_buffer=True,
    )
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", ["loads", "candidates"])
@pytest.mark.parametrize("share_buffer", [False, True])
def test_emulated_kernel_with_an_h200s_shared_memory(lib, case, share_buffer):
    # test_cuda_ops.py's global-memory cases under the H200's 227 KiB per block: what does
    # not fit goes to global scratch, the rest stays in shared memory.
    args, kwargs = global_workspace_case(case)
    kwargs.update(policy="adaptive", share_buffer=share_buffer, step_cost=200.0)
    if kwargs["total_weight"] is None:
        del kwargs["total_weight"]
    where = assert_matches(lib, args, kwargs, shared_limit=227 * 1024 - 400)
    assert where == (3 if case == "loads" or share_buffer else 1)


@pytest.mark.parametrize("max_blocks", [1, 2, 3, 64])
@pytest.mark.parametrize("policy, ranks", [("ecospec", None), ("ecospec", 4), ("adaptive", 3)])
def test_emulated_round_sync_grid(lib, max_blocks, policy, ranks):
    # A cooperative grid of at most max_blocks blocks: one request each, or several (the last
    # block holding fewer), every block merging all the round's picks into its own copy of
    # the buffer and account; in shared memory and in global scratch.
    tree = random_draft_tree(5, 24, 6, 96, 6, seed=2)
    kwargs = dict(root_experts=tree.root_experts, policy=policy, share_buffer=True)
    kwargs.update(round_sync=True, candidate_cost=1.5, candidate_decay=0.5)
    if ranks is not None:
        kwargs.update(ep_kwargs(6, 96, ranks, seed=ranks))
    if policy == "adaptive":
        kwargs["step_cost"] = 40.0
    args = (tree.scores, tree.parents, tree.node_experts, 7)
    expected = select_verify_set_reference(*args, **kwargs)
    turn_by_turn = select_verify_set_reference(*args, **{**kwargs, "round_sync": False})
    assert not torch.equal(expected, turn_by_turn)  # the rounds see fewer picks: other sets
    for limit in LIMITS[:2]:
        got, where = select_emulated(
            lib, *args, shared_limit=limit, max_blocks=max_blocks, **kwargs
        )
        assert torch.equal(got, expected), (got, expected)
        assert where == (1 if limit else 2)
