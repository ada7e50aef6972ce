"""The tiny driver run under compute-sanitizer by the device check's stage "sanitizer": each
CUDA and Triton kernel of the project once or twice at small shapes (every selection policy,
the shared buffer, EP, a workspace in global memory, the bitmap ops, verify_moe in bf16 and
fp32 with padded rows), results checked against the C++ CPU op and the reference so that a
kernel the sanitizer slows down is also seen to still compute the right thing. On the CPU (a
dry run) the same calls run through the CPU ops and the interpreter."""

import sys

import torch
from selection_cases import on_device

from sgl_ecospec import bitmap_popcount, select_verify_set, topk_to_bitmap
from sgl_ecospec.ops.verify_moe import verify_moe, verify_moe_reference
from sgl_ecospec.synthetic import random_draft_tree


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    failures = []
    ids = torch.randint(0, 130, (3, 4, 8), generator=torch.Generator().manual_seed(0))
    bitmaps = topk_to_bitmap(ids.to(device), 130)
    if not torch.equal(bitmap_popcount(bitmaps).cpu(), bitmap_popcount(topk_to_bitmap(ids, 130))):
        failures.append("bitmaps")
    tree = random_draft_tree(3, 12, 5, 130, 4, seed=1)
    rank = torch.randint(0, 4, (5, 130), generator=torch.Generator().manual_seed(2))
    big_rank = torch.randint(0, 3000, (5, 130), generator=torch.Generator().manual_seed(3))
    configs = [dict(policy="confidence")] + [
        dict(policy=policy, share_buffer=shared is not False, round_sync=shared == "rounds", **ep)
        for policy in ("ecospec", "adaptive")
        for shared in (False, True, "rounds")
        for ep in ({}, dict(expert_rank=rank, num_ranks=4), dict(expert_rank=big_rank,
                                                                 num_ranks=3000))
    ]  # fmt: skip
    args = (tree.scores, tree.parents, tree.node_experts)
    for kwargs in configs:
        kwargs = dict(kwargs, root_experts=tree.root_experts, step_cost=100.0)
        expected = select_verify_set(*args, 4, impl="native", **kwargs)
        got = select_verify_set(*(a.to(device) for a in args), 4, **on_device(kwargs, device))
        if not torch.equal(got.cpu(), expected):
            failures.append(f"selection {kwargs['policy']}")
    for dtype in (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32,):
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(6, 64, generator=gen).to(dtype).to(device)
        w13 = (torch.randn(70, 64, 64, generator=gen) / 8).to(dtype).to(device)
        w2 = (torch.randn(70, 64, 32, generator=gen) / 6).to(dtype).to(device)
        topk = torch.stack([torch.randperm(70, generator=gen)[:4] for _ in range(6)])
        topk[4:] = -1
        weights = torch.rand(6, 4, generator=gen).to(device)
        out, step = verify_moe(x, w13, w2, topk.to(device), weights, impl="triton")
        ref, ref_step = verify_moe_reference(x, w13, w2, topk.to(device), weights)
        error = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        if error > 2e-2 or not torch.equal(step, ref_step):
            failures.append(f"verify_moe {dtype}: error {error:.1e}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"driver: {len(configs)} selections, bitmaps, verify_moe; failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
