"""The device check's scripts (scripts/gpu_bench.py, gpu_bench_selection.py,
gpu_graph_check.py): their CPU-side logic, and the whole bench run on the CPU at tiny sizes
(Triton interpreted) so that it is tested without a GPU."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def selection():
    return runpy.run_path(str(SCRIPTS / "gpu_bench_selection.py"))


@pytest.fixture(scope="module")
def graphs():
    return runpy.run_path(str(SCRIPTS / "gpu_graph_check.py"))


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

    def row(us, shared=True, batch=64):
        return dict(
            model="m", policy="ecospec", share_buffer=shared, batch=batch, ep_ranks=8, graph_us=us
        )

    assert verdict([row(12.0), row(29.0), row(500.0, shared=False)]).startswith("met")
    assert verdict([row(12.0), row(31.0)]).startswith("NOT met: slowest")
    assert verdict([row(None)]).startswith("not measured")
    assert verdict([row(5.0, batch=8)]).startswith("not measured")


def test_graph_check_logic_on_cpu(graphs, tmp_path):
    # On the CPU "replay" calls the function again: this runs the check's own logic (new
    # inputs written in place, eager and reference comparisons), not graph capture.
    assert graphs["main"](["--device", "cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "graph_check.json").read_text())
    assert len(results) == 8 and all(r["ok"] and r["inputs_changed_output"] for r in results)
    moe = results[-1]
    assert moe["check"] == "verify_moe float32 T=6 E=70 K=4"
    assert moe["rel_error"] <= moe["tolerance"] == 1e-4


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


@pytest.mark.slow  # about 30 s
def test_gpu_bench_logic_on_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "gpu_bench.py"),
            "--tiny",
            "--device",
            "cpu",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    selection = data["selection"]
    assert all(r["matches_reference"] for r in selection)
    assert len(selection) == 2 * 5  # batches x (policy, shared, EP) configs
    assert {(r["share_buffer"], r["ep_ranks"]) for r in selection} >= {(True, 2), (True, None)}
    assert all(r["ok"] and r["inputs_changed_output"] for r in data["graphs"])
    rows = data["verify_moe"]["rows"]
    assert rows and all(r["bitmap_ok"] and r["rel_error"] < 1e-4 for r in rows)
    assert data["verify_moe"]["tolerance"] == 1e-4 and data["verify_moe"]["passed"]
    assert data["graphs"][-1]["check"].startswith("verify_moe float32")
    assert len(data["fit"]["residuals"]) == len(rows)
    table = (tmp_path / "h200.md").read_text()
    assert "## Verify MoE kernel" in table and "relative residual rms" in table
    assert "tolerance 1e-04: passed" in table
    assert "Target (issue 14)" in table and "not measured" in table
    assert "## CUDA graphs" in table


def test_gpu_check_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")]).returncode == 0
