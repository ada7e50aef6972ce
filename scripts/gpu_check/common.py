"""What the device check's stages share: the stage's JSON record (rewritten after every row,
so a stage cut off by its timeout still leaves what it measured), the device and the dry-run
switch, and the timers.

Every stage is a script ``python3 scripts/gpu_check/<stage>.py --out DIR [--dry-run]`` run
by ``scripts/gpu_check.sh``. ``--dry-run`` runs the same logic on the CPU at tiny shapes:
the CUDA selection kernel's own source under the CPU emulation of test/ops/cuda_emulator.h,
the Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``, set by the shell
script before Python starts).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# The project and this folder: what every stage (and a child process) imports from.
IMPORT_PATHS = (str(ROOT), str(ROOT / "scripts" / "gpu_check"))
for path in IMPORT_PATHS:
    if path not in sys.path:
        sys.path.insert(0, path)


def use_test_helpers() -> None:
    """Puts test/ and test/ops/ on the import path: stages reuse the tests' inputs and
    checks (test_verify_moe.py's) rather than copies of them."""
    for path in (ROOT / "test", ROOT / "test" / "ops"):
        if str(path) not in sys.path:
            sys.path.append(str(path))


def parse_args(description: str, argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="folder of the stage's JSON")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def stage_device(dry_run: bool) -> torch.device:
    """The GPU, or the CPU in a dry run; exits 2 with advice when a GPU run has no GPU."""
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print("error: no GPU visible; `bash scripts/gpu_check.sh --cpu-dry-run DIR` checks the "
              "stages on the CPU", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    return torch.device("cuda")


class StageRecord:
    """The stage's JSON file ``<out>/<stage>.json``: ``rows`` (one dict per measurement or
    check), ``failures`` (what disagreed, in words) and free ``info``. Every change is
    written at once (to a temporary file, then renamed)."""

    def __init__(self, out: Path, stage: str, dry_run: bool):
        self.path = out / f"{stage}.json"
        self.data = dict(stage=stage, dry_run=dry_run, started=time.time(), info={}, rows=[])
        self.data["failures"] = []
        self.save()

    def add(self, row: dict, ok: bool = True, failure: str | None = None) -> None:
        self.data["rows"].append(row)
        if not ok:
            self.data["failures"].append(failure or json.dumps(row, default=str))
        self.save()

    def fail(self, failure: str) -> None:
        print(f"FAILED: {failure}", flush=True)
        self.data["failures"].append(failure)
        self.save()

    def info(self, **values) -> None:
        self.data["info"].update(values)
        self.save()

    def save(self) -> None:
        self.data["seconds"] = time.time() - self.data["started"]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def exit_code(self) -> int:
        """0 when nothing failed, else 1 (and the failures on stderr)."""
        for failure in self.data["failures"]:
            print(f"failure: {failure}", file=sys.stderr)
        return 1 if self.data["failures"] else 0


def event_median_us(fn, repeats: int, warmup: int = 3) -> float:
    """Median microseconds of ``fn()`` between two CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_median_us(fn, repeats: int, warmup: int = 1) -> float:
    """Median microseconds of ``fn()`` by the host clock (the CPU's timer in a dry run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def median_us(fn, device: torch.device, repeats: int) -> float:
    return event_median_us(fn, repeats) if device.type == "cuda" else host_median_us(fn, repeats)


def graph_of(fn):
    """``fn`` captured once in a CUDA graph (after warm-up on a side stream): ``(graph,
    outputs)``; ``graph.replay()`` reruns it on the same buffers."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def replay_median_us(fn, repeats: int, per_event: int = 10) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph: ``per_event``
    replays between two events, so a replay's own launch gap is counted but not the events'."""
    graph, _ = graph_of(fn)
    return event_median_us(lambda: [graph.replay() for _ in range(per_event)], repeats) / per_event
