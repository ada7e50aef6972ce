"""SGLang's Triton attention kernels in plain PyTorch, for the CPU development mode.

Speculative decoding on the CPU needs ``--attention-backend triton`` (the only CPU-capable
backend that reads the verify tree mask), and without a GPU its kernels run under
``TRITON_INTERPRET=1``: one Python-level program per (request, head tile, block), about 85% of
a decode step on the small testbed. This module computes the same results with a few tensor
operations per request:

- :func:`decode_attention_fwd`: one query per row (draft decode, plain decode) over a paged
  KV list, including the split-KV intermediates (``attn_logits``, ``attn_lse``) that the
  Triton kernel writes for its stage-2 merge and DCP reads;
- :func:`extend_attention_fwd`: the queries of each request over its paged prefix and its
  own new keys (prefill, draft extend, target verify with the custom tree mask), in one
  batched pass when every request extends by the same rows
  (:mod:`sglang_ecospec_cpu.extend_batched`);
- ``extend_attention_fwd_unified`` (:mod:`sglang_ecospec_cpu.attention_unified`): the
  deterministic-mode variant, one unified KV list.

Each function has the signature and the semantics of the kernel function of the same name
in ``sglang.kernels.ops.attention.{decode,extend}_attention``: paged KV through
``kv_indptr``/``kv_indices`` (slots of a 3-D ``[slots, kv_heads, dim]`` pool, so the page size
does not change the address), GQA, ``sm_scale``, the K/V descales, the tanh logit cap, the
sliding window, xai temperature, attention sinks, the custom mask with its ``mask_indptr``.
They compute in fp32 and cast on store, like the kernels' fp32 accumulators.

:func:`register_hooks` installs them as AROUND hooks on those kernel functions; the hook
runs the PyTorch version for CPU tensors and hands anything it does not cover (a
``score_mod``, the MLA decode path, a non-CPU tensor) to the Triton kernel. ``cpu_dev.enable``
calls it, so only a GPU-less ``--device cpu`` server uses them.

Shape legend: B = requests (rows of ``kv_indptr``), H = query heads, Hkv = KV heads,
G = H // Hkv, D = q/k head dim, Dv = v head dim, T = query tokens of the batch,
S = ``max_kv_splits``, N = keys of one request.
"""

import inspect
import logging

import torch

from sglang_ecospec_cpu.attention_math import (
    cap_logits,
    extend_rows,
    extend_uncovered,
    head_major,
    masked_attention,
    xai_log_scale,
)
from sglang_ecospec_cpu.attention_unified import (
    extend_attention_fwd_unified,
    extend_unified_fallback_reason,
)
from sglang_ecospec_cpu.extend_batched import extend_uniform, uniform_rows
from sglang_ecospec_cpu.function_hooks import register_function_hooks

logger = logging.getLogger(__name__)

DECODE_TARGET = "sglang.kernels.ops.attention.decode_attention.decode_attention_fwd"
EXTEND_TARGET = "sglang.kernels.ops.attention.extend_attention.extend_attention_fwd"
EXTEND_UNIFIED_TARGET = "sglang.kernels.ops.attention.extend_attention.extend_attention_fwd_unified"
# The decode kernel rounds each split's key range up to this many keys (its _MIN_BLOCK_KV).
MIN_BLOCK_KV = 32


def decode_attention_fwd(
    q,
    k_buffer,
    v_buffer,
    o,
    kv_indptr,
    kv_indices,
    attn_logits,
    attn_lse,
    num_kv_splits,
    max_kv_splits,
    sm_scale,
    k_scale,
    v_scale,
    logit_cap=0.0,
    sinks=None,
    xai_temperature_len=-1,
    has_mla=False,
    use_pdl=False,
    page_size: int = 1,
    score_mod=None,
    aux_tensors=None,
    enable_lean=None,
    lean_Mp=None,
    lean_Lp=None,
    lean_Op=None,
    lean_locks=None,
    uneven_batch=None,
):
    """Split-KV decode attention, as SGLang's Triton ``decode_attention_fwd``.

    q: [B, H, D] queries (any float dtype); k_buffer: [slots, Hkv, D], v_buffer:
    [slots, Hkv, Dv] the KV pool; o: [B, H, Dv] output, written. kv_indptr: [>= B+1] int,
    row b's keys are the pool slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    attn_logits: [>= B, H, S, Dv] fp32 and attn_lse: [>= B, H, S] fp32, written: row b's
    keys are cut into ``num_kv_splits[b]`` (int, [>= B]) ranges of
    ``roundup(ceil(N / splits), 32)`` keys; for each non-empty range s, ``attn_logits[b, h,
    s]`` is its normalised partial output and ``attn_lse[b, h, s]`` its log-sum-exp (empty
    ranges are left alone, as the kernel leaves them). ``o`` is the merge of the ranges,
    times ``v_scale``; scores are ``q.k * sm_scale * k_scale``, soft-capped, xai-scaled.
    sinks: [H] or None, an extra logit per head in the denominator. The lean arguments,
    ``use_pdl`` and ``page_size`` choose GPU launch strategies and change nothing here.
    """
    del use_pdl, page_size, enable_lean, lean_Mp, lean_Lp, lean_Op, lean_locks, uneven_batch
    if max_kv_splits != attn_logits.shape[2]:
        raise ValueError(f"max_kv_splits {max_kv_splits} != attn_logits.shape[2]")
    batch, heads = q.shape[0], q.shape[1]
    kv_heads = v_buffer.shape[-2]
    dim, dim_v = k_buffer.shape[-1], v_buffer.shape[-1]
    if batch > kv_indptr.shape[0] - 1 or batch > attn_logits.shape[0]:
        raise ValueError("q has more rows than kv_indptr or attn_logits")
    if batch == 0:
        return
    device = q.device

    indptr = kv_indptr[: batch + 1].long()
    lens = indptr[1:] - indptr[:-1]
    splits = num_kv_splits[:batch].long().clamp_min(1)
    per_split = (lens + splits - 1) // splits
    per_split = (per_split + MIN_BLOCK_KV - 1) // MIN_BLOCK_KV * MIN_BLOCK_KV
    width = max(int(per_split.max()), 1)
    # Only the splits some row fills are computed (the kernel's grid covers max_kv_splits,
    # but a split past a row's keys returns at once): short rows in many splits would
    # otherwise cost max_kv_splits * 32 keys each.
    used = (lens + per_split - 1) // per_split.clamp_min(1)
    used = min(max(int(used.max()), 1), max_kv_splits)
    # key l of row b sits at (split l // per_split[b], offset l % per_split[b])
    offset = torch.arange(width, device=device)
    split = torch.arange(used, device=device)
    key = split[None, :, None] * per_split[:, None, None] + offset
    valid = (offset < per_split[:, None, None]) & (key < lens[:, None, None])  # [B, S, W]
    loc = torch.zeros_like(key)
    if kv_indices.numel() > 0:
        flat = torch.where(valid, indptr[:-1, None, None] + key, 0)
        loc = torch.where(valid, kv_indices[flat].long(), 0)
    group = heads // kv_heads
    k = head_major(k_buffer, loc.view(batch, -1), dim)  # [Hkv, B, S*W, D]
    v = head_major(v_buffer, loc.view(batch, -1), dim_v)

    qg = q[:, :, :dim].float().view(batch, kv_heads, group, dim).transpose(0, 1)
    scores = torch.matmul(qg, k.transpose(2, 3))  # [Hkv, B, G, S*W]
    scores = scores.transpose(0, 1).reshape(batch, heads, used, width)
    scores = cap_logits(scores * (sm_scale * k_scale), logit_cap)
    if xai_temperature_len > 0:
        scores = scores * xai_log_scale(lens - 1, xai_temperature_len)[:, None, None, None]
    scores = scores.masked_fill(~valid[:, None], float("-inf"))

    # stage 1: each split's normalised output and log-sum-exp
    nonempty = valid[:, :, 0]  # [B, S]
    split_max = torch.where(nonempty[:, None], scores.amax(-1), 0.0)
    p = torch.exp(scores - split_max[..., None])
    split_sum = p.sum(-1)  # [B, H, S]
    pg = p.view(batch, kv_heads, group, used, width).permute(1, 0, 3, 2, 4)
    vg = v.view(kv_heads, batch, used, width, dim_v)
    acc = torch.matmul(pg, vg)  # [Hkv, B, S, G, Dv]
    acc = acc.permute(1, 0, 3, 2, 4).reshape(batch, heads, used, dim_v)
    written = nonempty[:, None].expand(batch, heads, used)
    split_out = acc / split_sum[..., None]
    split_lse = split_max + torch.log(split_sum)
    attn_logits[:batch, :, :used, :dim_v][written] = split_out[written]
    attn_lse[:batch, :, :used][written] = split_lse[written]

    # stage 2: merge the non-empty splits (and the sink) by their log-sum-exp
    split_lse = split_lse.masked_fill(~written, float("-inf"))
    merged_max = split_lse.amax(-1)
    merged_max = torch.where(torch.isinf(merged_max), 0.0, merged_max)
    weight = torch.exp(split_lse - merged_max[..., None])  # 0 at empty splits
    out = (weight[..., None] * torch.where(written[..., None], split_out, 0.0)).sum(2)
    deno = weight.sum(-1)
    if sinks is not None:
        deno = deno + torch.exp(sinks.float()[None, :] - merged_max)
    o[:batch, :, :dim_v] = (out / deno[..., None] * v_scale).to(o.dtype)


def decode_fallback_reason(q, k_buffer, v_buffer, has_mla=False, score_mod=None, **_) -> str | None:
    """Why :func:`decode_attention_fwd` does not cover a call (None: it does)."""
    if q.device.type != "cpu":
        return "tensors not on the CPU"
    if score_mod is not None:
        return "score_mod"
    if has_mla and q.shape[1] != v_buffer.shape[-2]:
        return "MLA decode (values read from the key buffer)"
    if k_buffer.ndim != 3 or v_buffer.ndim != 3:
        return "KV buffer not [slots, heads, dim]"
    return None


# --- extend -------------------------------------------------------------------------------


def extend_per_request(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    is_causal,
    mask_indptr,
    max_len_extend,
    k_scale,
    v_scale,
    sm_scale=None,
    logit_cap=0.0,
    skip_prefix_custom_mask=True,
    sliding_window_size=-1,
    sinks=None,
    window_kv_offsets=None,
    xai_temperature_len=-1,
    lse_extend=None,
    skip_prefix=False,
    skip_extend=False,
    page_size: int = 1,
    score_mod=None,
    aux_tensors=None,
    extend_seq_lens_cpu=None,
    identity_kv_indices: bool = False,
):
    """Prefix + extend attention, as SGLang's Triton ``extend_attention_fwd``.

    q_extend: [T, H, D] queries; k_extend: [T, Hkv, D], v_extend: [T, Hkv, Dv] the new keys
    and values; o_extend: [T, H, Dv] output, written. Request b owns query rows
    ``qo_indptr[b]:qo_indptr[b+1]`` (E of them, int [B+1]) and attends to its P prefix keys,
    the pool slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of ``k_buffer``/``v_buffer``
    ([slots, Hkv, D/Dv]; with ``identity_kv_indices`` the slots are the positions
    themselves), scored ``q.k * sm_scale * k_scale`` with values times ``v_scale``, then to
    its own E new keys, scored ``q.k * sm_scale``: causally, all of them (``is_causal``
    False), or as ``custom_mask`` says (int8/bool, flat; request b's E rows of
    ``P + E + window_kv_offsets[b]`` cells start at ``mask_indptr[b]``, the first
    ``window_kv_offsets[b]`` skipped; the prefix part is read only when
    ``skip_prefix_custom_mask`` is False). ``sliding_window_size`` > 0 keeps a key at
    position n for the query at position m when ``m <= n + window`` (and ``n <= m + window``
    without causality). ``lse_extend``: [T, H] fp32 or None, gets the natural-log LSE
    (-inf for a row with no key, whose output is 0). ``skip_prefix``/``skip_extend`` drop
    one of the two key sets. ``max_len_extend``, ``page_size`` and ``extend_seq_lens_cpu``
    only size the GPU launch.

    A difference by design: with both ``custom_mask`` and ``is_causal``, the kernel also
    ignores keys past the end of the query's BLOCK_M tile; every mask SGLang builds (tree
    masks) is within that bound, and here the mask alone decides.

    This is the reference, a few tensor operations per request; :func:`extend_attention_fwd`
    runs :func:`sglang_ecospec_cpu.extend_batched.extend_uniform` where it applies.
    """
    del max_len_extend, page_size, extend_seq_lens_cpu
    dim, dim_v = q_extend.shape[-1], v_extend.shape[-1]
    sm_scale = sm_scale or 1.0 / dim**0.5
    batch = qo_indptr.shape[0] - 1
    kv_heads = k_extend.shape[1]
    device = q_extend.device
    window = sliding_window_size if sliding_window_size is not None else -1
    qo = qo_indptr.tolist()
    kvp = kv_indptr[: batch + 1].tolist()
    use_mask = custom_mask is not None
    mask_starts = mask_indptr[:batch].tolist() if use_mask else None
    window_offsets = (
        window_kv_offsets[:batch].tolist()
        if use_mask and window > 0 and window_kv_offsets is not None
        else [0] * batch
    )

    for b in range(batch):
        q_start, rows = qo[b], qo[b + 1] - qo[b]
        if rows <= 0:
            continue
        prefix_len = kvp[b + 1] - kvp[b]
        query = torch.arange(rows, device=device)
        if use_mask:
            offset = window_offsets[b]
            mask = extend_rows(custom_mask, mask_starts[b], rows, prefix_len + rows + offset)[
                :, offset:
            ]
        keys, values, allowed = [], [], []
        if not skip_prefix and prefix_len > 0:
            if identity_kv_indices:
                loc = torch.arange(kvp[b], kvp[b + 1], device=device)
            else:
                loc = kv_indices[kvp[b] : kvp[b + 1]].long()
            keys.append(head_major(k_buffer, loc, dim) * k_scale)
            values.append(head_major(v_buffer, loc, dim_v) * v_scale)
            allow = torch.ones(rows, prefix_len, dtype=torch.bool, device=device)
            if use_mask and not skip_prefix_custom_mask:
                allow &= mask[:, :prefix_len]
            if window > 0:
                pos = torch.arange(prefix_len, device=device)
                allow &= (prefix_len + query[:, None]) <= (pos[None, :] + window)
            allowed.append(allow)
        if not skip_extend:
            q_end = q_start + rows
            keys.append(k_extend[q_start:q_end, :, :dim].float().transpose(0, 1))
            values.append(v_extend[q_start:q_end, :, :dim_v].float().transpose(0, 1))
            if use_mask:
                allow = mask[:, prefix_len : prefix_len + rows].clone()
            elif is_causal:
                allow = query[:, None] >= query[None, :]
            else:
                allow = torch.ones(rows, rows, dtype=torch.bool, device=device)
            if window > 0:
                allow &= query[:, None] <= query[None, :] + window
                if not is_causal:
                    allow &= query[None, :] <= query[:, None] + window
            allowed.append(allow)

        q = q_extend[q_start : q_start + rows, :, :dim].float()
        heads = q.shape[1]
        if keys:
            k, v = torch.cat(keys, dim=1), torch.cat(values, dim=1)
            allow = torch.cat(allowed, dim=1)
        else:
            k = q.new_zeros(kv_heads, 0, dim)
            v = q.new_zeros(kv_heads, 0, dim_v)
            allow = torch.zeros(rows, 0, dtype=torch.bool, device=device)
        temperature = None
        if xai_temperature_len > 0:
            temperature = xai_log_scale(prefix_len + query, xai_temperature_len)
        weighted, row_max, deno = masked_attention(
            q, k, v, allow, sm_scale, logit_cap, sinks, temperature
        )
        no_kv = deno == 0.0
        out = weighted / torch.where(no_kv, 1.0, deno).T[..., None]
        o_extend[q_start : q_start + rows, :heads, :dim_v] = out.to(o_extend.dtype)
        if lse_extend is not None:
            lse = torch.where(no_kv, float("-inf"), torch.log(deno) + row_max)
            lse_extend[q_start : q_start + rows, :heads] = lse.T


# The hooked name takes SGLang's parameters exactly (``function_hooks.same_parameters``):
# those of the reference, which it hands any call the batched pass does not cover.
EXTEND_PARAMETERS = inspect.signature(extend_per_request)
# The arguments the batched pass takes as they come.
UNIFORM_PASSED_ON = (
    "q_extend k_extend v_extend o_extend k_buffer v_buffer kv_indptr kv_indices is_causal "
    "k_scale v_scale logit_cap sinks lse_extend"
).split()


def extend_attention_fwd(*args, **kwargs):
    """Prefix + extend attention, as SGLang's Triton ``extend_attention_fwd`` (arguments:
    :func:`extend_per_request`). Requests that all extend by the same number of rows over
    their whole prefix (a verify, a speculative worker's plain step, a draft extend) run as
    one batch (:func:`~sglang_ecospec_cpu.extend_batched.extend_uniform`); anything else runs
    request by request."""
    call = EXTEND_PARAMETERS.bind(*args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    batch = a["qo_indptr"].shape[0] - 1
    window = a["sliding_window_size"] if a["sliding_window_size"] is not None else -1
    rows = uniform_rows(a["qo_indptr"].tolist())
    custom_mask = a["custom_mask"]
    if (
        not rows
        or window > 0
        or a["xai_temperature_len"] > 0
        or a["skip_prefix"]
        or a["skip_extend"]
        or a["identity_kv_indices"]
        or not (custom_mask is None or a["skip_prefix_custom_mask"])
    ):
        extend_per_request(*args, **kwargs)
        return
    extend_uniform(
        **{name: a[name] for name in UNIFORM_PASSED_ON},
        rows=rows,
        batch=batch,
        custom_mask=custom_mask,
        mask_starts=None if custom_mask is None else a["mask_indptr"][:batch].long(),
        sm_scale=a["sm_scale"] or 1.0 / a["q_extend"].shape[-1] ** 0.5,
    )


extend_attention_fwd.__signature__ = EXTEND_PARAMETERS


def extend_fallback_reason(q_extend, k_buffer, v_buffer, score_mod=None, **_) -> str | None:
    """Why :func:`extend_attention_fwd` does not cover a call (None: it does)."""
    return extend_uncovered(q_extend, k_buffer, v_buffer, score_mod)


# --- installation -------------------------------------------------------------------------

# hook target -> (PyTorch version, its fallback predicate)
KERNELS = {
    DECODE_TARGET: (decode_attention_fwd, decode_fallback_reason),
    EXTEND_TARGET: (extend_attention_fwd, extend_fallback_reason),
    EXTEND_UNIFIED_TARGET: (extend_attention_fwd_unified, extend_unified_fallback_reason),
}


def register_hooks() -> list[str]:
    """Registers the PyTorch versions as AROUND hooks on SGLang's Triton kernel functions
    (applied by SGLang's ``HookRegistry.apply_hooks`` after plugin loading; the Triton
    backend binds the kernels in ``TritonAttnBackend.__init__``, after that). A kernel whose
    parameters differ from ours (another SGLang version) keeps its Triton version. Returns
    the targets hooked."""
    return register_function_hooks(KERNELS)
