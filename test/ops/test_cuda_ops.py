"""The CUDA ops: built wherever a CUDA toolkit is present (CI compiles them), checked
against the reference wherever a GPU is present (scripts/gpu_check.sh on the device). The
selection kernel's logic is also checked without a GPU, on the CPU emulation of
test_cuda_emulated.py."""

import os
import shutil

import pytest
import torch
from _util import requires_native

from sgl_ecospec import bitmap_popcount, select_verify_set, topk_to_bitmap
from sgl_ecospec.ops.bitmaps import bitmap_popcount_reference, topk_to_bitmap_reference
from sgl_ecospec.ops.native import has_native_kernel
from sgl_ecospec.ops.selection import select_verify_set_reference
from sgl_ecospec.synthetic import random_draft_tree

CUDA = torch.device("cuda")
requires_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and has_native_kernel("select_verify_set", CUDA)),
    reason="needs a GPU and the CUDA build of sgl_ecospec._C",
)


def _toolkit_present() -> bool:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return torch.version.cuda is not None and (
        os.path.exists(os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc") is not None
    )


@requires_native
@pytest.mark.skipif(not _toolkit_present(), reason="no CUDA toolkit: CPU-only build")
@pytest.mark.skipif(os.environ.get("SGL_ECOSPEC_CUDA") == "0", reason="CUDA build disabled")
def test_cuda_kernels_are_compiled_and_registered():
    for op in ("topk_to_bitmap", "bitmap_popcount", "select_verify_set"):
        assert has_native_kernel(op, CUDA), f"{op} has no CUDA kernel in this build"


@requires_gpu
@pytest.mark.parametrize("num_experts", [1, 63, 64, 65, 128, 256, 300])
def test_bitmaps_on_gpu_match_reference(num_experts):
    gen = torch.Generator().manual_seed(num_experts)
    ids = torch.randint(0, num_experts, (7, 5, 8), generator=gen)
    expected = topk_to_bitmap_reference(ids, num_experts)
    got = topk_to_bitmap(ids.to(CUDA), num_experts, impl="native")
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(
        bitmap_popcount(got, impl="native").cpu(), bitmap_popcount_reference(expected)
    )


@requires_gpu
@pytest.mark.parametrize("share_buffer", [False, True])
@pytest.mark.parametrize(
    "policy, ranks",
    [
        ("confidence", None),
        ("ecospec", None),
        ("ecospec", 8),  # expert parallelism, a map per layer
        ("ecospec", 1),  # one rank: plain EcoSpec's choice
        ("ecospec", 300),  # more ranks than experts
        ("adaptive", None),
        ("adaptive", 4),
    ],
)
@pytest.mark.parametrize(
    "batch, nodes, layers, experts, budget, tie_levels, weighted",
    [
        (1, 64, 94, 128, 16, 0, False),
        (16, 36, 94, 128, 7, 0, False),  # Qwen3-235B, SGLang's topk 4 / 3 steps, ndt 8
        (64, 64, 58, 256, 16, 0, True),
        (0, 8, 94, 128, 4, 0, False),  # no request
        (5, 10, 3, 65, 20, 3, False),  # budget larger than the tree, ties
        (3, 0, 2, 64, 4, 0, False),  # empty tree
        (4, 33, 2, 100, 8, 2, True),  # all-tied scores, E not a multiple of 64
    ],
)
def test_selection_on_gpu_matches_reference(
    share_buffer, policy, ranks, batch, nodes, layers, experts, budget, tie_levels, weighted
):
    tree = random_draft_tree(batch, nodes, layers, experts, 8, seed=nodes, tie_levels=tie_levels)
    weights = torch.rand(layers) if weighted else None
    kwargs = dict(
        root_experts=tree.root_experts,
        policy=policy,
        share_buffer=share_buffer,
        layer_weights=weights,
    )
    if ranks is not None:
        gen = torch.Generator().manual_seed(ranks)
        kwargs["expert_rank"] = torch.randint(0, ranks, (layers, experts), generator=gen)
        kwargs["num_ranks"] = ranks
    if policy == "adaptive":
        # About the cost of a step at these sizes: some rows stop early, some do not.
        kwargs["step_cost"] = 20.0 * layers
    args = (tree.scores, tree.parents, tree.node_experts, budget)
    expected = select_verify_set_reference(*args, **kwargs)
    on_gpu = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    got = select_verify_set(*(a.to(CUDA) for a in args[:3]), budget, impl="native", **on_gpu)
    assert torch.equal(got.cpu(), expected)


def global_workspace_case(case: str):
    """Inputs whose workspace exceeds a block's shared memory (227 KiB on an H200): the
    loads [L, R] of 3000 ranks, or the parents and flags of 64 x 400 candidates."""
    if case == "loads":
        tree = random_draft_tree(4, 12, 20, 64, 4, seed=1)
        gen = torch.Generator().manual_seed(5)
        rank = dict(expert_rank=torch.randint(0, 3000, (20, 64), generator=gen), num_ranks=3000)
    else:
        tree, rank = random_draft_tree(64, 400, 2, 64, 4, seed=2), {}
    kwargs = dict(root_experts=tree.root_experts, total_weight=0.3 if rank else None, **rank)
    return (tree.scores, tree.parents, tree.node_experts, 5), kwargs


@requires_gpu
@pytest.mark.parametrize("case", ["loads", "candidates"])
@pytest.mark.parametrize("share_buffer", [False, True])
@pytest.mark.parametrize("policy", ["ecospec", "adaptive"])
def test_selection_on_gpu_with_workspace_in_global_memory(case, share_buffer, policy):
    # The kernel keeps what does not fit in shared memory in its global scratch.
    args, kwargs = global_workspace_case(case)
    kwargs.update(policy=policy, share_buffer=share_buffer, step_cost=200.0)
    if kwargs["total_weight"] is None:
        del kwargs["total_weight"]
    expected = select_verify_set_reference(*args, **kwargs)
    on_gpu = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    got = select_verify_set(*(a.to(CUDA) for a in args[:3]), args[3], impl="native", **on_gpu)
    assert torch.equal(got.cpu(), expected)
