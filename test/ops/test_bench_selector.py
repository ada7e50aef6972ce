import json
import runpy
from pathlib import Path

import pytest
from _util import requires_native

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_selector.py"


@requires_native
def test_bench_selector_writes_table_and_json(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    out_file = tmp_path / "bench.json"
    assert main(["--batch", "1,2", "--quick", "--json", str(out_file)]) == 0
    table = capsys.readouterr().out
    assert "native_us" in table and "deepseek-v3" in table
    result = json.loads(out_file.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 3  # models x batches x (policy, shared) configs
    assert {r["model"] for r in rows} == {"qwen3-235b-a22b", "deepseek-v3"}
    assert all(r["native_us"] > 0 and r["reference_us"] > 0 for r in rows)
    assert result["machine"]["threads"] >= 1


def test_bench_selector_rejects_bad_batch():
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit):
        main(["--batch", "a,b"])
