"""The device check's summary.md, rewritten after every stage from the stage statuses
(``--status``: lines "stage status seconds limit"), the stages' JSON files and build.log in
``--out``, and the stage logs (``--logs``: the tail of a stage that did not pass)."""

import argparse
import json
import re
import time
from pathlib import Path

from selection_cases import markdown as selection_markdown

STAGES = ("env", "build", "correctness", "sanitizer", "selection", "moe", "probe")
OUR_KERNELS = ("select_kernel", "topk_to_bitmap_kernel", "popcount_kernel")


def load(out: Path, stage: str) -> dict | None:
    path = out / f"{stage}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def ptxas_report(log: Path) -> list[str]:
    """One line per kernel of ours: registers, shared memory, stack, spills (from -Xptxas -v)."""
    if not log.exists():
        return ["no build.log"]
    lines, kernel, frame = [], None, ""
    for line in log.read_text(errors="replace").splitlines():
        entry = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if entry:
            name = next((k for k in OUR_KERNELS if k in entry.group(1)), None)
            kernel = f"{name} ({entry.group(2)})" if name else None
        elif kernel and "stack frame" in line:
            frame = line.split(":", 1)[-1].strip()
        elif kernel and "Used" in line and "registers" in line:
            lines.append(f"- `{kernel}`: {line.split(':', 1)[-1].strip()}; {frame}")
            kernel = None
    return sorted(set(lines)) or ["no ptxas report for our kernels in build.log"]


def stage_table(statuses: dict) -> list[str]:
    lines = ["| stage | status | seconds | limit (s) |", "|---|---|---|---|"]
    for stage in STAGES:
        status, seconds, limit = statuses.get(stage, ("not run", "-", "-"))
        lines.append(f"| {stage} | {status} | {seconds} | {limit} |")
    return lines


def failures(data: dict | None) -> list[str]:
    if not data or not data["failures"]:
        return []
    shown = [f"- {f[:400]}" for f in data["failures"][:10]]
    more = len(data["failures"]) - len(shown)
    return ["", "Failures:", *shown] + ([f"- ... and {more} more"] if more > 0 else [])


def correctness_section(data: dict) -> list[str]:
    counts: dict[str, list[int]] = {}
    for row in data["rows"]:
        ok = row.get("ok", row.get("equals_cpu_op", True)) and row.get("deterministic", True)
        total, good = counts.setdefault(row["check"], [0, 0])
        counts[row["check"]] = [total + 1, good + bool(ok)]
    lines = ["| check | cases | passed |", "|---|---|---|"]
    lines += [f"| {k} | {t} | {g} |" for k, (t, g) in counts.items()]
    errors = [r["rel_error"] for r in data["rows"] if r["check"] == "verify_moe"]
    if errors:
        lines += ["", f"verify_moe: max relative error {max(errors):.1e} over {len(errors)} cases."]
    return lines


def moe_section(data: dict) -> list[str]:
    ceil = data["info"].get("ceilings", {})
    read, copy = ceil.get("read_only"), ceil.get("copy_read_write")
    lines = []
    if read and copy:
        lines += [
            f"Ceilings measured here: read-only (a sum) {read / 1e12:.2f} TB/s; device copy "
            f"(bytes read + written) {copy / 1e12:.2f} TB/s.",
            "",
        ]
    lines += [
        "| shape | T | unique experts | kernel (us, graph replay) | weights TB/s | % of read-only "
        "| % of copy | rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        rate = r["weight_bytes_per_s"]
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['unique_experts']} | {r['kernel_us']:.1f} | "
            f"{rate / 1e12:.3f} | {100 * rate / read:.0f} | {100 * rate / copy:.0f} | "
            f"{r['rel_error']:.1e} |"
            if read and copy
            else f"| {r['shape']} | {r['tokens']} | {r['unique_experts']} | "
            f"{r['kernel_us']:.1f} | {rate / 1e12:.3f} | - | - | {r['rel_error']:.1e} |"
        )
    fit = data["info"].get("fit")
    if fit:
        params = ", ".join(f"{k} = {v:.4g}" for k, v in fit["params"].items())
        lines += [
            "",
            f"MoESD expert-cost fit ({data['info']['fit_shape']}): t = bias + k2 N + "
            f"k3 G(T K / N); {params}; relative residual rms {100 * fit['rms_residual']:.2f}%.",
        ]
    return lines


def rows_section(data: dict, keys: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in data["rows"]:
        cells = [row.get(k, "-") for k in keys]
        text = [f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells]
        lines.append("| " + " | ".join(text) + " |")
    return lines


def write_summary(out: Path, statuses: dict, logs: Path | None) -> str:
    env = load(out, "env") or dict(info={}, dry_run=None)
    info = env["info"]
    lines = [
        f"# Device check{' (CPU dry run)' if env.get('dry_run') else ''}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device: "
        f"{info.get('gpu', 'CPU')}; commit {info.get('commit', '?')}; torch "
        f"{info.get('torch', '?')}, Triton {info.get('triton', '?')}; "
        f"{info.get('cpu_cores', '?')} CPU cores. Command: `bash scripts/gpu_check.sh`.",
        "",
        *stage_table(statuses),
        "",
        "## build (nvcc -Xptxas -v)",
        "",
        *ptxas_report(out / "build.log"),
    ]
    sections = {
        "correctness": correctness_section,
        "sanitizer": lambda d: rows_section(d, ("tool", "exit", "seconds", "summary")),
        "selection": lambda d: selection_markdown(d["rows"])[2:] if d["rows"] else [],
        "moe": moe_section,
        "probe": lambda d: rows_section(d, tuple(d["rows"][0]) if d["rows"] else ("ok",)),
    }
    for stage, section in sections.items():
        data = load(out, stage)
        if data is None:
            continue
        lines += ["", f"## {stage}", "", *section(data), *failures(data)]
    for stage, (status, _, _) in statuses.items():
        log = logs / f"{stage}.log" if logs else None
        if status != "passed" and log and log.exists():
            tail = log.read_text(errors="replace").splitlines()[-25:]
            lines += ["", f"## {stage}: last lines of its log", "", "```", *tail, "```"]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def read_statuses(path: Path) -> dict:
    statuses = {}
    if path.exists():
        for line in path.read_text().splitlines():
            stage, status, seconds, limit = line.split()
            statuses[stage] = (status, seconds, limit)
    return statuses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--status", type=Path, required=True)
    parser.add_argument("--logs", type=Path)
    args = parser.parse_args(argv)
    write_summary(args.out, read_statuses(args.status), args.logs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
