"""The ``sgl-ecospec costmodel`` command: predicted SD speedup per batch size and gamma.

Predictions come from the MoESD model fitted to the analytic roofline prior
(``performance.analytic_params``): an idealized GPU, not measurements.

With ``--adaptive-config FILE`` it also picks draft steps per batch-size bucket
(``selection_cost.adaptive_draft_steps``, one bucket per ``--batch`` value) and writes them
as SGLang's ``--speculative-adaptive-config`` JSON (``sglang_adaptive_config``); the report
lists, per bucket, the draft steps and the matching ``--speculative-num-draft-tokens``.
"""

import argparse
import json

from sgl_ecospec.costmodel import formulas
from sgl_ecospec.costmodel.performance import PerformanceModel, analytic_params
from sgl_ecospec.costmodel.profiles import (
    MODELS,
    dense_load_time,
    expert_load_time,
    get_hardware,
    get_model,
    ridge_tokens,
)
from sgl_ecospec.costmodel.selection_cost import adaptive_draft_steps, sglang_adaptive_config
from sgl_ecospec.lab.command_line import add_command, parse_positive_ints

_COLUMNS = (
    # (JSON key, header, format)
    ("batch", "batch", "{:>5d}"),
    ("gamma", "gamma", "{:>5d}"),
    ("tokens", "tokens", "{:>6d}"),
    ("unique_experts", "N(t)", "{:>6.1f}"),
    ("tokens_per_expert", "T_exp", "{:>6.2f}"),
    ("ar_ms", "ar_ms", "{:>7.3f}"),
    ("verify_ms", "verify_ms", "{:>9.3f}"),
    ("target_efficiency", "eff", "{:>5.3f}"),
    ("sigma", "sigma", "{:>5.3f}"),
    ("speedup", "speedup", "{:>7.3f}"),
)

HELP = "predict SD speedup on an MoE target (MoESD model, roofline prior)"
DESCRIPTION = (
    "Predicts speculative-decoding speedup per (batch, gamma) from the MoESD performance model "
    "fitted to first-principles roofline timings. These are model predictions, not measurements."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``costmodel`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = add_command(subparsers, "costmodel", run, HELP, DESCRIPTION)
    parser.add_argument("--model", default="qwen3-235b-a22b", help=f"one of: {', '.join(MODELS)}")
    parser.add_argument(
        "--hardware", default="h200", help="h100 or h200, optionally <n>x<name> (e.g. 8xh200)"
    )
    parser.add_argument("--batch", default="1,8,32,64", help="comma-separated batch sizes")
    parser.add_argument(
        "--gamma", default="1,2,4,8", help="comma-separated tokens verified per request"
    )
    parser.add_argument(
        "--accept-rate", type=float, default=0.7, help="per-token acceptance rate alpha"
    )
    parser.add_argument(
        "--tau", type=float, default=0.95, help="expert coverage for the saturation threshold"
    )
    parser.add_argument(
        "--adaptive-config",
        metavar="FILE",
        help="also pick draft steps per --batch bucket and write them as SGLang's "
        "--speculative-adaptive-config JSON",
    )
    parser.add_argument(
        "--max-draft-steps",
        type=int,
        default=7,
        help="most draft steps per bucket with --adaptive-config (default 7)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="FILE", help="also write a PNG plot")
    return parser


def build_report(args: argparse.Namespace) -> dict:
    """Everything ``run`` prints, as a JSON-ready dict; ValueError on bad arguments."""
    batches = parse_positive_ints(args.batch, "--batch")
    gammas = parse_positive_ints(args.gamma, "--gamma")
    if not 0 <= args.accept_rate <= 1:
        raise ValueError(f"--accept-rate must be in [0, 1], got {args.accept_rate}")
    if not 0 < args.tau < 1:
        raise ValueError(f"--tau must be in (0, 1), got {args.tau}")
    model, hardware = get_model(args.model), get_hardware(args.hardware)

    fit = analytic_params(model, hardware)
    perf = PerformanceModel(model, hardware, fit.params)
    rows = []
    for batch in batches:
        for gamma in gammas:
            tokens = batch * gamma
            unique = formulas.expected_unique_experts(tokens, model.num_experts, model.top_k)
            rows.append(
                {
                    "batch": batch,
                    "gamma": gamma,
                    "tokens": tokens,
                    "unique_experts": unique,
                    "tokens_per_expert": formulas.tokens_per_expert(tokens, model.rho),
                    "ar_ms": 1e3 * perf.ar_time(batch),
                    "verify_ms": 1e3 * perf.verify_time(batch, gamma),
                    "draft_ms": 1e3 * perf.draft_time(batch),
                    "target_efficiency": perf.target_efficiency(batch, gamma),
                    "sigma": formulas.acceptance_factor(args.accept_rate, gamma),
                    "speedup": perf.sd_speedup(batch, gamma, args.accept_rate),
                }
            )
    report = {
        "note": "model predictions (MoESD model fitted to a roofline prior), not measurements",
        "model": {
            "name": model.name,
            "moe_layers": model.moe_layers,
            "num_experts": model.num_experts,
            "top_k": model.top_k,
            "bytes_per_expert": model.bytes_per_expert,
            "dense_params": model.dense_params,
            "dense_bytes": model.dense_bytes,
            "compute_dtype": model.compute_dtype,
        },
        "hardware": {
            "name": hardware.name,
            "memory_bandwidth": hardware.memory_bandwidth,
            "peak_bf16_flops": hardware.peak_bf16_flops,
            "peak_fp8_flops": hardware.peak_fp8_flops,
            "ridge_tokens": ridge_tokens(model, hardware),
        },
        "knee_tokens": perf.knee,
        "dense_load_seconds": dense_load_time(model, hardware),
        "expert_load_seconds": expert_load_time(model, hardware),
        "tau": args.tau,
        "saturation_threshold": formulas.saturation_threshold(
            model.num_experts, model.top_k, args.tau
        ),
        "accept_rate": args.accept_rate,
        "params": fit.params.as_dict(),
        "fit": {
            "points": len(fit.points),
            "rms_relative_residual": fit.rms_residual,
            "max_abs_relative_residual": fit.max_abs_residual,
        },
        "rows": rows,
    }
    if args.adaptive_config:
        report["adaptive"] = adaptive_buckets(perf, batches, args.accept_rate, args.max_draft_steps)
    return report


def adaptive_buckets(perf: PerformanceModel, batches: list[int], accept_rate: float, max_steps):
    """Draft steps per batch-size bucket and SGLang's adaptive config (JSON-ready)."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"--max-draft-steps must be an int >= 1, got {max_steps}")
    steps = adaptive_draft_steps(perf, batches, accept_rate, max_steps)
    return {
        "max_draft_steps": max_steps,
        "buckets": [
            {"batch": batch, "draft_steps": k, "num_draft_tokens": k + 1}
            for batch, k in sorted(steps.items())
        ],
        "sglang_adaptive_config": sglang_adaptive_config(steps),
    }


def format_report(report: dict) -> str:
    """The human-readable header and table for a ``build_report`` dict."""
    m, hw, fit = report["model"], report["hardware"], report["fit"]
    params = "  ".join(f"{name}={value:.4g}" for name, value in report["params"].items())
    lines = [
        f"# {report['note']}",
        f"model      {m['name']}: {m['moe_layers']} MoE layers, E={m['num_experts']}, "
        f"K={m['top_k']}, {m['bytes_per_expert'] / 1e6:.2f} MB/expert, dense "
        f"{m['dense_params'] / 1e9:.3f}e9 params ({m['dense_bytes'] / 1e9:.2f} GB), "
        f"compute {m['compute_dtype']}",
        f"hardware   {hw['name']}: {hw['memory_bandwidth'] / 1e12:.2f} TB/s, "
        f"{hw['peak_bf16_flops'] / 1e12:.1f} TFLOP/s bf16, "
        f"{hw['peak_fp8_flops'] / 1e12:.1f} TFLOP/s fp8, ridge point "
        f"{hw['ridge_tokens']:.0f} tokens",
        f"loads      dense {1e3 * report['dense_load_seconds']:.3f} ms/step, one expert in "
        f"every layer {1e3 * report['expert_load_seconds']:.3f} ms",
        f"T_thres    {report['saturation_threshold']} tokens (tau={report['tau']:g}: a pass "
        f"that large reads {100 * report['tau']:g}% of each layer's experts)",
        f"params     {params}  (seconds; lam, s dimensionless)",
        f"knee       lam x RP = {report['knee_tokens']:.1f} tokens",
        f"fit        {fit['points']} roofline points, relative residual rms "
        f"{100 * fit['rms_relative_residual']:.2f}%, max "
        f"{100 * fit['max_abs_relative_residual']:.2f}%",
        f"alpha      {report['accept_rate']:g} per-token acceptance rate",
        "",
        " ".join(
            header.rjust(len(fmt.format(0)) if "d" in fmt else len(fmt.format(0.0)))
            for _, header, fmt in _COLUMNS
        ),
    ]
    for row in report["rows"]:
        lines.append(" ".join(fmt.format(row[key]) for key, _, fmt in _COLUMNS))
    if "adaptive" in report:
        adaptive = report["adaptive"]
        lines += [
            "",
            f"adaptive   draft steps per batch-size bucket (a batch takes the largest bucket "
            f"<= its size; at most {adaptive['max_draft_steps']}, alpha "
            f"{report['accept_rate']:g}, chain drafts; 0 = do not speculate)",
            "bucket  draft_steps  num_draft_tokens",
        ]
        for bucket in adaptive["buckets"]:
            lines.append(
                f"{bucket['batch']:>6d} {bucket['draft_steps']:>12d} "
                f"{bucket['num_draft_tokens']:>17d}"
            )
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> None:
    """Writes a PNG: predicted speedup and target efficiency vs batch, one line per gamma."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_speedup, ax_eff = fig.subplots(1, 2)
    gammas = sorted({row["gamma"] for row in report["rows"]})
    all_batches = sorted({row["batch"] for row in report["rows"]})
    for gamma in gammas:
        rows = sorted((r for r in report["rows"] if r["gamma"] == gamma), key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        ax_speedup.plot(batches, [r["speedup"] for r in rows], marker="o", label=f"gamma={gamma}")
        ax_eff.plot(batches, [r["target_efficiency"] for r in rows], marker="o")
    ax_speedup.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    for ax, ylabel in ((ax_speedup, "predicted SD speedup"), (ax_eff, "target efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_batches, [str(b) for b in all_batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_speedup.legend()
    fig.suptitle(
        f"{report['model']['name']} on {report['hardware']['name']}, "
        f"alpha={report['accept_rate']:g} (model prediction, not measured)"
    )
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    """Prints the report; writes ``--json``, ``--plot`` and ``--adaptive-config`` when given.
    Returns 0."""
    report = build_report(args)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, allow_nan=False)
            f.write("\n")
    if args.plot:
        write_plot(report, args.plot)
    if args.adaptive_config:
        with open(args.adaptive_config, "w") as f:
            json.dump(report["adaptive"]["sglang_adaptive_config"], f, indent=2)
            f.write("\n")
    return 0
