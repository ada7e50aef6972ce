"""The Triton verify-MoE kernel against its PyTorch reference. Without a GPU the kernel
runs under Triton's interpreter, which must be switched on before triton is imported, so
those checks run in a fresh interpreter."""

import subprocess
import sys
import textwrap

import pytest
import torch

from sgl_ecospec.ops.verify_moe import verify_moe, verify_moe_reference

CASES = [
    # tokens, hidden, inter, experts, top_k, dtype, shared (all tokens on the same experts)
    (1, 64, 32, 64, 4, "float32", False),
    (5, 64, 32, 70, 4, "float32", False),  # E not a multiple of 64
    (20, 32, 16, 130, 8, "float32", True),  # 20 tokens per expert > BLOCK_M = 16
    (3, 48, 40, 16, 1, "float16", False),  # sizes that are not multiples of the blocks
]


def make_inputs(tokens, hidden, inter, experts, top_k, dtype, shared, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    if shared:
        ids = torch.randperm(experts, generator=gen)[:top_k].repeat(tokens, 1)
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return x, w13, w2, ids, weights


def test_reference_matches_dense_computation():
    x, w13, w2, ids, weights = make_inputs(4, 16, 8, 10, 3, "float32", False)
    out, step = verify_moe_reference(x, w13, w2, ids, weights)
    expected = torch.zeros_like(x)
    for t in range(4):
        for k in range(3):
            e = int(ids[t, k])
            gate, up = (w13[e] @ x[t]).split(8)
            expected[t] += weights[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected)
    assert sorted({int(i) for i in ids.flatten()}) == [
        e for e in range(10) if (int(step[0]) >> e) & 1
    ]


def test_bad_shapes_are_rejected():
    x, w13, w2, ids, weights = make_inputs(2, 16, 8, 4, 2, "float32", False)
    with pytest.raises(ValueError, match=r"w2 must have shape \(4, 16, 8\)"):
        verify_moe(x, w13, w2[:, :, :4], ids, weights)
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        verify_moe(x, w13, w2, ids, weights[:, :1])
    with pytest.raises(TypeError, match="w13 must have dtype"):
        verify_moe(x, w13.half(), w2, ids, weights)


def test_triton_kernel_matches_reference_under_interpreter():
    script = textwrap.dedent(
        f"""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import sys
        sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        import torch
        from test_verify_moe import CASES, make_inputs
        from sgl_ecospec.ops.verify_moe import verify_moe, verify_moe_reference

        for case in CASES:
            inputs = make_inputs(*case)
            out, step = verify_moe(*inputs, impl="triton")
            ref, ref_step = verify_moe_reference(*inputs)
            tol = 1e-5 if case[5] == "float32" else 2e-2
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
            assert torch.equal(step, ref_step), (case, step, ref_step)
        print("ok", len(CASES))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", str(len(CASES))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_on_gpu_matches_reference(case):
    inputs = [t.cuda() for t in make_inputs(*case)]
    out, step = verify_moe(*inputs, impl="triton")
    ref, ref_step = verify_moe_reference(*inputs)
    tol = 1e-3 if case[5] == "float32" else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(step, ref_step)
