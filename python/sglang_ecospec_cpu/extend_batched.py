"""Extend attention in one batched pass, for batches whose requests all extend by the same
number of rows: a target verify (D tree rows per request), the plain decoding step of a
speculative worker (one row per request) and a draft extend.

:func:`sglang_ecospec_cpu.attention.extend_attention_fwd` runs a few tensor operations per
request; at one row per request that per-request loop costs more than the work (about 25
small ops per request and layer), which made a speculative server's plain steps slower than
a plain server's batched decode. Here the requests' prefixes are padded to the longest one,
so the whole batch is a handful of batched matmuls. The per-request loop stays the reference
(and serves every case this one does not cover: sliding windows, the xai temperature, skipped
key sets, a custom mask over the prefix, uneven rows); the tests compare the two.

Shape legend: as :mod:`sglang_ecospec_cpu.attention`; B = requests, E = rows of each, P =
the longest prefix, N = P + E keys per row.
"""

import torch

from sglang_ecospec_cpu.attention_math import MASKED_ROW_MAX, cap_logits, head_major


def uniform_rows(qo: list[int]) -> int:
    """E when every request of ``qo`` (the host copy of ``qo_indptr``) has E >= 1 rows,
    else 0."""
    if len(qo) < 2:
        return 0
    rows = qo[1] - qo[0]
    if rows <= 0 or any(qo[b + 1] - qo[b] != rows for b in range(len(qo) - 1)):
        return 0
    return rows


def extend_uniform(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    rows: int,
    batch: int,
    custom_mask: torch.Tensor | None,
    mask_starts: torch.Tensor | None,
    is_causal: bool,
    sm_scale: float,
    k_scale: float,
    v_scale: float,
    logit_cap: float,
    sinks: torch.Tensor | None,
    lse_extend: torch.Tensor | None,
) -> None:
    """``extend_attention_fwd`` for ``batch`` requests of ``rows`` (E) rows each, request b's
    rows ``b * E : (b + 1) * E``, over its whole prefix and its own keys.

    q_extend: [>= B*E, H, D]; k_extend: [>= B*E, Hkv, D], v_extend: [>= B*E, Hkv, Dv];
    o_extend: [>= B*E, H, Dv], written; k_buffer/v_buffer: [slots, Hkv, D/Dv] the KV pool;
    kv_indptr: int [>= B+1], kv_indices: int (request b's prefix slots); custom_mask:
    int8/bool flat or None, mask_starts: int64 [B] (request b's E rows of ``P_b + E`` cells,
    only the own-key cells read); lse_extend: [>= B*E, H] fp32 or None, written.
    """
    dim, dim_v = q_extend.shape[-1], v_extend.shape[-1]
    kv_heads = k_extend.shape[1]
    heads = q_extend.shape[1]
    group = heads // kv_heads
    device = q_extend.device
    tokens = batch * rows

    indptr = kv_indptr[: batch + 1].long()
    prefix = indptr[1:] - indptr[:-1]  # [B]
    width = int(prefix.max())
    pos = torch.arange(width, device=device)
    valid = pos[None, :] < prefix[:, None]  # [B, P]
    loc = torch.zeros(batch, width, dtype=torch.long, device=device)
    if width > 0:
        loc = torch.where(valid, kv_indices[torch.where(valid, indptr[:-1, None] + pos, 0)], 0)
        loc = loc.long()
    # The prefix and the own keys are scored and weighed apart (the scales applied to the
    # small score and output tensors): concatenating the gathered keys and values, or scaling
    # them, would copy the whole prefix once more.
    prefix_keys = head_major(k_buffer, loc, dim)  # [Hkv, B, P, D]
    prefix_values = head_major(v_buffer, loc, dim_v)  # [Hkv, B, P, Dv]
    own_keys = k_extend[:tokens, :, :dim].float().view(batch, rows, kv_heads, dim)
    own_keys = own_keys.permute(2, 0, 3, 1)  # [Hkv, B, D, E]
    own_values = v_extend[:tokens, :, :dim_v].float().view(batch, rows, kv_heads, dim_v)
    own_values = own_values.permute(2, 0, 1, 3)  # [Hkv, B, E, Dv]

    row = torch.arange(rows, device=device)
    if custom_mask is not None:
        cells = (prefix + rows)[:, None, None] * row[None, :, None] + row[None, None, :]
        own = custom_mask[mask_starts[:, None, None] + prefix[:, None, None] + cells] != 0
    elif is_causal:
        own = (row[:, None] >= row[None, :]).expand(batch, rows, rows)
    else:
        own = torch.ones(batch, rows, rows, dtype=torch.bool, device=device)
    allow = torch.cat([valid[:, None, :].expand(batch, rows, width), own], 2)  # [B, E, N]

    q = q_extend[:tokens, :, :dim].float().view(batch, rows, kv_heads, group, dim)
    q = q.permute(2, 0, 3, 1, 4).reshape(kv_heads, batch, group * rows, dim)
    scores = torch.cat(
        [
            torch.matmul(q, prefix_keys.transpose(2, 3)) * (sm_scale * k_scale),
            torch.matmul(q, own_keys) * sm_scale,
        ],
        -1,
    ).view(kv_heads, batch, group, rows, width + rows)
    scores = cap_logits(scores, logit_cap)
    scores = scores.masked_fill(~allow[None, :, None], float("-inf"))  # [Hkv, B, G, E, N]
    row_max = scores.amax(-1).clamp_min(MASKED_ROW_MAX)
    p = torch.exp(scores - row_max[..., None])
    deno = p.sum(-1)  # [Hkv, B, G, E]
    if sinks is not None:
        deno = deno + torch.exp(sinks.float().view(kv_heads, 1, group, 1) - row_max)
    no_kv = deno == 0.0
    p = p.view(kv_heads, batch, group * rows, width + rows)
    out = torch.matmul(p[..., :width], prefix_values) * v_scale
    out = out + torch.matmul(p[..., width:], own_values)
    out = out.view(kv_heads, batch, group, rows, dim_v) / torch.where(no_kv, 1.0, deno)[..., None]
    # [Hkv, B, G, E, Dv] -> [B, E, Hkv, G, Dv]: head h = kv_head * G + g, as the kernels
    o_extend[:tokens, :heads, :dim_v] = (
        out.permute(1, 3, 0, 2, 4).reshape(tokens, heads, dim_v).to(o_extend.dtype)
    )
    if lse_extend is not None:
        lse = torch.where(no_kv, float("-inf"), torch.log(deno) + row_max)
        lse_extend[:tokens, :heads] = lse.permute(1, 3, 0, 2).reshape(tokens, heads)
