"""GPU timings for the device check (scripts/gpu_check.sh): selection ops and the verify-MoE
kernel, with CUDA events and medians, plus the MoESD expert-cost fit of the kernel timings,
and the CUDA-graph check of the selection op and the online predictor.

    python3 scripts/gpu_bench.py --out $OUT                  # on the GPU machine
    TRITON_INTERPRET=1 python3 scripts/gpu_bench.py --tiny --device cpu --out /tmp/x
                                                              # logic check on a CPU

Writes gpu_bench.json, graph_check.json and h200.md (a table with the date and device) into
--out. Selection: scripts/gpu_bench_selection.py; graphs: scripts/gpu_graph_check.py. The
verify-MoE rows give the kernel's max relative error against the PyTorch reference (max
|kernel - reference| / max |reference|) and fail the run above
``gpu_graph_check.verify_moe_tolerance`` (2e-2 in bf16).
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench_selection  # noqa: E402
import gpu_graph_check  # noqa: E402

from sgl_ecospec.costmodel.formulas import roofline_transition  # noqa: E402
from sgl_ecospec.ops.verify_moe import verify_moe, verify_moe_reference  # noqa: E402


def median_time(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()``: CUDA events on a GPU, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def routing_with_unique(tokens: int, top_k: int, unique: int, experts: int, gen) -> torch.Tensor:
    """int64 ``[tokens, top_k]``: distinct experts per token, exactly ``unique`` in all."""
    pool = torch.randperm(experts, generator=gen)[:unique]
    slots = torch.arange(tokens * top_k)
    # Token t takes pool entries t*K .. t*K+K-1 (mod unique): distinct within a token since
    # K <= unique, and every pool entry is used once tokens * K >= unique.
    return pool[(slots % unique)].view(tokens, top_k)


def copy_bandwidth(device, nbytes, repeats):
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read (as the MoE
    kernel's weight traffic is reads)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), device, repeats)
    return nbytes / seconds


def bench_verify_moe(device, repeats, tiny):
    if tiny:
        hidden, inter, experts, top_k, dtype = 64, 32, 16, 4, torch.float32
        token_counts, uniques = [1, 4], [4, 8, 16]
    else:
        hidden, inter, experts, top_k, dtype = 4096, 1536, 128, 8, torch.bfloat16
        token_counts, uniques = [1, 4, 8, 16, 32, 64], [8, 16, 24, 32, 48, 64, 96, 128]
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    w13, w2 = w13.to(device), w2.to(device)
    expert_bytes = 3 * hidden * inter * w13.element_size()
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
        for unique in uniques:
            if unique < top_k or unique > min(experts, tokens * top_k):
                continue
            ids = routing_with_unique(tokens, top_k, unique, experts, gen).to(device)
            weights = torch.rand(tokens, top_k, generator=gen).to(device)
            out, step = verify_moe(x, w13, w2, ids, weights, impl="triton")
            ref, ref_step = verify_moe_reference(x, w13, w2, ids, weights)
            error = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
            kernel = median_time(
                lambda ids=ids, weights=weights, x=x: verify_moe(
                    x, w13, w2, ids, weights, impl="triton"
                ),
                device,
                repeats,
            )
            reference = median_time(
                lambda ids=ids, weights=weights, x=x: verify_moe_reference(
                    x, w13, w2, ids, weights
                ),
                device,
                max(3, repeats // 5),
            )
            row = dict(
                tokens=tokens,
                unique_experts=unique,
                kernel_us=kernel * 1e6,
                reference_us=reference * 1e6,
                bytes=unique * expert_bytes,
                bandwidth=unique * expert_bytes / kernel,
                rel_error=error,
                bitmap_ok=bool(torch.equal(step.cpu(), ref_step.cpu())),
            )
            rows.append(row)
            print(
                f"moe T={tokens:3} U={unique:4} kernel {kernel * 1e6:9.1f} us "
                f"({row['bandwidth'] / 1e12:6.3f} TB/s) reference {reference * 1e6:9.1f} us "
                f"err {error:.1e} bitmap={row['bitmap_ok']}",
                flush=True,
            )
    shape = dict(
        hidden=hidden,
        inter=inter,
        experts=experts,
        top_k=top_k,
        dtype=str(dtype),
        expert_bytes=expert_bytes,
    )
    tolerance = gpu_graph_check.verify_moe_tolerance(dtype)
    for row in rows:
        row["within_tolerance"] = row["rel_error"] <= tolerance
    return shape, rows, tolerance


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


def write_markdown(path, device_name, result):
    sel = result["selection"]
    moe = result["verify_moe"]
    lines = [
        f"# Device check: {device_name}",
        "",
        f"Date: {result['date']}. Command: `bash scripts/gpu_check.sh` (scripts/gpu_bench.py).",
        f"torch {result['torch']}, CUDA events, medians of {result['repeats']} runs.",
        "",
    ]
    lines += gpu_bench_selection.markdown(sel)
    lines += [
        "",
        f"## Verify MoE kernel ({moe['shape']})",
        "",
        f"Device-to-device copy bandwidth (bytes read / time): "
        f"{result['copy_bandwidth'] / 1e12:.3f} TB/s.",
        "",
        f"Max relative error against the PyTorch reference (max |kernel - reference| / "
        f"max |reference|, {moe['shape']['dtype']}): {moe['max_rel_error']:.1e}; tolerance "
        f"{moe['tolerance']:.0e}: {'passed' if moe['passed'] else 'FAILED'}.",
        "",
        "| tokens | unique experts | kernel (us) | TB/s | % of copy | reference (us) | "
        "rel. error | bitmap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['tokens']} | {r['unique_experts']} | {r['kernel_us']:.1f} | "
        f"{r['bandwidth'] / 1e12:.3f} | {100 * r['bandwidth'] / result['copy_bandwidth']:.0f}"
        f" | {r['reference_us']:.1f} | {r['rel_error']:.1e} | {r['bitmap_ok']} |"
        for r in moe["rows"]
    ]
    fit = result["fit"]
    lines += [
        "",
        "## MoESD expert-cost fit to the kernel timings",
        "",
        "t = bias + k2 N + k3 G(T K / N); "
        + ", ".join(f"{k} = {v:.4g}" for k, v in fit["params"].items())
        + f"; relative residual rms {100 * fit['rms_residual']:.2f}%, max "
        f"{100 * max(abs(r) for r in fit['residuals']):.2f}%.",
        "",
    ]
    lines += [
        "## CUDA graphs: capture once, change the inputs in place, replay",
        "",
        "Each replay equals an eager call on the new state (and the selection the reference, "
        "the verify MoE the reference within its tolerance, its bitmap buffer exactly).",
        "",
        "| captured | replay equals eager | output followed the new inputs |",
        "|---|---|---|",
    ]
    lines += [
        f"| {r['check']} | {r['ok']} | {r['inputs_changed_output']} |" for r in result["graphs"]
    ]
    lines += [
        "",
        *(
            f"{r['check']}: replay against the reference, max relative error "
            f"{r['rel_error']:.1e} (tolerance {r['tolerance']:.0e})."
            for r in result["graphs"]
            if "rel_error" in r
        ),
    ]
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small sizes, for a CPU check")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no GPU visible; use --device cpu --tiny for a logic check", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    batches = [1, 2] if args.tiny else [1, 8, 32, 64]
    selection = gpu_bench_selection.bench_selection(device, batches, args.repeats, args.tiny)
    graphs = gpu_graph_check.run_checks(device, args.tiny or device.type == "cpu")
    shape, moe_rows, tolerance = bench_verify_moe(device, args.repeats, args.tiny)
    bandwidth = copy_bandwidth(device, (1 << 20) if args.tiny else (4 << 30), args.repeats)
    ridge = 206.0  # H200 bf16 FLOP per byte (docs/costmodel.md); used as G's knee scale
    result = dict(
        date=time.strftime("%Y-%m-%d"),
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        repeats=args.repeats,
        selection=selection,
        graphs=graphs,
        verify_moe=dict(
            shape=shape,
            rows=moe_rows,
            tolerance=tolerance,
            max_rel_error=max(r["rel_error"] for r in moe_rows),
            passed=all(r["within_tolerance"] for r in moe_rows),
        ),
        copy_bandwidth=bandwidth,
        fit=fit_expert_cost(moe_rows, shape["top_k"], ridge),
    )
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=2))
    (args.out / "graph_check.json").write_text(json.dumps(graphs, indent=2))
    write_markdown(args.out / "h200.md", result["device"], result)
    print(f"wrote {args.out / 'gpu_bench.json'} and {args.out / 'h200.md'}")
    failures = [r for r in selection if not r["matches_reference"]]
    failures += [r for r in moe_rows if not (r["bitmap_ok"] and r["within_tolerance"])]
    failures += gpu_graph_check.failures(graphs)
    if failures:
        print(
            f"error: {len(failures)} results disagree with the reference or the eager call: "
            f"{failures}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
