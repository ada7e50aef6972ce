"""The tensor pieces the PyTorch attention kernels share (:mod:`sglang_ecospec_cpu.attention`):
logit cap, xai temperature scale, head-major gathers, grouped-query products, softmax with
sinks, one request's masked attention. Shape legend: as :mod:`sglang_ecospec_cpu.attention`.
"""

import math

import torch

# The extend kernels clamp a row's running max to this value once a tile was visited, so
# a row whose keys are all masked has a finite max (its weights are exp(-inf) = 0).
MASKED_ROW_MAX = -1e20


def cap_logits(scores: torch.Tensor, logit_cap: float) -> torch.Tensor:
    """The kernels' soft cap ``cap * tanh(s / cap)``, when ``logit_cap > 0``."""
    if logit_cap > 0:
        return logit_cap * torch.tanh(scores / logit_cap)
    return scores


def xai_log_scale(query_index: torch.Tensor, xai_temperature_len: int) -> torch.Tensor:
    """The decode/extend kernels' xai temperature: ``log2(i) / log2(len)`` for query
    positions ``i > len``, else 1. ``query_index``: int64, any shape."""
    scale = torch.log2(query_index.clamp_min(1).float()) / math.log2(xai_temperature_len)
    return torch.where(query_index > xai_temperature_len, scale, torch.ones_like(scale))


def head_major(buffer: torch.Tensor, loc: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``loc`` of a [slots, Hkv, >= dim] buffer, head-major: [Hkv, *loc.shape, dim] fp32.

    Gathering through the transposed view gives each KV head a contiguous key block, which
    the batched matmuls below read without another copy (about 2x faster than gathering
    [*loc.shape, Hkv, dim] and contracting with einsum)."""
    return buffer.transpose(0, 1)[:, loc, :dim].float()


def grouped_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Dot products of each query head with the keys of its KV head.

    q: [E, H, D] fp32 queries; k: [Hkv, N, D] fp32 keys. Returns [H, E, N] fp32."""
    e, h, d = q.shape
    kv_heads = k.shape[0]
    qh = q.view(e, kv_heads, h // kv_heads, d).permute(1, 2, 0, 3)
    qh = qh.reshape(kv_heads, h // kv_heads * e, d)
    return torch.matmul(qh, k.transpose(1, 2)).view(h, e, k.shape[1])


def grouped_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the values of each head's KV head.

    p: [H, E, N] fp32 weights; v: [Hkv, N, Dv] fp32. Returns [E, H, Dv] fp32."""
    h, e, n = p.shape
    kv_heads = v.shape[0]
    out = torch.matmul(p.reshape(kv_heads, h // kv_heads * e, n), v)
    return out.view(h, e, v.shape[2]).transpose(0, 1)


def softmax_parts(scores: torch.Tensor, sinks: torch.Tensor | None):
    """Row max (clamped like the kernels), unnormalised weights and denominator.

    scores: [H, E, N] fp32 with -inf at masked keys; sinks: [H] or None. Returns
    ``(row_max [H, E], p [H, E, N], deno [H, E])``; the sink adds ``exp(sink - max)``."""
    if scores.shape[-1] == 0:
        row_max = scores.new_full(scores.shape[:-1], MASKED_ROW_MAX)
    else:
        row_max = scores.amax(-1).clamp_min(MASKED_ROW_MAX)
    p = torch.exp(scores - row_max.unsqueeze(-1))
    deno = p.sum(-1)
    if sinks is not None:
        deno = deno + torch.exp(sinks.float()[:, None] - row_max)
    return row_max, p, deno


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allow: torch.Tensor,
    scale: float,
    logit_cap: float,
    sinks: torch.Tensor | None,
    temperature: torch.Tensor | None = None,
):
    """One request's attention over its gathered keys, left unnormalised so that each
    kernel divides as its Triton version does (a row without keys: 0 or NaN).

    q: [E, H, D] fp32; k: [Hkv, N, D], v: [Hkv, N, Dv] fp32; allow: [E, N] bool;
    temperature: [E] fp32 per-query factor on the capped scores, or None. Scores are
    ``q.k * scale``, soft-capped. Returns ``(weighted [E, H, Dv], row_max [H, E],
    deno [H, E])``: the output is ``weighted / deno``."""
    scores = cap_logits(grouped_scores(q, k) * scale, logit_cap)
    if temperature is not None:
        scores = scores * temperature[None, :, None]
    scores = scores.masked_fill(~allow[None], float("-inf"))
    row_max, p, deno = softmax_parts(scores, sinks)
    return grouped_values(p, v), row_max, deno


# --- decode -------------------------------------------------------------------------------


def extend_rows(custom_mask, start: int, rows: int, row_len: int) -> torch.Tensor:
    """Rows of one request's custom mask: [rows, row_len] bool, row-major from ``start``."""
    return custom_mask[start : start + rows * row_len].view(rows, row_len) != 0


def extend_uncovered(q, k_buffer, v_buffer, score_mod) -> str | None:
    """What the extend kernels' PyTorch versions do not cover (None: they do)."""
    if q.device.type != "cpu":
        return "tensors not on the CPU"
    if score_mod is not None:
        return "score_mod"
    if k_buffer.ndim != 3 or v_buffer.ndim != 3:
        return "KV buffer not [slots, heads, dim]"
    return None
