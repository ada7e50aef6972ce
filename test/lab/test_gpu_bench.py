"""The device check's timing script, run on the CPU at tiny sizes (Triton interpreted) so
that its logic is tested without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow  # about 20 s
def test_gpu_bench_logic_on_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_bench.py"),
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
    assert all(r["matches_reference"] for r in data["selection"])
    assert len(data["selection"]) == 2 * 3  # batches x (policy, shared) configs
    rows = data["verify_moe"]["rows"]
    assert rows and all(r["bitmap_ok"] and r["rel_error"] < 1e-4 for r in rows)
    assert len(data["fit"]["residuals"]) == len(rows)
    table = (tmp_path / "h200.md").read_text()
    assert "## Verify MoE kernel" in table and "relative residual rms" in table


def test_gpu_check_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
