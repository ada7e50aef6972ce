"""SGLang's Triton ``extend_attention_fwd_unified`` (the deterministic-mode extend: one KV
list per request, prefix and new keys together) in plain PyTorch, for the CPU development
mode (:mod:`sglang_ecospec_cpu.attention` installs it). Shape legend: as that module.
"""

import torch

from sglang_ecospec_cpu.attention_math import (
    extend_rows,
    extend_uncovered,
    head_major,
    masked_attention,
)


def extend_attention_fwd_unified(
    q,
    o,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    qo_indptr,
    kv_indptr,
    kv_indices,
    prefix_lens,
    max_len_extend,
    custom_mask=None,
    mask_indptr=None,
    sm_scale=None,
    logit_cap=0.0,
    is_causal=True,
    sliding_window_size=-1,
    sinks=None,
    window_start_pos=None,
    xai_temperature_len=-1,
    page_size: int = 1,
    score_mod=None,
    aux_tensors=None,
):
    """One-list extend attention, as SGLang's Triton ``extend_attention_fwd_unified``.

    q: [T, H, D]; o: [T, H, Dv] output, written. Request b's queries are rows
    ``qo_indptr[b]:qo_indptr[b+1]`` (E), its N keys the pool slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` (prefix first, then the E new ones; the
    first ``prefix_lens[b]`` are prefix). Scores ``q.k * sm_scale * k_scale``, output times
    ``v_scale``. Masks: ``custom_mask`` (request b's E x N cells from ``mask_indptr[b]``),
    else causal over the new keys (``is_causal``), else none; ``sliding_window_size`` > 0
    with ``window_start_pos`` [B] (absolute position of key 0; 0 when None) keeps keys
    within the window. A row with no key gives NaN, as in the kernel (0 / 0).
    """
    del max_len_extend, page_size
    dim, dim_v = q.shape[-1], v_buffer.shape[-1]
    sm_scale = sm_scale or 1.0 / dim**0.5
    batch = qo_indptr.shape[0] - 1
    device = q.device
    window = sliding_window_size if sliding_window_size is not None else -1
    qo = qo_indptr.tolist()
    kvp = kv_indptr[: batch + 1].tolist()
    prefixes = prefix_lens[:batch].tolist()
    use_mask = custom_mask is not None
    mask_starts = mask_indptr[:batch].tolist() if use_mask else None
    starts = (
        window_start_pos[:batch].tolist()
        if window > 0 and window_start_pos is not None
        else [0] * batch
    )

    for b in range(batch):
        q_start, rows = qo[b], qo[b + 1] - qo[b]
        if rows <= 0:
            continue
        n_keys, prefix_len = kvp[b + 1] - kvp[b], prefixes[b]
        loc = kv_indices[kvp[b] : kvp[b + 1]].long()
        query = torch.arange(rows, device=device)
        pos = torch.arange(n_keys, device=device)
        if use_mask:
            allow = extend_rows(custom_mask, mask_starts[b], rows, n_keys)
        elif is_causal:
            allow = (pos[None, :] < prefix_len) | (pos[None, :] - prefix_len <= query[:, None])
        else:
            allow = torch.ones(rows, n_keys, dtype=torch.bool, device=device)
        if window > 0:
            q_pos = starts[b] + prefix_len + query[:, None]
            k_pos = starts[b] + pos[None, :]
            allow = allow & (q_pos <= k_pos + window)
            if not is_causal:
                allow = allow & (k_pos <= q_pos + window)

        qb = q[q_start : q_start + rows, :, :dim].float()
        heads = qb.shape[1]
        k = head_major(k_buffer, loc, dim)
        v = head_major(v_buffer, loc, dim_v)
        temperature = None
        if xai_temperature_len > 0:  # this kernel's own scale, unlike the others' log2
            q_index = (prefix_len + query).float()
            temperature = torch.where(
                q_index < xai_temperature_len,
                torch.ones_like(q_index),
                xai_temperature_len / (q_index + 1.0),
            )
        weighted, _, deno = masked_attention(
            qb, k, v, allow, sm_scale * k_scale, logit_cap, sinks, temperature
        )
        out = weighted / deno.T[..., None] * v_scale
        o[q_start : q_start + rows, :heads, :dim_v] = out.to(o.dtype)


def extend_unified_fallback_reason(q, k_buffer, v_buffer, score_mod=None, **_) -> str | None:
    """Why :func:`extend_attention_fwd_unified` does not cover a call (None: it does)."""
    return extend_uncovered(q, k_buffer, v_buffer, score_mod)
