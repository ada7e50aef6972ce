"""The device check (scripts/gpu_check.sh and scripts/gpu_check/): its CPU-side logic, and
the whole check as a CPU dry run (the CUDA selection kernel under the CPU emulation, Triton
interpreted), so that the script cannot rot before a GPU is lent."""

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
SCRIPTS = ROOT / "scripts"
STAGE_DIR = SCRIPTS / "gpu_check"
STAGES = ("env", "build", "correctness", "sanitizer", "selection", "moe", "probe")
sys.path.insert(0, str(STAGE_DIR))


@pytest.fixture(scope="module")
def selection():
    return runpy.run_path(str(STAGE_DIR / "selection_cases.py"))


@pytest.fixture(scope="module")
def graphs():
    return runpy.run_path(str(STAGE_DIR / "graph_check.py"))


@pytest.mark.parametrize("topk, steps", [(4, 3), (2, 4), (3, 1)])
def test_sglang_tree_has_sglangs_shape(selection, topk, steps):
    tree = selection["sglang_tree"](5, topk, steps, 3, 70, 4, seed=topk)
    scores, parents = tree.scores, tree.parents
    nodes = topk + (steps - 1) * topk * topk
    assert scores.shape == parents.shape == (5, nodes)
    assert tree.node_experts.shape == (5, nodes, 3, 2) and tree.root_experts.shape == (5, 3, 2)
    assert (parents[:, :topk] == -1).all()
    if steps > 1:  # step 1: K children of each step-0 candidate, in order
        expected = torch.arange(topk).repeat_interleave(topk).expand(5, -1)
        assert torch.equal(parents[:, topk : topk + topk * topk], expected)
    for step in range(2, steps):
        start, previous = topk + (step - 1) * topk * topk, topk + (step - 2) * topk * topk
        beams = parents[:, start : start + topk * topk : topk]  # one parent per K children
        best = scores[:, previous:start].topk(topk, dim=1).indices + previous
        assert torch.equal(beams, best)  # the previous step's best K, best first
    has_parent = parents >= 0
    above = scores.gather(1, parents.clamp(min=0))
    assert (scores[has_parent] <= above[has_parent]).all()  # cumulative: never rising


def test_rank_major_placement(selection):
    rank = selection["rank_major_placement"](3, 128, 8)
    assert rank.shape == (3, 128)
    assert torch.equal(rank[2], torch.arange(128) // 16)


def test_target_verdict(selection):
    verdict = selection["target_verdict"]

    def row(us, buffer="rounds", batch=64):
        return dict(
            model="m", policy="ecospec", buffer=buffer, batch=batch, ep_ranks=8, graph_us=us
        )

    # The target is round_sync's; the turn-by-turn rows are reported beside it.
    met = verdict([row(12.0), row(29.0), row(500.0, buffer=True), row(900.0, buffer=False)])
    assert met.startswith("met") and met.endswith("turn by turn: m ecospec EP, 500.0 us per call")
    assert verdict([row(12.0), row(31.0)]).startswith("NOT met: slowest round_sync row")
    assert verdict([row(None)]).startswith("not measured")
    assert verdict([row(5.0, batch=8)]).startswith("not measured")
    assert verdict([row(5.0, buffer=True)]).startswith("not measured")


def test_verify_moe_graph_check_fails_a_wrong_kernel(graphs, monkeypatch):
    # The check can fail: a kernel 1% off, or one that lets padded rows through.
    check = graphs["check_verify_moe"]
    right = check.__globals__["verify_moe"]

    def scaled(*args, **kwargs):
        out, bitmap = right(*args, **kwargs)
        return out * 1.01, bitmap

    def unmasked(x, w13, w2, ids, weights, **kwargs):
        out, bitmap = right(x, w13, w2, ids, weights, **kwargs)
        return out + (ids[:, :1] < 0).float(), bitmap  # padded rows not zero

    cpu = torch.device("cpu")
    assert check(cpu, True, 3)[0]["ok"]
    for wrong in (scaled, unmasked):
        monkeypatch.setitem(check.__globals__, "verify_moe", wrong)
        assert not check(cpu, True, 3)[0]["ok"], wrong.__name__
    assert graphs["verify_moe_tolerance"](torch.bfloat16) == 2e-2


def test_graph_check_flags_mismatches_and_stale_replays(graphs):
    failures = graphs["failures"]
    good = dict(check="a", ok=True, inputs_changed_output=True)
    wrong = dict(check="b", ok=False, inputs_changed_output=True)
    stale = dict(check="c", ok=True, inputs_changed_output=False)
    assert failures([good, wrong, stale]) == [wrong, stale]


def dry_run(out: Path, stages: str | None = None, python: str = sys.executable):
    env = dict(os.environ, PYTHON=python)
    env.pop("TRITON_INTERPRET", None)
    if stages:
        env["STAGES"] = stages
    return subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), "--cpu-dry-run", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip


def stage_statuses(summary: str) -> dict[str, str]:
    """The stage table (the first one): stage -> status."""
    table = summary.split("| stage | status |")[1].split("\n\n")[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ")]
    return {r[1].strip(): r[2].strip() for r in rows if r[1].strip() in STAGES}


@pytest.mark.slow  # about a minute on 2 cores
def test_cpu_dry_run_passes_every_stage(tmp_path):
    start = time.time()
    result = dry_run(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.time() - start < 300
    summary = (tmp_path / "summary.md").read_text()
    assert stage_statuses(summary) == dict.fromkeys(STAGES, "passed")
    assert "CPU dry run" in summary and "## correctness" in summary and "## moe" in summary
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {f"{s}.json" for s in STAGES if s != "build"} | {"build.log", "summary.md"}
    assert len(files) <= 8  # what the device tool brings back
    correctness = json.loads((tmp_path / "correctness.json").read_text())
    checks = {r["check"] for r in correctness["rows"]}
    assert checks == {"bitmaps", "selection", "verify_moe", "graph"} and not correctness["failures"]
    emulated = [r for r in correctness["rows"] if r["check"] == "selection"]
    assert len(emulated) > 40 and all(r["deterministic"] and r["equals_cpu_op"] for r in emulated)
    selection = json.loads((tmp_path / "selection.json").read_text())
    assert {(r["buffer"], r["ep_ranks"]) for r in selection["rows"]} >= {(True, 2), ("rounds", 2)}
    if shutil.which("nvcc"):
        assert "select_kernel (sm_90)`: Used" in summary  # the ptxas report


def test_a_failing_stage_stops_no_other(tmp_path):
    # A python that fails the probe stage only: the other stages still run and pass, the
    # summary says which failed and shows its log, and the script exits 1.
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/sh\ncase "$*" in *probe.py*) echo probe broke >&2; exit 3;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    out = tmp_path / "out"
    result = dry_run(out, stages="env probe sanitizer", python=str(fake))
    assert result.returncode == 1
    summary = (out / "summary.md").read_text()
    statuses = stage_statuses(summary)
    assert statuses["env"] == statuses["sanitizer"] == "passed"
    assert statuses["probe"] == "failed" and statuses["moe"] == "not run"
    assert "## probe: last lines of its log" in summary and "probe broke" in summary


def test_unknown_stage_is_refused(tmp_path):
    result = dry_run(tmp_path, stages="env bogus")
    assert result.returncode == 2 and "unknown stage bogus" in result.stderr


def test_gpu_stage_timeouts_fit_nine_minutes():
    text = (SCRIPTS / "gpu_check.sh").read_text()
    limits = dict(re.findall(r"\[(\w+)\]=(\d+)", text.split("declare -A limit=")[1].split("\n")[0]))
    assert set(limits) == set(STAGES)
    assert sum(map(int, limits.values())) <= 540


def test_sanitizer_summary_lines():
    from sanitizer import clean

    assert clean("========= ERROR SUMMARY: 0 errors")
    assert clean("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
    assert not clean("========= ERROR SUMMARY: 2 errors")
    assert not clean("========= RACECHECK SUMMARY: 3 hazards displayed (1 errors, 2 warnings)")


def test_ptxas_report_names_our_kernels(tmp_path):
    from summary import ptxas_report

    log = tmp_path / "build.log"
    log.write_text(
        "ptxas info    : Compiling entry function '_ZN11sgl_ecospec13select_kernelENS_10Sel"
        "ectArgsE' for 'sm_90'\nptxas info    : Function properties for x\n    192 bytes "
        "stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 115 "
        "registers, used 1 barriers, 400 bytes smem\nptxas info    : Compiling entry "
        "function '_Z5otherv' for 'sm_90'\nptxas info    : Used 9 registers\n"
    )
    assert ptxas_report(log) == [
        "- `select_kernel (sm_90)`: Used 115 registers, used 1 barriers, 400 bytes smem; 192 "
        "bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    ]


def test_gpu_check_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")]).returncode == 0
