"""Stage "correctness" of the device check: every GPU op against the C++ CPU op (equal to
the PyTorch reference in every CI run, and fast at any shape), each GPU call run twice and
required to be bitwise equal (determinism); the reference itself only at small shapes.

- bitmaps: ``topk_to_bitmap`` and ``bitmap_popcount`` for E around the word boundaries;
- selection: the shapes of test/ops/test_cuda_ops.py (every policy, shared buffer or not, EP
  with 1-300 ranks, ties, empty trees), SGLang-shaped trees at B = 128, and workspaces too
  large for shared memory;
- ``verify_moe``: the cases of test/ops/test_verify_moe.py in fp32, fp16 and bf16 against its
  reference, T = 0, padded rows;
- CUDA graphs (graph_check.py): each op and the selection step captured once, replayed on new
  inputs written in place.

A dry run checks the CUDA selection kernel's own source under the CPU emulation, and the
Triton kernel under the interpreter (fp32 and fp16: the interpreter cannot multiply bf16).
Writes correctness.json row by row.
"""

import common
import graph_check
import torch
from selection_cases import (
    BUFFERS,
    CONFIGS,
    SHAPES,
    KernelUnderTest,
    buffer_kwargs,
    cpu_op,
    selection_kwargs,
    sglang_tree,
)

from sgl_ecospec import bitmap_popcount, topk_to_bitmap
from sgl_ecospec.ops.selection_reference import select_verify_set_reference
from sgl_ecospec.ops.verify_moe import verify_moe, verify_moe_reference
from sgl_ecospec.synthetic import random_draft_tree

# (batch, nodes, layers, experts, budget, tie_levels, weighted), as test_cuda_ops.py.
GPU_SHAPES = [
    (1, 64, 94, 128, 16, 0, False),
    (16, 36, 94, 128, 7, 0, False),
    (64, 64, 58, 256, 16, 0, True),
    (0, 8, 94, 128, 4, 0, False),
    (5, 10, 3, 65, 20, 3, False),
    (3, 0, 2, 64, 4, 0, False),
    (4, 33, 2, 100, 8, 2, True),
]
DRY_SHAPES = [(3, 10, 3, 65, 6, 3, False), (0, 8, 4, 64, 4, 0, False), (4, 9, 2, 100, 5, 2, True)]
# (policy, EP ranks or None)
POLICIES = [
    ("confidence", None),
    ("ecospec", None),
    ("ecospec", 8),
    ("ecospec", 1),
    ("ecospec", 300),
    ("adaptive", None),
    ("adaptive", 4),
]
REFERENCE_LIMIT = 20_000  # B x N x L at most: the Python reference's shapes
# (tokens, hidden, inter, experts, top_k, shared experts, padded rows), as test_verify_moe.py.
MOE_CASES = [
    (1, 64, 32, 64, 4, False, 0),
    (5, 64, 32, 70, 4, False, 0),
    (20, 32, 16, 130, 8, True, 0),
    (70, 32, 16, 16, 2, True, 0),
    (3, 48, 40, 16, 1, False, 0),
    (6, 64, 32, 70, 4, False, 2),
    (2, 32, 16, 16, 2, False, 2),
    (0, 32, 16, 70, 4, False, 0),
    (64, 1024, 512, 128, 8, False, 0),
]
MOE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def twice(fn):
    """(first result on the CPU, whether a second call gave the same bits)."""
    first, second = fn(), fn()
    if isinstance(first, tuple):
        same = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        return tuple(a.cpu() for a in first), same
    return first.cpu(), torch.equal(first, second)


def check_bitmaps(record, device, dry_run):
    for experts in [1, 63, 64, 65, 128, 256, 300]:
        gen = torch.Generator().manual_seed(experts)
        ids = torch.randint(0, experts, (7, 5, 8), generator=gen)
        expected = topk_to_bitmap(ids, experts, impl="native")
        got, deterministic = twice(lambda i=ids, e=experts: topk_to_bitmap(i.to(device), e))
        counts = bitmap_popcount(got.to(device)).cpu()
        ok = deterministic and torch.equal(got, expected)
        ok &= torch.equal(counts, bitmap_popcount(expected, impl="reference"))
        record.add(dict(check="bitmaps", experts=experts, ok=ok), ok=ok)


def selection_inputs(shape, policy, ranks, share_buffer):
    batch, nodes, layers, experts, budget, ties, weighted = shape
    tree = random_draft_tree(batch, nodes, layers, experts, 8, seed=nodes, tie_levels=ties)
    kwargs = dict(root_experts=tree.root_experts, policy=policy, **buffer_kwargs(share_buffer))
    if weighted:
        kwargs["layer_weights"] = torch.rand(layers, generator=torch.Generator().manual_seed(1))
    if ranks is not None:
        gen = torch.Generator().manual_seed(ranks)
        kwargs["expert_rank"] = torch.randint(0, ranks, (layers, experts), generator=gen)
        kwargs["num_ranks"] = ranks
    if policy == "adaptive":
        kwargs["step_cost"] = 20.0 * layers  # some rows stop early, some do not
    return (tree.scores, tree.parents, tree.node_experts, budget), kwargs


def workspace_cases():
    """Workspaces beyond a block's shared memory (227 KiB on an H200): loads [L, R] of 3000
    ranks, or the parents and flags of 64 x 400 candidates (as test_cuda_ops.py)."""
    tree = random_draft_tree(4, 12, 20, 64, 4, seed=1)
    rank = torch.randint(0, 3000, (20, 64), generator=torch.Generator().manual_seed(5))
    ep = dict(expert_rank=rank, num_ranks=3000, total_weight=0.3)
    yield "loads", (tree.scores, tree.parents, tree.node_experts, 5), tree.root_experts, ep
    tree = random_draft_tree(64, 400, 2, 64, 4, seed=2)
    yield "candidates", (tree.scores, tree.parents, tree.node_experts, 5), tree.root_experts, {}


def compare_selection(record, kernel, label, args, kwargs):
    got, deterministic = twice(lambda: kernel(*args, **kwargs))
    expected = cpu_op(*args, **kwargs)
    ok = deterministic and torch.equal(got, expected)
    batch, nodes, layers = args[2].shape[:3]
    reference = None
    if batch * nodes * layers <= REFERENCE_LIMIT:
        reference = bool(torch.equal(select_verify_set_reference(*args, **kwargs), expected))
        ok &= reference
    row = dict(check="selection", case=label, shape=list(args[2].shape), budget=args[3])
    row.update(deterministic=deterministic, equals_cpu_op=ok, equals_reference=reference)
    record.add(row, ok=ok)


def check_selection(record, device, dry_run):
    kernel = KernelUnderTest(device)
    for shape in DRY_SHAPES if dry_run else GPU_SHAPES:
        for policy, ranks in POLICIES:
            for share_buffer in BUFFERS:
                args, kwargs = selection_inputs(shape, policy, ranks, share_buffer)
                label = f"{policy} ranks={ranks} shared={share_buffer}"
                compare_selection(record, kernel, label, args, kwargs)
    batch, (topk, steps, budget) = (3, (2, 2, 3)) if dry_run else (128, (4, 3, 7))
    for model, (layers, experts) in SHAPES.items():
        if dry_run:
            layers = 4
        tree = sglang_tree(batch, topk, steps, layers, experts, 8, seed=3)
        for policy, shared, ep in CONFIGS:
            kwargs = selection_kwargs(policy, shared, ep, layers, experts)
            kwargs["root_experts"] = tree.root_experts
            args = (tree.scores, tree.parents, tree.node_experts, budget)
            compare_selection(record, kernel, f"{model} B={batch} {policy} shared={shared} "
                              f"ep={ep}", args, kwargs)  # fmt: skip
    for case, args, roots, ep in workspace_cases():
        if dry_run and case == "candidates":
            continue  # 64 x 400 candidates: minutes under the emulation
        for policy in ("ecospec", "adaptive"):
            for shared in BUFFERS:
                kwargs = dict(root_experts=roots, policy=policy, **buffer_kwargs(shared), **ep)
                kwargs["step_cost"] = 200.0
                compare_selection(record, kernel, f"workspace {case} {policy} shared={shared}",
                                  args, kwargs)  # fmt: skip


def moe_inputs(case, dtype: torch.dtype, device):
    """test_verify_moe.py's inputs for ``case`` on ``device`` (padded rows: ids -1, NaN
    hidden rows and weights, which the kernel must never read)."""
    common.use_test_helpers()
    from test_verify_moe import make_inputs

    tokens, hidden, inter, experts, top_k, shared, padded = case
    dtype_name = str(dtype).removeprefix("torch.")
    inputs = make_inputs(tokens, hidden, inter, experts, top_k, dtype_name, shared, padded)
    return [t.to(device) for t in inputs]


def check_verify_moe(record, device, dry_run):
    # fp16 goes through the same 16-bit path as bf16, which the interpreter cannot run.
    dtypes = [torch.float32, torch.float16] if dry_run else [torch.float32, torch.bfloat16]
    for case in MOE_CASES[:-1] if dry_run else MOE_CASES:
        for dtype in dtypes:
            inputs = moe_inputs(case, dtype, device)
            (out, step), deterministic = twice(lambda i=inputs: verify_moe(*i, impl="triton"))
            ref, ref_step = verify_moe_reference(*inputs)
            error = 0.0
            if out.numel():
                scale = max(float(ref.float().abs().max()), 1e-30)
                error = float((out.float() - ref.cpu().float()).abs().max()) / scale
            ok = deterministic and torch.equal(step, ref_step.cpu()) and out.shape == ref.shape
            ok &= error <= MOE_TOLERANCE[dtype]
            padded = case[-1]
            if padded:
                ok &= bool((out[-padded:] == 0).all())
            row = dict(check="verify_moe", case=list(case), dtype=str(dtype), rel_error=error)
            row.update(deterministic=deterministic, ok=ok)
            record.add(row, ok=ok)


def main(argv=None) -> int:
    args = common.parse_args(__doc__.splitlines()[0], argv)
    device = common.stage_device(args.dry_run)
    record = common.StageRecord(args.out, "correctness", args.dry_run)
    for name, check in [
        ("bitmaps", check_bitmaps),
        ("selection", check_selection),
        ("verify_moe", check_verify_moe),
    ]:
        before = len(record.data["failures"])
        check(record, device, args.dry_run)
        rows = sum(r["check"] == name for r in record.data["rows"])
        print(f"{name}: {rows} checks, {len(record.data['failures']) - before} failed", flush=True)
    graphs = graph_check.run_checks(device, tiny=args.dry_run)
    for row in graphs:
        ok = row["ok"] and row["inputs_changed_output"]
        record.add(dict(row, check="graph", case=row["check"]), ok=ok)
    return record.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
