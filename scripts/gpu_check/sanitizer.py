"""Stage "sanitizer" of the device check: sanitizer_driver.py under compute-sanitizer's
memcheck, racecheck and synccheck, one process each (the extension built with -lineinfo, so
reports name source lines). A tool passes when it exits 0 and its summary line counts no
error ("ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed (0
errors, 0 warnings)").
A dry run runs the driver once on the CPU, without the sanitizer (there is no GPU to check).
Writes sanitizer.json."""

import os
import re
import shutil
import subprocess
import sys
import time

import common

TOOLS = ("memcheck", "racecheck", "synccheck")
DRIVER = common.ROOT / "scripts" / "gpu_check" / "sanitizer_driver.py"


def run(command: list[str], timeout: float) -> tuple[int, str, float]:
    start = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(common.IMPORT_PATHS))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f"timed out after {timeout:.0f} s: {exc.stdout or ''}"
    return code, output, time.time() - start


def clean(summary: str) -> bool:
    """Whether a compute-sanitizer summary line reports no error and no hazard."""
    return bool(re.search(r"ERROR SUMMARY: 0 errors|SUMMARY: 0 hazards displayed \(0 err", summary))


def main(argv=None) -> int:
    args = common.parse_args(__doc__.splitlines()[0], argv)
    record = common.StageRecord(args.out, "sanitizer", args.dry_run)
    budget = float(os.environ.get("GPU_CHECK_STAGE_SECONDS", "90"))
    if args.dry_run:
        code, output, seconds = run([sys.executable, str(DRIVER)], budget)
        row = dict(tool="none (dry run: the driver on the CPU)", exit=code, seconds=seconds)
        record.add(dict(row, tail=output[-1500:]), ok=code == 0)
        return record.exit_code()
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        record.fail("compute-sanitizer not found (PATH or /usr/local/cuda/bin)")
        return record.exit_code()
    for i, tool in enumerate(TOOLS):
        left = budget - record.data["seconds"] - 5
        timeout = left / (len(TOOLS) - i)
        command = [sanitizer, "--tool", tool, "--error-exitcode", "3", "--print-limit", "20"]
        code, output, seconds = run([*command, sys.executable, str(DRIVER)], timeout)
        summary = [line for line in output.splitlines() if "SUMMARY:" in line]
        ok = code == 0 and len(summary) == 1 and clean(summary[0])
        row = dict(tool=tool, exit=code, seconds=seconds, summary=summary, tail=output[-1500:])
        record.add(row, ok=ok, failure=f"compute-sanitizer {tool}: exit {code}, {summary}")
        print(f"sanitizer {tool}: exit {code} in {seconds:.0f} s, {summary}", flush=True)
    return record.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
