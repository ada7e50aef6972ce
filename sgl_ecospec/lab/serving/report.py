"""The serving benchmark's report: medians over rounds, the ratio to no speculation, outputs
compared with the plain server's, the table and the throughput plot."""

import json
import statistics
from pathlib import Path

_COLUMNS = (
    ("algorithm", 18, "algorithm", "{}"),
    ("conc", 4, "concurrency", "{:d}"),
    ("done", 4, "completed", "{:d}"),
    ("tok/s", 8, "output_throughput", "{:.2f}"),
    ("vs none", 7, "vs_none", "{:.3f}"),
    ("TPOT ms", 9, "mean_tpot_ms", "{:.1f}"),
    ("accept", 6, "accept_length", "{:.3f}"),
    ("experts", 7, "experts_per_layer_step", "{:.2f}"),
    ("recall", 6, "predictor_recall", "{:.3f}"),
    ("same", 7, "same_outputs", "{}"),
)
# With a calibration profile (bench_serving --profile): the predicted TPOT and its error.
_PREDICTED_COLUMNS = (
    ("pred ms", 9, "predicted_tpot_ms", "{:.1f}"),
    ("error", 7, "tpot_error", "{:+.1%}"),
)

MEDIAN_KEYS = (
    "output_throughput",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_ttft_ms",
    "accept_length",
    "experts_per_layer_step",
    "predictor_recall",
    "spec_accept_length",
)


def read_run(path: str) -> tuple[dict, list[dict]]:
    """(config, runs) of a ``bench_serving --json`` file; OSError, ValueError (not JSON),
    KeyError or TypeError (not a run's layout) on a bad one."""
    data = json.loads(Path(path).read_text())
    return data["config"], data["runs"]


def format_table(runs: list[dict]) -> str:
    def cell(run, key, fmt):
        value = run.get(key)
        return "-" if value is None else fmt.format(value)

    columns = _COLUMNS
    if any("predicted_tpot_ms" in run for run in runs):
        columns += _PREDICTED_COLUMNS
    lines = [
        " ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w, _, _) in enumerate(columns))
    ]
    for run in runs:
        cells = [cell(run, key, fmt) for _, _, key, fmt in columns]
        lines.append(
            " ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, (_, w, _, _)) in enumerate(zip(cells, columns, strict=True))
            )
        )
    return "\n".join(lines)


def combine(records: list[dict]) -> dict:
    """One (algorithm, concurrency)'s record over its rounds: the median of each figure (the
    machine's speed drifts between rounds; every algorithm saw each round), the rounds'
    own figures under ``rounds``; the gate's steps per level summed over the rounds. The
    generated texts stay per round (``compare_outputs`` reads them), out of the combined
    record."""
    combined = {k: v for k, v in records[0].items() if k != "generated_texts"}
    for key in MEDIAN_KEYS:
        values = [r[key] for r in records if r.get(key) is not None]
        combined[key] = statistics.median(values) if values else None
    combined["completed"] = sum(r["completed"] or 0 for r in records)
    combined["verify_steps_logged"] = sum(r["verify_steps_logged"] for r in records)
    combined["wall_seconds"] = sum(r["wall_seconds"] for r in records)
    steps = [r.get("gate_steps") for r in records]  # the gate's levels: every round's steps
    combined["gate_steps"] = (
        None if None in steps else {kind: sum(s[kind] for s in steps) for kind in steps[0]}
    )
    combined["rounds"] = [
        {k: r[k] for k in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")} for r in records
    ]
    return combined


def compare_outputs(runs: list[dict], measured: dict[tuple[str, int], list[dict]]) -> None:
    """Sets each record's ``same_outputs`` ("k/n": of n requests over every round, k
    generated the plain server's text at the same concurrency and round) and, when some
    differ, ``output_differences`` (round, request index, the first differing character
    and both texts from there). Greedy decoding with lossless verification generates the
    plain server's text; a difference is a bug or a floating-point near-tie between
    batch shapes. None without a plain server or texts (``measured``: the rounds' records
    by (algorithm, concurrency), with their ``generated_texts``)."""
    for record in runs:
        key = (record["algorithm"], record["concurrency"])
        plain = measured.get(("none", record["concurrency"]))
        if plain is None or any(r.get("generated_texts") is None for r in plain + measured[key]):
            record["same_outputs"] = None
            continue
        same = total = 0
        differences = []
        for round_, (ours, theirs) in enumerate(zip(measured[key], plain, strict=True), 1):
            for index, (a, b) in enumerate(
                zip(ours["generated_texts"], theirs["generated_texts"], strict=True)
            ):
                total += 1
                if a == b:
                    same += 1
                    continue
                at = next(
                    (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)),
                )
                differences.append(
                    {"round": round_, "request": index, "at": at, "ours": a[at:], "plain": b[at:]}
                )
        record["same_outputs"] = f"{same}/{total}"
        if differences:
            record["output_differences"] = differences


def add_speed_ratios(runs: list[dict]) -> None:
    """Sets each record's ``vs_none``: its output throughput over the server without
    speculation's at the same concurrency (when that server ran)."""
    plain = {r["concurrency"]: r["output_throughput"] for r in runs if r["algorithm"] == "none"}
    for record in runs:
        base = plain.get(record["concurrency"])
        ours = record["output_throughput"]
        record["vs_none"] = ours / base if base and ours is not None else None


def plot_throughput(runs: list[dict], path: Path, title: str) -> None:
    """Output tok/s against concurrency, one line per algorithm (the medians; each round's
    figure as a faint dot), written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for algorithm in dict.fromkeys(r["algorithm"] for r in runs):
        mine = sorted(
            (r for r in runs if r["algorithm"] == algorithm and r["output_throughput"]),
            key=lambda r: r["concurrency"],
        )
        if not mine:
            continue
        line = ax.plot(
            [r["concurrency"] for r in mine],
            [r["output_throughput"] for r in mine],
            marker="o",
            label=algorithm,
        )[0]
        for r in mine:
            rounds = [x["output_throughput"] for x in r.get("rounds", []) if x["output_throughput"]]
            ax.scatter(
                [r["concurrency"]] * len(rounds), rounds, s=10, alpha=0.35, color=line.get_color()
            )
    ax.set_xscale("log", base=2)
    concurrencies = sorted({r["concurrency"] for r in runs})
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s (median of rounds)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
