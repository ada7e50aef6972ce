"""Model and hardware profiles (costmodel/profiles.py) against public parameter counts, and the
``costmodel`` command."""

import json

import pytest

from sgl_ecospec.costmodel import (
    acceptance_factor,
    dense_load_time,
    expert_load_time,
    get_hardware,
    get_model,
    ridge_tokens,
)
from sgl_ecospec.lab import cli

QWEN3 = get_model("qwen3-235b-a22b")
H200 = get_hardware("h200")


# --- profiles ---------------------------------------------------------------------------


def test_bytes_per_expert():
    assert QWEN3.bytes_per_expert == 3 * 4096 * 1536 * 2
    assert get_model("qwen3-30b-a3b").bytes_per_expert == 3 * 2048 * 768 * 2
    assert get_model("gpt-oss-120b").bytes_per_expert == pytest.approx(13.24e6, abs=0.005e6)
    assert get_model("deepseek-v3").bytes_per_expert == pytest.approx(44.04e6, abs=0.005e6)


# Published total parameter counts: an independent check of dense_params. Total = dense +
# input embedding + every routed expert.
@pytest.mark.parametrize(
    ("name", "total"),
    [
        ("qwen3-235b-a22b", 235e9),
        ("qwen3-30b-a3b", 30.5e9),
        ("gpt-oss-120b", 116.83e9),
        ("deepseek-v3", 671e9),
    ],
)
def test_dense_params_match_published_totals(name, total):
    m = get_model(name)
    routed = m.moe_layers * m.num_experts * m.expert_params
    assert m.dense_params + m.vocab_size * m.hidden + routed == pytest.approx(total, rel=0.01)


def test_derived_times_and_ridge_point():
    assert dense_load_time(QWEN3, H200) == pytest.approx(QWEN3.dense_params * 2 / 4.8e12)
    assert expert_load_time(QWEN3, H200) == pytest.approx(94 * 37_748_736 / 4.8e12)
    assert ridge_tokens(QWEN3, H200) == pytest.approx(989.4e12 / 4.8e12)  # bf16: 2 B / 2 FLOP
    assert ridge_tokens(get_model("deepseek-v3"), get_hardware("h100")) == pytest.approx(
        1978.9e12 / (2 * 3.35e12)
    )


def test_lookup_is_case_insensitive_and_lists_names():
    assert get_model(" Qwen3-235B-A22B ") is QWEN3
    assert get_hardware("H200") is H200
    eight = get_hardware("8xH200")
    assert eight.memory_bandwidth == pytest.approx(8 * 4.8e12)
    assert eight.peak_fp8_flops == pytest.approx(8 * 1978.9e12)
    with pytest.raises(ValueError, match="valid: qwen3-235b-a22b, qwen3-30b-a3b"):
        get_model("llama")
    with pytest.raises(ValueError, match="valid: h100, h200"):
        get_hardware("a100")


# --- CLI --------------------------------------------------------------------------------


def test_cli_table_json_and_plot(tmp_path, capsys):
    json_path, png_path = tmp_path / "out.json", tmp_path / "out.png"
    argv = ["costmodel", "--batch", "1,8,32", "--gamma", "2,4", "--accept-rate", "0.7"]
    assert cli.main(argv + ["--json", str(json_path), "--plot", str(png_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "gamma"])
    rows = [line.split() for line in lines[header + 1 :] if line.strip()]
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [
        (1, 2, 2),
        (1, 4, 4),
        (8, 2, 16),
        (8, 4, 32),
        (32, 2, 64),
        (32, 4, 128),
    ]
    assert "T_thres    47 tokens" in out and "not measurements" in out

    report = json.loads(json_path.read_text())
    assert report["saturation_threshold"] == 47
    assert len(report["rows"]) == 6
    row = report["rows"][1]  # batch 1, gamma 4
    assert row["unique_experts"] == pytest.approx(29.12, abs=0.01)
    assert row["sigma"] == pytest.approx(acceptance_factor(0.7, 4))
    assert float(rows[1][-1]) == pytest.approx(row["speedup"], abs=1e-3)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch", "1,x"], "--batch must be comma-separated positive ints, got '1,x'"),
        (["--gamma", "0"], "--gamma must be comma-separated positive ints, got '0'"),
        (["--accept-rate", "1.5"], "--accept-rate must be in [0, 1]"),
        (["--tau", "1"], "--tau must be in (0, 1)"),
        (["--model", "llama"], "unknown model 'llama'; valid: qwen3-235b-a22b"),
        (["--hardware", "tpu"], "unknown hardware 'tpu'; valid: h100, h200"),
    ],
)
def test_cli_bad_inputs(extra, message, capsys):
    assert cli.main(["costmodel", *extra]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
