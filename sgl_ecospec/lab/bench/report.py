"""Output of ``sgl-ecospec bench``: the table, the JSON file and the plot.

A run (one policy at one budget) is a dict: ``policy``, ``budget``, the testbed metrics of
``metrics.summarize`` plus ``uniform_experts_per_layer_step``, ``lossless``,
``wall_seconds``, ``per_dataset`` and ``predicted`` (``metrics.predicted_cost``). The
report is ``{"note", "config", "testbed", "profile", "hardware", "greedy", "policies",
"sweep"}`` (docs/bench.md has the schema).
"""

import json

from sgl_ecospec.lab.bench import metrics

# (header, width, getter(run) -> value, format); None prints as "n/a".
_BUDGET_POLICY = (
    ("budget", 6, lambda r: r["budget"], "{:d}"),
    ("policy", 10, lambda r: r["policy"], "{}"),
)
_ACCEPT_EXPERTS_P90 = (
    ("accept", 6, lambda r: r["accept_length"], "{:.3f}"),
    ("pred", 6, lambda r: r.get("predicted_accept_length"), "{:.3f}"),
    ("pred_raw", 8, lambda r: r.get("predicted_accept_length_raw"), "{:.3f}"),
    ("experts", 7, lambda r: r["experts_per_layer_step"], "{:.2f}"),
    ("p90", 5, lambda r: r["experts_per_layer_step_p90"], "{:.1f}"),
)
_RECALL = ("recall", 6, lambda r: r["predictor_recall"], "{:.3f}")
_LOSSLESS = ("lossless", 8, metrics.lossless_status, "{}")
_COLUMNS = (
    *_BUDGET_POLICY,
    *_ACCEPT_EXPERTS_P90,
    ("uniform", 7, lambda r: r["uniform_experts_per_layer_step"], "{:.2f}"),
    _RECALL,
    _LOSSLESS,
    ("prof_exp", 8, lambda r: r["predicted"]["experts_per_layer_step"], "{:.2f}"),
    ("GB/step", 7, lambda r: r["predicted"]["expert_bytes_per_step"] / 1e9, "{:.2f}"),
    ("verify_ms", 9, lambda r: r["predicted"]["verify_ms"], "{:.3f}"),
    ("speedup", 7, lambda r: r["predicted"]["speedup"], "{:.3f}"),
)
_DATASET_COLUMNS = (
    *_BUDGET_POLICY,
    ("dataset", 12, lambda r: r["dataset"], "{}"),
    *_ACCEPT_EXPERTS_P90,
    _RECALL,
    _LOSSLESS,
)


_LEFT_ALIGNED = ("policy", "dataset")


def _line(columns, cells) -> str:
    out = []
    for (header, width, _, _), cell in zip(columns, cells, strict=True):
        out.append(cell.ljust(width) if header in _LEFT_ALIGNED else cell.rjust(width))
    return " ".join(out).rstrip()


def _cells(columns, run: dict) -> list[str]:
    cells = []
    for _, _, get, fmt in columns:
        value = get(run)
        cells.append("n/a" if value is None else fmt.format(value))
    return cells


def table_header() -> str:
    """The header line of the main table."""
    return _line(_COLUMNS, [header for header, _, _, _ in _COLUMNS])


def table_row(run: dict) -> str:
    """One run as a line of the main table."""
    return _line(_COLUMNS, _cells(_COLUMNS, run))


def preamble(report: dict) -> str:
    """The lines printed before the table: what was measured and what is predicted."""
    cfg, tb, prof, hw = report["config"], report["testbed"], report["profile"], report["hardware"]
    greedy = report["greedy"]
    return "\n".join(
        [
            "# measured on the testbed: accept, experts, p90, uniform, recall, lossless "
            "(the expert prediction's time per verify step, a time of this machine, is in the "
            "JSON: predict_ms_per_step); "
            "pred, pred_raw: acceptance length forecast each step by the calibrated and the "
            "raw draft probabilities",
            "# predicted for the profile (MoESD model on a roofline prior, not measured): "
            "prof_exp, GB/step, verify_ms, speedup",
            f"testbed    target {cfg['target']}, draft {cfg['draft']}: {tb['num_layers']} MoE "
            f"layers, E={tb['num_experts']}, K={tb['top_k']}",
            f"prompts    {', '.join(f'{n} {c}' for n, c in cfg['num_prompts'].items())}; "
            f"batch {cfg['batch_size']}, {cfg['max_new_tokens']} new tokens",
            f"tree       topk {cfg['topk']}, {cfg['steps']} steps ({cfg['candidates']} "
            f"candidates), predictor {cfg['predictor']}, eps {cfg['eps']:g}, shared buffer "
            f"{'on' if cfg['share_buffer'] else 'off'}"
            f"{' (round_sync)' if cfg.get('round_sync') else ''}, selection by "
            f"{'calibrated' if cfg.get('calibrated_acceptance') else 'draft'} probabilities, "
            f"recall-weighted cost {'on' if cfg.get('recall_weighted_cost') else 'off'}, "
            f"score floor {cfg.get('min_score', 0.0):g} (ecospec, adaptive)",
            f"profile    {prof['name']} (E={prof['num_experts']}, K={prof['top_k']}, "
            f"{prof['moe_layers']} MoE layers, {prof['bytes_per_expert'] / 1e6:.2f} MB/expert) "
            f"on {hw['name']}",
            f"greedy     {greedy['steps']} steps, {greedy['experts_per_layer_step']:.2f} experts "
            f"per layer per step ({greedy['predicted']['experts_per_layer_step']:.2f} scaled), "
            f"predicted AR step {greedy['predicted']['ar_ms']:.3f} ms",
        ]
    )


def format_dataset_table(report: dict) -> str:
    """Per-dataset metrics of every run, or "" with a single dataset."""
    if len(report["config"]["datasets"]) < 2:
        return ""
    lines = [_line(_DATASET_COLUMNS, [h for h, _, _, _ in _DATASET_COLUMNS])]
    for run in report["sweep"]:
        for name, figures in run["per_dataset"].items():
            row = {"budget": run["budget"], "policy": run["policy"], "dataset": name, **figures}
            lines.append(_line(_DATASET_COLUMNS, _cells(_DATASET_COLUMNS, row)))
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """Preamble, main table and (with several datasets) the per-dataset table."""
    parts = [preamble(report), "", table_header(), *map(table_row, report["sweep"])]
    per_dataset = format_dataset_table(report)
    if per_dataset:
        parts += ["", per_dataset]
    return "\n".join(parts)


def write_json(report: dict, path: str) -> None:
    """Writes the report as indented JSON (no NaN or inf)."""
    with open(path, "w") as f:
        json.dump(report, f, indent=2, allow_nan=False)
        f.write("\n")


def write_plot(report: dict, path: str) -> None:
    """Writes a PNG: unique experts per layer per verify step vs budget, one line per policy
    (EcoSpec Fig. 1b), with the uniform-routing expectation; and predicted speedup vs
    budget for the profile."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_experts, ax_speedup = fig.subplots(1, 2)
    runs = report["sweep"]
    budgets = sorted({r["budget"] for r in runs})
    for policy in dict.fromkeys(r["policy"] for r in runs):
        rows = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["budget"])
        x = [r["budget"] for r in rows]
        ax_experts.plot(x, [r["experts_per_layer_step"] for r in rows], marker="o", label=policy)
        ax_speedup.plot(x, [r["predicted"]["speedup"] for r in rows], marker="o", label=policy)
    uniform = {r["budget"]: r["uniform_experts_per_layer_step"] for r in runs}
    ax_experts.plot(
        budgets,
        [uniform[b] for b in budgets],
        color="gray",
        linestyle="--",
        label="uniform routing",
    )
    ax_speedup.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    tb, prof, hw = report["testbed"], report["profile"], report["hardware"]
    ax_experts.set_ylabel(f"unique experts per layer per verify step (E={tb['num_experts']})")
    ax_experts.set_title(f"measured on the testbed (K={tb['top_k']})")
    ax_speedup.set_ylabel("predicted SD speedup")
    ax_speedup.set_title(f"predicted for {prof['name']} on {hw['name']}")
    for ax in (ax_experts, ax_speedup):
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (draft tokens verified per request)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    cfg = report["config"]
    fig.suptitle(
        f"{', '.join(cfg['datasets'])}: batch {cfg['batch_size']}, topk {cfg['topk']}, "
        f"{cfg['steps']} steps, {cfg['predictor']} predictor"
    )
    fig.savefig(path, dpi=120)
