"""The MoE layer of a verify pass: each active expert's weights streamed once.

A verify batch has few tokens (B x verified nodes) spread over many experts, so the layer
is memory-bound: its time is the bytes of the experts it touches. The Triton path groups
the (token, expert) pairs by expert and gives each active expert one column of programs
that read its weight tiles once for all of its tokens (up to ``BLOCK_M_MAX`` tokens per call;
beyond that once per ``BLOCK_M_MAX`` pairs); inactive experts' programs exit at once. Weight
offsets are 64-bit (``expert_tile_offsets``): E x 2I x H passes 2^31 elements on large models.
As a by-product it writes the step's routing bitmap (which experts were loaded), the quantity
EcoSpec's buffer and predictor work with, into a new tensor or a persistent one
(``bitmap_out``).

Padded rows (expert id -1, SGLang's mask for the padding of a graph batch) load no expert,
set no bit and give zero output rows; their hidden rows are never read.

A call is four launches: the route kernel groups the (token, expert) pairs by expert (one
program sorts them; calls of more than ``ROUTE_MAX_PAIRS`` pairs group with tensor ops
instead), the two projections, and the combine kernel that sums each token's K rows in slot
order (deterministic) and casts them.

CUDA graphs: the host side makes no host sync and no data-dependent shape (the launch grids
depend on shapes only; the padding is a mask; the tensor-op grouping is argsort,
scatter-add and cumsum), so a call can be captured with static shapes and replayed on new
inputs written in place, the bitmap going to ``bitmap_out``. Proved on the CPU
(``test/ops/test_verify_moe.py``: a ``make_fx`` trace of the tensor-op grouping replays on new
routing); the capture itself is checked by the device check (``scripts/gpu_check.sh``).

Shape legend: T = tokens, H = hidden size, I = expert intermediate size, E = experts,
K = experts per token, P = T * K (token, expert) pairs, W = ceil(E / 64).
"""

import os

import torch
import torch.nn.functional as F

from sgl_ecospec.ops.bitmaps import num_words, topk_to_bitmap
from sgl_ecospec.ops.checks import INDEX_DTYPES, check_shape, check_tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works; the Triton path says how to get Triton
    triton = None

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def verify_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    bitmap_out: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU MoE output of a verify batch and the experts it loaded.

    Args:
        hidden: float16/bfloat16/float32 ``[T, H]``.
        w13: same dtype, ``[E, 2I, H]``: gate rows ``[:I]`` then up rows ``[I:]`` (the
            layout of SGLang's fused MoE).
        w2: same dtype, ``[E, H, I]``: down projection.
        topk_ids: int32/int64 ``[T, K]``: experts per token, in [0, E), or -1 for a padded
            pair (not checked: no host sync).
        topk_weights: float ``[T, K]``: routing weights (those of padded pairs are unused).
        bitmap_out: optional int64 ``[W]``, contiguous, on hidden's device: a persistent
            buffer the call overwrites with the step bitmap (every word written) and returns,
            so that a captured call leaves it where later readers find it.
        impl: "auto" (Triton for CUDA tensors or under TRITON_INTERPRET=1, else the
            reference), "triton" or "reference".

    Returns:
        (output ``[T, H]`` in hidden's dtype, step bitmap int64 ``[W]``: experts with at
        least one (unpadded) token; ``bitmap_out`` itself when given).
    """
    _check(hidden, w13, w2, topk_ids, topk_weights, bitmap_out)
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"impl must be auto, triton or reference, got {impl!r}")
    if impl == "reference" or (impl == "auto" and not _triton_runs(hidden)):
        out, step = verify_moe_reference(hidden, w13, w2, topk_ids, topk_weights)
        if bitmap_out is None:
            return out, step
        return out, bitmap_out.copy_(step)
    if triton is None:
        raise RuntimeError("impl='triton' needs the triton package (pip install triton)")
    return _verify_moe_triton(hidden, w13, w2, topk_ids, topk_weights, bitmap_out)


def _triton_runs(hidden: torch.Tensor) -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and (hidden.is_cuda or interpreted)


def _check(hidden, w13, w2, topk_ids, topk_weights, bitmap_out):
    check_tensor("hidden", hidden, ndim=2, dtypes=_FLOATS)
    check_tensor("w13", w13, ndim=3, dtypes=(hidden.dtype,))
    experts, two_inter, hidden_size = w13.shape
    if two_inter % 2 or hidden_size != hidden.shape[1]:
        raise ValueError(
            f"w13 must be [E, 2I, H] with H = {hidden.shape[1]}, got {tuple(w13.shape)}"
        )
    check_tensor("w2", w2, ndim=3, dtypes=(hidden.dtype,))
    check_shape("w2", w2, (experts, hidden_size, two_inter // 2), "[E, H, I]")
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES)
    if topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids must be [T, K] with T = {hidden.shape[0]}")
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_FLOATS)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape), "[T, K] like topk_ids")
    if bitmap_out is not None:
        check_tensor("bitmap_out", bitmap_out, ndim=1, dtypes=(torch.int64,))
        check_shape("bitmap_out", bitmap_out, (num_words(experts),), "[W], W = ceil(E / 64)")
        if bitmap_out.device != hidden.device or not bitmap_out.is_contiguous():
            raise ValueError(
                f"bitmap_out must be a contiguous tensor on {hidden.device}, got one on "
                f"{bitmap_out.device} (contiguous: {bitmap_out.is_contiguous()})"
            )


def verify_moe_reference(hidden, w13, w2, topk_ids, topk_weights):
    """Plain PyTorch version of :func:`verify_moe`: a loop over the active experts (host
    syncs: not for CUDA graphs)."""
    experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        x = hidden[token].float()
        gate_up = x @ w13[e].float().t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[e].float().t()
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    step = topk_to_bitmap(ids[ids >= 0].reshape(1, -1), experts, validate=False, impl="reference")[
        0
    ]
    return out.to(hidden.dtype), step


def _group_by_expert(topk_ids: torch.Tensor, experts: int):
    """(pairs sorted by expert int64 ``[P]``, padded pairs (id < 0) last; start of each
    expert's run int64 ``[E + 1]``, the last entry the number of unpadded pairs), with
    tensor ops only (no host sync, shapes from the inputs' shapes alone): the grouping of
    calls with more pairs than the route kernel sorts, and its reference."""
    flat = topk_ids.reshape(-1).long()
    bucket = torch.where(flat < 0, experts, flat)  # padded pairs: one bucket after the experts
    order = torch.argsort(bucket, stable=True)
    # bincount would read its maximum back to the host on CUDA (no graph capture).
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    starts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device)
    starts[1:] = torch.cumsum(counts[:experts], 0)
    return order, starts


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# The route kernel sorts a call's (token, expert) pairs in one program, as one launch instead
# of the eight or so of the tensor-op grouping (which bound small calls on an H200: about
# 70 us at T = 1); up to this many pairs (64 tokens x top-8 is 512).
ROUTE_MAX_PAIRS = 8192
# Elements of the [experts, pairs] comparison that one step of the route kernel holds.
ROUTE_TILE = 8192


def _group_pairs(topk_ids: torch.Tensor, experts: int):
    """``_group_by_expert``'s result, by the route kernel when the pairs fit one program."""
    pairs = topk_ids.numel()
    if pairs > ROUTE_MAX_PAIRS:
        return _group_by_expert(topk_ids, experts)
    block_p = max(16, _next_power_of_2(pairs))
    block_e = max(1, min(_next_power_of_2(experts + 1), ROUTE_TILE // block_p))
    order = torch.empty(pairs, dtype=torch.int64, device=topk_ids.device)
    starts = torch.empty(experts + 1, dtype=torch.int64, device=topk_ids.device)
    _route_kernel[(1,)](
        topk_ids.contiguous(), order, starts, pairs, experts, BLOCK_P=block_p, BLOCK_E=block_e
    )
    return order, starts


# A program keeps up to this many of its expert's pairs in registers, so each weight tile is
# read once per call for up to BLOCK_M_MAX tokens (an expert has at most T pairs: a token
# picks an expert once), and once per BLOCK_M_MAX pairs beyond that.
BLOCK_M_MAX = 64


def pairs_per_program(tokens: int) -> int:
    """BLOCK_M for a call with ``tokens`` tokens: the next power of two at least T, within
    [16, BLOCK_M_MAX] (``tl.dot`` needs 16 rows). A shape, not a value: graph-safe."""
    return min(BLOCK_M_MAX, max(16, 1 << max(0, tokens - 1).bit_length()))


def _verify_moe_triton(hidden, w13, w2, topk_ids, topk_weights, bitmap_out=None):
    tokens, hidden_size = hidden.shape
    experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    step = bitmap_out
    if step is None:
        step = torch.empty(num_words(experts), dtype=torch.int64, device=hidden.device)
    if tokens == 0:
        return hidden.new_empty((0, hidden_size)), step.zero_()
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    topk_ids = topk_ids.contiguous()
    pairs, starts = _group_pairs(topk_ids, experts)
    weights = topk_weights.reshape(-1).float().contiguous()
    # 16-bit activations stay 16-bit between the projections (as in SGLang's fused MoE), so
    # the down projection runs on tensor cores; float32 stays float32 (IEEE dots).
    act = torch.empty((tokens * top_k, inter), dtype=hidden.dtype, device=hidden.device)
    per_pair = torch.empty((tokens * top_k, hidden_size), dtype=torch.float32, device=hidden.device)
    block_m, block_n, block_k = pairs_per_program(tokens), 64, 64
    ieee = hidden.dtype == torch.float32
    _expert_gate_up_kernel[(experts, triton.cdiv(inter, block_n))](
        hidden, w13, act, pairs, starts, step,
        hidden_size, inter, top_k,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    _expert_down_kernel[(experts, triton.cdiv(hidden_size, block_n))](
        act, w2, per_pair, pairs, starts, weights,
        hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    out = torch.empty((tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _combine_kernel[(tokens, triton.cdiv(hidden_size, 128))](
        per_pair, topk_ids, out, hidden_size, per_pair.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=128,
    )  # fmt: skip
    return out, step


if triton is not None:

    @triton.jit
    def _route_kernel(ids_ptr, pairs_ptr, starts_ptr, P, E, BLOCK_P: tl.constexpr,
                      BLOCK_E: tl.constexpr):  # fmt: skip
        """One program: the P pairs sorted by expert, padded ones (id < 0) last, each expert's
        run in pair order (keys bucket x BLOCK_P + pair are distinct, so the sort is
        stable), and starts[e] = the pairs of experts below e, for e in [0, E]."""
        offs = tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int64)
        bucket = tl.where(ids < 0, E, ids)
        bucket = tl.where(offs < P, bucket, E + 1)  # lanes past P sort after everything
        key = tl.sort(bucket * BLOCK_P + offs)
        tl.store(pairs_ptr + offs, key % BLOCK_P, mask=offs < P)
        for e0 in range(0, E + 1, BLOCK_E):
            offs_e = e0 + tl.arange(0, BLOCK_E)
            below = key[None, :] < offs_e[:, None].to(tl.int64) * BLOCK_P
            tl.store(starts_ptr + offs_e, tl.sum(below.to(tl.int64), axis=1), mask=offs_e <= E)

    @triton.jit
    def _combine_kernel(per_pair_ptr, ids_ptr, out_ptr, hidden, stride_pair, stride_out,
                        TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
        """Program (t, h-tile): out[t] = the sum of token t's K weighted expert rows, in
        slot order (deterministic: no atomics), padded pairs' rows (never written) skipped,
        cast to the output's dtype."""
        t = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < hidden
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            pair = t.to(tl.int64) * TOP_K + k
            expert = tl.load(ids_ptr + pair)
            row = tl.load(per_pair_ptr + pair * stride_pair + offs_h, mask=mask_h & (expert >= 0),
                          other=0.0)  # fmt: skip
            acc += row
        tl.store(out_ptr + t.to(tl.int64) * stride_out + offs_h,
                 acc.to(out_ptr.dtype.element_ty), mask=mask_h)  # fmt: skip

    @triton.jit
    def expert_tile_offsets(e, offs_k, offs_n, stride_e, stride_n):
        """int64 ``[BLOCK_K, BLOCK_N]``: offsets of columns ``offs_k`` of rows ``offs_n`` of
        expert ``e``'s weight matrix. 64-bit, since E x 2I x H passes 2^31 elements for
        DeepSeek-V3, Qwen3-Coder-480B or Kimi-K2 at TP1 (a program id is int32)."""
        return (
            e.to(tl.int64) * stride_e
            + offs_n.to(tl.int64)[None, :] * stride_n
            + offs_k.to(tl.int64)[:, None]
        )

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        # float32 operands: IEEE products (the reference's precision); 16-bit: tensor cores.
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _expert_gate_up_kernel(
        x_ptr, w13_ptr, act_ptr, pairs_ptr, starts_ptr, step_ptr,
        hidden, inter, top_k,
        stride_x_t, stride_w_e, stride_w_n, stride_act_p,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """Program (e, n): act[p, n-tile] = silu(x_p . gate) * (x_p . up) for expert e's pairs;
        program (64 w, 0) also writes word w of the step bitmap."""
        e = tl.program_id(0)
        pid_n = tl.program_id(1)
        if (pid_n == 0) & (e % 64 == 0):
            # The whole word from the run starts: a plain store, so the bitmap needs no
            # zeroing first and no atomics (distinct powers of two sum to their OR).
            offs_e = e + tl.arange(0, 64)
            mask_e = offs_e < tl.num_programs(0)
            lo = tl.load(starts_ptr + offs_e, mask=mask_e, other=0)
            hi = tl.load(starts_ptr + offs_e + 1, mask=mask_e, other=0)
            bits = tl.full((64,), 1, tl.int64) << tl.arange(0, 64).to(tl.int64)
            tl.store(step_ptr + e // 64, tl.sum(tl.where(hi > lo, bits, 0), axis=0))
        start = tl.load(starts_ptr + e)
        end = tl.load(starts_ptr + e + 1)
        if end > start:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < inter
            for m0 in range(start, end, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask_m = offs_m < end
                pair = tl.load(pairs_ptr + offs_m, mask=mask_m, other=0)  # int64
                token = pair // top_k
                acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, hidden, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mask_k = offs_k < hidden
                    x = tl.load(
                        x_ptr + token[:, None] * stride_x_t + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0,
                    )
                    w_mask = mask_k[:, None] & mask_n[None, :]
                    gate = expert_tile_offsets(e, offs_k, offs_n, stride_w_e, stride_w_n)
                    up = expert_tile_offsets(e, offs_k, offs_n + inter, stride_w_e, stride_w_n)
                    w_gate = tl.load(w13_ptr + gate, mask=w_mask, other=0.0)
                    w_up = tl.load(w13_ptr + up, mask=w_mask, other=0.0)
                    acc_gate = _dot(x, w_gate, acc_gate, IEEE)
                    acc_up = _dot(x, w_up, acc_up, IEEE)
                act = acc_gate * tl.sigmoid(acc_gate) * acc_up
                tl.store(
                    act_ptr + pair[:, None] * stride_act_p + offs_n[None, :],
                    act.to(act_ptr.dtype.element_ty),
                    mask=mask_m[:, None] & mask_n[None, :],
                )

    @triton.jit
    def _expert_down_kernel(
        act_ptr, w2_ptr, out_ptr, pairs_ptr, starts_ptr, weights_ptr,
        hidden, inter,
        stride_act_p, stride_w_e, stride_w_h, stride_out_p,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """Program (e, h-tile): out[p, h-tile] = weight_p * act_p . down for expert e's pairs."""
        e = tl.program_id(0)
        pid_n = tl.program_id(1)
        start = tl.load(starts_ptr + e)
        end = tl.load(starts_ptr + e + 1)
        if end > start:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hidden
            for m0 in range(start, end, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask_m = offs_m < end
                pair = tl.load(pairs_ptr + offs_m, mask=mask_m, other=0)  # int64
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, inter, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mask_k = offs_k < inter
                    a = tl.load(
                        act_ptr + pair[:, None] * stride_act_p + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0,
                    )
                    down = expert_tile_offsets(e, offs_k, offs_n, stride_w_e, stride_w_h)
                    w = tl.load(w2_ptr + down, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                    acc = _dot(a, w, acc, IEEE)
                weight = tl.load(weights_ptr + pair, mask=mask_m, other=0.0)
                tl.store(
                    out_ptr + pair[:, None] * stride_out_p + offs_n[None, :],
                    acc * weight[:, None],
                    mask=mask_m[:, None] & mask_n[None, :],
                )
