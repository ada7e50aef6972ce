"""The Triton verify-MoE kernel against its PyTorch reference, padded rows and the
persistent bitmap buffer included, and the graph safety of its host side. Without a GPU the
kernel runs under Triton's interpreter, which must be switched on before triton is imported,
so those checks run in a fresh interpreter (``compare_with_triton``)."""

import pytest
import torch
from _util import compared_under_interpreter, host_syncs
from torch.fx.experimental.proxy_tensor import make_fx

from sgl_ecospec.ops.bitmaps import num_words
from sgl_ecospec.ops.verify_moe import (
    BLOCK_M_MAX,
    _group_by_expert,
    pairs_per_program,
    triton,
    verify_moe,
    verify_moe_reference,
)

if triton is not None:
    import triton.language as tl

    from sgl_ecospec.ops.verify_moe import expert_tile_offsets

CASES = [
    # tokens, hidden, inter, experts, top_k, dtype, shared (all tokens on the same experts),
    # padded rows at the end (expert id -1, as SGLang pads a graph batch)
    (1, 64, 32, 64, 4, "float32", False, 0),
    (5, 64, 32, 70, 4, "float32", False, 0),  # E not a multiple of 64
    (20, 32, 16, 130, 8, "float32", True, 0),  # 20 tokens per expert: BLOCK_M = 32
    (70, 32, 16, 16, 2, "float32", True, 0),  # 70 pairs per expert > BLOCK_M_MAX: two passes
    (3, 48, 40, 16, 1, "float16", False, 0),  # sizes that are not multiples of the blocks
    (6, 64, 32, 70, 4, "float32", False, 2),  # a graph batch with 2 padded rows
    (4, 32, 16, 130, 2, "float16", True, 1),
    (2, 32, 16, 16, 2, "float32", False, 2),  # only padding: nothing loaded
]


def make_inputs(tokens, hidden, inter, experts, top_k, dtype, shared, padded, seed=0):
    """(hidden, w13, w2, topk_ids, topk_weights). Padded rows: ids -1, NaN hidden rows and
    weights (never read), and one more pair padded in the last real row."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    if shared or not tokens:
        ids = torch.randperm(experts, generator=gen)[:top_k].repeat(tokens, 1)
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    if padded:
        real = tokens - padded
        ids[real:], x[real:], weights[real:] = -1, float("nan"), float("nan")
        if real and top_k > 1:
            ids[real - 1, -1] = -1
    return x, w13, w2, ids, weights


def test_reference_matches_dense_computation():
    x, w13, w2, ids, weights = make_inputs(4, 16, 8, 10, 3, "float32", False, 1)
    out, step = verify_moe_reference(x, w13, w2, ids, weights)
    expected = torch.zeros_like(x)
    for t in range(4):
        for k in range(3):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate, up = (w13[e] @ x[t]).split(8)
            expected[t] += weights[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected)
    assert sorted({int(i) for i in ids.flatten() if i >= 0}) == [
        e for e in range(10) if (int(step[0]) >> e) & 1
    ]


def test_reference_writes_bitmap_out():
    x, w13, w2, ids, weights = make_inputs(5, 16, 8, 70, 3, "float32", False, 2)
    buffer = torch.full((2,), -1, dtype=torch.int64)  # stale bits: every word is overwritten
    out, step = verify_moe(x, w13, w2, ids, weights, bitmap_out=buffer, impl="reference")
    ref, ref_step = verify_moe_reference(x, w13, w2, ids, weights)
    assert step is buffer and torch.equal(buffer, ref_step) and torch.equal(out, ref)
    assert (out[3:] == 0).all()


def check_no_tokens(impl: str) -> None:
    """T = 0: an empty output and an all-zero bitmap (a stale persistent one overwritten)."""
    x, w13, w2, ids, weights = make_inputs(0, 16, 8, 70, 3, "float32", False, 0)
    out, step = verify_moe(x, w13, w2, ids, weights, impl=impl)
    assert out.shape == (0, 16) and out.dtype == x.dtype
    assert torch.equal(step, torch.zeros(2, dtype=torch.int64))
    buffer = torch.full((2,), -1, dtype=torch.int64)
    assert verify_moe(x, w13, w2, ids, weights, bitmap_out=buffer, impl=impl)[1] is buffer
    assert torch.equal(buffer, torch.zeros(2, dtype=torch.int64))


def test_reference_on_no_tokens():
    check_no_tokens("reference")


@pytest.mark.parametrize(
    "tokens, block_m", [(0, 16), (1, 16), (16, 16), (17, 32), (33, 64), (64, 64), (65, 64)]
)
def test_pairs_per_program_covers_every_token_up_to_the_cap(tokens, block_m):
    # An expert has at most T pairs, so BLOCK_M >= T means one pass over its weights.
    assert pairs_per_program(tokens) == block_m
    assert block_m >= min(tokens, BLOCK_M_MAX)


def test_bad_shapes_are_rejected():
    x, w13, w2, ids, weights = make_inputs(2, 16, 8, 4, 2, "float32", False, 0)
    with pytest.raises(ValueError, match=r"w2 must have shape \(4, 16, 8\)"):
        verify_moe(x, w13, w2[:, :, :4], ids, weights)
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        verify_moe(x, w13, w2, ids, weights[:, :1])
    with pytest.raises(TypeError, match="w13 must have dtype"):
        verify_moe(x, w13.half(), w2, ids, weights)
    with pytest.raises(ValueError, match=r"bitmap_out must have shape \(1,\)"):
        verify_moe(x, w13, w2, ids, weights, bitmap_out=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="bitmap_out must have dtype"):
        verify_moe(x, w13, w2, ids, weights, bitmap_out=torch.zeros(1, dtype=torch.int32))
    x, w13, w2, ids, weights = make_inputs(2, 16, 8, 70, 2, "float32", False, 0)
    strided = torch.zeros(4, dtype=torch.int64)[::2]  # [W = 2], every second word
    with pytest.raises(ValueError, match="bitmap_out must be a contiguous tensor"):
        verify_moe(x, w13, w2, ids, weights, bitmap_out=strided)


# --- the grouping of large calls under tracing (the CPU stand-in for CUDA-graph capture) ----

E, T, K = 70, 6, 4


def host_side(topk_ids):
    """The tensor-op grouping that calls with more pairs than the route kernel sorts use
    (the run starts the kernel turns into the bitmap)."""
    return _group_by_expert(topk_ids, E)


def routing(seed: int, padded: int, tokens: int = T, experts: int = E, top_k: int = K):
    """ids int64 ``[T, K]`` with ``padded`` rows of -1 at the end (and one padded pair in
    the last real row)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if padded:
        ids[tokens - padded :] = -1
        if tokens > padded:
            ids[tokens - padded - 1, 0] = -1
    return ids


def check_grouping(ids, pairs, starts, experts=E):
    """The grouping means what the kernels rely on."""
    flat = ids.reshape(-1)
    for e in range(experts):
        run = pairs[starts[e] : starts[e + 1]]
        assert torch.equal(run, (flat == e).nonzero().flatten()), e  # expert e's pairs, in order
    assert torch.equal(pairs[starts[experts] :], (flat < 0).nonzero().flatten())  # padding last
    # The bitmap the kernel writes from the run starts: experts with a run, padding none.
    active = (starts[1:] > starts[:-1]).nonzero().flatten().tolist()
    assert active == sorted({int(e) for e in flat if e >= 0})


def test_host_side_traced_once_replays_on_new_routing():
    # make_fx records the aten ops once; replaying the graph runs no Python, so a value read
    # on the host at trace time (a count, a padding length) would stay frozen, as in a CUDA
    # graph. The trace starts without padding and replays on routings with padded rows.
    ids = routing(seed=0, padded=0)
    graph = make_fx(host_side)(ids)
    first = graph(ids)
    for seed, padded in [(1, 2), (2, 0), (3, 5)]:
        ids.copy_(routing(seed, padded))
        replayed, eager = graph(ids), host_side(ids)
        for got, want in zip(replayed, eager, strict=True):
            assert torch.equal(got, want)
        check_grouping(ids, *replayed)
        assert not torch.equal(replayed[1], first[1])  # the starts followed the new routing
    assert host_syncs(host_side, ids) == []


# --- the kernel under Triton's interpreter ---------------------------------------------------


if triton is not None:

    @triton.jit
    def _last_tile_offsets(out_ptr, int32_ptr, stride_e, stride_n, first_k, first_n):
        """Program e: the largest offset of expert e's last 16 x 16 tile, and e x stride_e
        computed from the program id alone (int32)."""
        e = tl.program_id(0)
        offs = expert_tile_offsets(
            e, first_k + tl.arange(0, 16), first_n + tl.arange(0, 16), stride_e, stride_n
        )
        tl.store(out_ptr + e, tl.max(tl.max(offs, axis=1), axis=0))
        tl.store(int32_ptr + e, e * stride_e)


def check_offsets_are_64_bit() -> None:
    """``expert_tile_offsets`` at DeepSeek-V3's TP1 w13 (E = 256, 2I = 4096, H = 7168:
    E x 2I x H = 7.5e9 > 2^31 elements), computed by programs 0..255 as the kernels do,
    equals Python's integers; the same product in the program id's int32 wraps, so the
    check tells a 64-bit offset from a 32-bit one."""
    experts, rows, hidden = 256, 4096, 7168
    got = torch.zeros(experts, dtype=torch.int64)
    int32 = torch.zeros(experts, dtype=torch.int64)
    _last_tile_offsets[(experts,)](got, int32, rows * hidden, hidden, hidden - 16, rows - 16)
    expected = torch.tensor([e * rows * hidden + rows * hidden - 1 for e in range(experts)])
    assert torch.equal(got, expected), (got[-3:], expected[-3:])
    assert int(expected[-1]) > 2**31 and int(int32[-1]) != (experts - 1) * rows * hidden


# (tokens, experts, top_k, padded rows): 1 pair, E = 1, E not a multiple of 64, 1040 pairs
# (a comparison tile of 4 experts x 2048 lanes).
ROUTE_CASES = [(1, 70, 1, 0), (3, 5, 2, 1), (6, 70, 4, 2), (64, 256, 8, 3), (130, 128, 8, 0)]
ROUTE_CASES += [(2, 1, 1, 1)]


def check_route_kernel() -> None:
    """The route kernel's grouping equals the tensor ops' (and means what the kernels rely
    on) from 1 pair to more than one comparison tile, with padding; a call with more pairs
    than it sorts takes the tensor ops and gives the same MoE output."""
    from sgl_ecospec.ops import verify_moe as module

    for tokens, experts, top_k, padded in ROUTE_CASES:
        ids = routing(seed=tokens, padded=padded, tokens=tokens, experts=experts, top_k=top_k)
        for index in (ids, ids.int()):
            pairs, starts = module._group_pairs(index, experts)
            assert torch.equal(pairs, _group_by_expert(index, experts)[0]), (tokens, experts)
            assert torch.equal(starts, _group_by_expert(index, experts)[1]), (tokens, experts)
            check_grouping(index, pairs, starts, experts)
    inputs = make_inputs(6, 32, 16, 70, 4, "float32", False, 2)
    routed = verify_moe(*inputs, impl="triton")
    limit, module.ROUTE_MAX_PAIRS = module.ROUTE_MAX_PAIRS, 8
    try:
        grouped = verify_moe(*inputs, impl="triton")
    finally:
        module.ROUTE_MAX_PAIRS = limit
    assert torch.equal(routed[0], grouped[0]) and torch.equal(routed[1], grouped[1])


def compare_with_triton() -> int:
    """Runs in a fresh interpreter with TRITON_INTERPRET=1: every case through the Triton
    path, with a new bitmap and with a stale persistent one, against the reference; then
    T = 0, the 64-bit weight offsets and the route kernel (three more checks in the count)."""
    check_no_tokens("triton")
    check_offsets_are_64_bit()
    check_route_kernel()
    for case in CASES:
        inputs = make_inputs(*case)
        ref, ref_step = verify_moe_reference(*inputs)
        out, step = verify_moe(*inputs, impl="triton")
        tol = 1e-5 if case[5] == "float32" else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        assert torch.equal(step, ref_step), (case, step, ref_step)
        buffer = torch.full((num_words(case[3]),), -1, dtype=torch.int64)  # stale bits
        again, written = verify_moe(*inputs, bitmap_out=buffer, impl="triton")
        assert written is buffer and torch.equal(buffer, ref_step), (case, buffer, ref_step)
        assert torch.equal(again, out)
        padded = case[-1]
        if padded:
            assert (out[-padded:] == 0).all() and out.isfinite().all(), case
    return len(CASES) + 3


def test_triton_kernel_matches_reference_under_interpreter():
    assert compared_under_interpreter(__file__) == len(CASES) + 3


# On a GPU every case also in bf16 (the interpreter cannot multiply bf16).
GPU_CASES = CASES + [(*case[:5], "bfloat16", *case[6:]) for case in CASES]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES)
def test_triton_kernel_on_gpu_matches_reference(case):
    inputs = [t.cuda() for t in make_inputs(*case)]
    out, step = verify_moe(*inputs, impl="triton")
    ref, ref_step = verify_moe_reference(*inputs)
    tol = 1e-3 if case[5] == "float32" else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(step, ref_step)
    buffer = torch.full_like(step, -1)
    assert verify_moe(*inputs, bitmap_out=buffer, impl="triton")[1] is buffer
    assert torch.equal(buffer, ref_step)
