"""Stage "moe" of the device check: the verify-MoE Triton kernel timed by CUDA-graph replay
at the layer shapes of Qwen3-235B-A22B (TP1, TP4, TP8: I = 1536, 384, 192), Qwen3-30B-A3B
and DeepSeek-V3 (the last: E x 2I x H = 7.5e9 elements, past 2^31), bf16, for 1-64 tokens
and controlled numbers of unique experts; each row against the reference (max relative
error) and against two ceilings measured here: the device-to-device copy (bytes read plus
written per second) and a read-only pass (a sum), since the kernel's traffic is weight
reads. Then MoESD's expert-cost terms fitted to the Qwen3-235B TP1 rows. Writes moe.json
row by row. A dry run: a tiny fp32 layer under Triton's interpreter, host-clock timings.
"""

import math

import common
import torch

from sgl_ecospec.costmodel.formulas import roofline_transition
from sgl_ecospec.ops.verify_moe import verify_moe, verify_moe_reference

# name: (hidden, moe intermediate, experts, experts per token)
SHAPES = {
    "qwen3-235b-a22b-tp1": (4096, 1536, 128, 8),
    "qwen3-235b-a22b-tp4": (4096, 384, 128, 8),
    "qwen3-235b-a22b-tp8": (4096, 192, 128, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}
TINY_SHAPES = {"tiny": (64, 32, 16, 4)}
# tokens: unique experts to route them to
UNIQUE = {1: [8], 4: [8, 16, 32], 16: [16, 32, 64, 128], 64: [32, 64, 128, 256]}
TINY_UNIQUE = {1: [4], 4: [4, 8, 16]}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
RIDGE = 206.0  # H200 bf16 FLOP per byte (docs/costmodel.md): the scale of G's knee


def routing_with_unique(tokens: int, top_k: int, unique: int, experts: int, gen) -> torch.Tensor:
    """int64 ``[tokens, top_k]``: distinct experts per token, exactly ``unique`` in all."""
    pool = torch.randperm(experts, generator=gen)[:unique]
    slots = torch.arange(tokens * top_k)
    # Token t takes pool entries t*K .. t*K+K-1 (mod unique): distinct within a token since
    # K <= unique, and every pool entry is used once tokens * K >= unique.
    return pool[(slots % unique)].view(tokens, top_k)


def ceilings(device, nbytes: int, repeats: int) -> dict:
    """Bytes per second of a device-to-device copy (read plus written) and of a sum (read)."""
    src = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy = common.median_us(lambda: dst.copy_(src), device, repeats) * 1e-6
    read = common.median_us(lambda: src.sum(dtype=torch.float32), device, repeats) * 1e-6
    return dict(copy_read_write=2 * nbytes / copy, read_only=nbytes / read)


def time_call(fn, device, repeats) -> float:
    """Microseconds per call: CUDA-graph replay on a GPU, the host clock in a dry run."""
    if device.type == "cuda":
        return common.replay_median_us(fn, repeats)
    return common.host_median_us(fn, repeats)


def bench_shape(record, device, name, shape, dry_run, repeats):
    hidden, inter, experts, top_k = shape
    dtype = torch.float32 if dry_run else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, generator=gen)
    w13 = (w13 / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device, generator=gen) / inter**0.5).to(dtype)
    expert_bytes = 3 * hidden * inter * w13.element_size()
    cpu_gen = torch.Generator().manual_seed(1)
    for tokens, uniques in (TINY_UNIQUE if dry_run else UNIQUE).items():
        x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
        bitmap = torch.zeros((experts + 63) // 64, dtype=torch.int64, device=device)
        for unique in uniques:
            if unique > min(experts, tokens * top_k):
                continue
            ids = routing_with_unique(tokens, top_k, unique, experts, cpu_gen).to(device)
            weights = torch.rand(tokens, top_k, device=device, generator=gen)

            def call(x=x, ids=ids, weights=weights, bitmap=bitmap):
                return verify_moe(x, w13, w2, ids, weights, bitmap_out=bitmap, impl="triton")

            out = call()[0].float()
            ref, ref_step = verify_moe_reference(x, w13, w2, ids, weights)
            error = float((out - ref.float()).abs().max() / ref.float().abs().max())
            kernel_us = time_call(call, device, repeats)
            row = dict(
                shape=name, hidden=hidden, inter=inter, experts=experts, top_k=top_k,
                tokens=tokens, unique_experts=unique, kernel_us=kernel_us,
                weight_bytes=unique * expert_bytes,
                weight_bytes_per_s=unique * expert_bytes / (kernel_us * 1e-6), rel_error=error,
                bitmap_ok=bool(torch.equal(bitmap, ref_step)),
            )  # fmt: skip
            ok = row["bitmap_ok"] and error <= TOLERANCE[dtype]
            record.add(row, ok=ok, failure=f"verify_moe differs from the reference: {row}")
            print(
                f"moe {name:20} T={tokens:3} U={unique:4} {kernel_us:9.1f} us "
                f"{row['weight_bytes_per_s'] / 1e12:6.3f} TB/s err {error:.1e} ok={ok}",
                flush=True,
            )


def fit_expert_cost(rows, top_k, ridge_tokens):
    """Fits the expert terms of MoESD's verify time to the kernel timings:
    t = bias + k2 N + k3 G(T K / N; lam RP, s), N = unique experts, T = tokens."""
    from scipy.optimize import least_squares

    tokens = [r["tokens"] for r in rows]
    unique = [r["unique_experts"] for r in rows]
    seconds = [r["kernel_us"] * 1e-6 for r in rows]

    def predict(p, t, n):
        bias, k2, k3, lam, s = p
        return bias + k2 * n + k3 * roofline_transition(t * top_k / n, lam * ridge_tokens, s)

    def residuals(p):
        return [predict(p, t, n) / y - 1 for t, n, y in zip(tokens, unique, seconds, strict=True)]

    start = [min(seconds) / 2, (max(seconds) - min(seconds)) / max(1, max(unique)), 1e-6, 1.0, 1.01]
    fit = least_squares(
        residuals, start, bounds=([0, 0, 0, 0.2, 1.0], [1, 1, 1, 1.0, 2.0]), x_scale="jac"
    )
    names = ["bias", "k2", "k3", "lam", "s"]
    return dict(
        params=dict(zip(names, fit.x.tolist(), strict=True)),
        residuals=[float(r) for r in fit.fun],
        rms_residual=math.sqrt(sum(r * r for r in fit.fun) / len(fit.fun)),
    )


def main(argv=None) -> int:
    args = common.parse_args(__doc__.splitlines()[0], argv)
    device = common.stage_device(args.dry_run)
    record = common.StageRecord(args.out, "moe", args.dry_run)
    repeats = 3 if args.dry_run else 20
    measured = ceilings(device, (1 << 20) if args.dry_run else (4 << 30), repeats)
    record.info(ceilings=measured, device=str(device))
    print(f"ceilings (bytes/s): {measured}", flush=True)
    for name, shape in (TINY_SHAPES if args.dry_run else SHAPES).items():
        bench_shape(record, device, name, shape, args.dry_run, repeats)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first = next(iter(TINY_SHAPES if args.dry_run else SHAPES))
    rows = [r for r in record.data["rows"] if r["shape"] == first]
    if len(rows) >= 6:
        record.info(fit=fit_expert_cost(rows, rows[0]["top_k"], RIDGE), fit_shape=first)
    return record.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
