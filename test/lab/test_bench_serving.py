"""scripts/bench_serving.sh: argument checks, server launch lines, log parsing, and one real
run (CPU development mode, tiny models) that must print the table and write the JSON."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from sgl_ecospec.lab.serving import bench_serving, prompts, report, server_memory
from sgl_ecospec.lab.serving.local_server import (
    accept_length_between,
    counter_fields,
    ecospec_log_summary,
    gate_steps_between,
    gpu_present,
    metric_totals,
)

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*argv):
    return bench_serving.validate(bench_serving.build_parser().parse_args(list(argv)))


def test_defaults_cover_every_algorithm_and_two_concurrencies():
    cfg = _cfg()
    assert cfg["algorithms"] == list(bench_serving.ALGORITHMS)
    assert cfg["concurrency"] == [1, 4]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--algorithms", "eagle3,medusa"], "unknown --algorithms"),
        (["--algorithms", "ecospec,ecospec"], "twice"),
        (["--concurrency", "1,x"], "comma-separated integers"),
        (["--concurrency", "0"], ">= 1"),
        (["--output-len", "2"], ">= 4"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--eps", "0"], "--eps must be finite and > 0"),
        (["--model-path", "/m"], "both --model-path and --draft-model-path"),
        (["--ecospec-setting", "policy"], "NAME=VALUE"),
        (["--ecospec-setting", "gate=0", "--ecospec-setting", "GATE=1"], "twice"),
        (["--eps", "0.1", "--ecospec-setting", "eps=auto"], "eps given twice"),
    ],
)
def test_invalid_arguments_fail_before_any_server(argv, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*argv)


def test_server_launch_lines():
    cfg = _cfg("--model-path", "/m", "--draft-model-path", "/d", "--concurrency", "2,8")
    cfg["server_args"] = ["--dtype", "float32"]
    args, env = bench_serving.server_launch(cfg, "none")
    assert args == [
        "--model-path",
        "/m",
        "--dtype",
        "float32",
        "--max-running-requests",
        "8",
        "--enable-metrics",
        "--sleep-on-idle",
    ]
    assert env == {}
    args, env = bench_serving.server_launch(cfg, "eagle3")
    assert args[args.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert "--decode-log-interval" not in args  # SGLang's default on every server alike
    assert args[args.index("--speculative-draft-model-path") + 1] == "/d"
    assert env == {}
    for algorithm, policy in (("ecospec", None), ("ecospec-confidence", "confidence")):
        args, env = bench_serving.server_launch(cfg, algorithm)
        assert args[args.index("--speculative-algorithm") + 1] == "ECOSPEC"
        assert env.get("SGLANG_ECOSPEC_POLICY") == policy  # ecospec: the server's default
        assert "SGLANG_ECOSPEC_EPS" not in env
    cfg = _cfg(
        "--model-path", "/m", "--draft-model-path", "/d",
        "--ecospec-setting", "policy=adaptive", "--ecospec-setting", "EPS=auto",
    )  # fmt: skip
    assert bench_serving.server_launch(cfg, "ecospec")[1]["SGLANG_ECOSPEC_POLICY"] == "adaptive"
    assert bench_serving.server_launch(cfg, "ecospec")[1]["SGLANG_ECOSPEC_EPS"] == "auto"
    _, env = bench_serving.server_launch(cfg, "ecospec-confidence")
    assert env["SGLANG_ECOSPEC_POLICY"] == "confidence" and "SGLANG_ECOSPEC_EPS" not in env


def test_log_summary_weights_lines_by_steps():
    text = (
        "[t] EcoSpec: 4 verify steps, unique experts/layer/step 10.00, predictor recall 0.500, "
        "verify tokens/step 5.0\nother line\n"
        "[t] EcoSpec: 2 verify steps, unique experts/layer/step 4.00, predictor recall 0.800, "
        "verify tokens/step 5.0\n"
    )
    summary = ecospec_log_summary(text)
    assert summary["verify_steps"] == 6
    assert summary["experts_per_layer_step"] == pytest.approx((40 + 8) / 6)
    assert summary["predictor_recall"] == pytest.approx((2.0 + 1.6) / 6)
    assert summary["spec_accept_length"] is None  # no line reports one
    assert ecospec_log_summary("no statistics")["experts_per_layer_step"] is None


def test_log_summary_reads_the_speculative_steps_acceptance_length():
    text = (
        "[t] EcoSpec: 4 verify steps, unique experts/layer/step 39.23, predictor recall 0.213, "
        "verify tokens/step 42.5, predict ms/step 2.724, acceptance length 1.706 (forecast "
        "1.731), slot copies 73 (routed differently 0)\n"
        "[t] EcoSpec: 2 verify steps, unique experts/layer/step 4.00, predictor recall 0.800, "
        "verify tokens/step 5.0\n"
        "[t] EcoSpec: 12 verify steps, unique experts/layer/step 61.10, predictor recall 0.254, "
        "verify tokens/step 80.0, acceptance length 1.422 (forecast 1.497)\n"
    )
    summary = ecospec_log_summary(text)
    assert summary["verify_steps"] == 18
    assert summary["spec_accept_length"] == pytest.approx((4 * 1.706 + 12 * 1.422) / 16)


METRICS_TEXT = """# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{is_streaming="true",model_name="m"}} {streamed}
sglang:generation_tokens_total{{is_streaming="false",model_name="m"}} 4.0
sglang:spec_verify_calls_total{{model_name="m"}} {verify}
sglang:num_running_reqs{{model_name="m"}} 0.0
"""


def test_metric_totals_sum_label_sets_and_skip_comments():
    totals = metric_totals(METRICS_TEXT.format(streamed="10.0", verify="6.0"))
    assert totals["sglang:generation_tokens_total"] == 14.0
    assert totals["sglang:spec_verify_calls_total"] == 6.0
    assert totals["sglang:num_running_reqs"] == 0.0
    assert "# HELP" not in "".join(totals)


def test_accept_length_is_tokens_per_request_step_of_the_window():
    before = metric_totals(METRICS_TEXT.format(streamed="10.0", verify="6.0"))
    # 2 requests: 2 prefill tokens + 40 tokens from 20 verify steps -> 2.0 per step.
    after = metric_totals(METRICS_TEXT.format(streamed="52.0", verify="26.0"))
    assert accept_length_between(before, after, requests=2) == pytest.approx(2.0)
    plain = metric_totals("sglang:generation_tokens_total 30.0\n")
    assert accept_length_between({}, plain, requests=2) is None


def test_gate_steps_are_counted_per_level_over_the_window():
    before = {"sglang:ecospec_gate_plain_steps_total": 4.0, "sglang:spec_verify_calls_total": 9.0}
    after = {
        "sglang:ecospec_gate_plain_steps_total": 10.0,
        "sglang:ecospec_gate_narrow_steps_total": 3.0,
        "sglang:ecospec_gate_tree_steps_total": 2.0,
        "sglang:spec_verify_calls_total": 20.0,
        "sglang:generation_tokens_total": 17.0,
    }
    assert gate_steps_between(before, after) == {"plain": 6, "narrow": 3, "tree": 2}
    assert gate_steps_between(before, before) is None  # no step in the window
    assert gate_steps_between({}, {"sglang:spec_verify_calls_total": 3.0}) is None  # no gate
    fields = counter_fields(before, after, requests=1)
    assert fields == {"accept_length": pytest.approx(16 / 11), "gate_steps": fields["gate_steps"]}


def test_sharegpt_file_is_what_sglang_reads(tmp_path):
    from sglang.benchmark.datasets.sharegpt import sample_sharegpt_requests
    from sglang_ecospec_cpu.tiny import load_smollm2_tokenizer

    from sgl_ecospec.lab.datasets import load_prompts, render_chat

    path = tmp_path / "mt.json"
    tokenizer = load_smollm2_tokenizer()
    prompts.write_sharegpt_file("mt-bench", 3, 0, path, tokenizer)
    records = json.loads(path.read_text())
    assert len(records) == 3 and all(r["id"].startswith("mt-bench:") for r in records)
    rows = sample_sharegpt_requests(str(path), 3, tokenizer, fixed_output_len=16)
    assert sorted(r.prompt for r in rows) == sorted(r["conversations"][0]["value"] for r in records)
    assert all(r.output_len == 16 for r in rows)
    # The server tokenizes each prompt into the ids the offline engine decodes.
    expected = sorted(
        render_chat(tokenizer, p.text) for p in load_prompts("mt-bench", num_prompts=3, seed=0)
    )
    assert sorted(tokenizer.encode(r.prompt) for r in rows) == expected
    assert all(r.prompt.startswith("<|im_start|>system") for r in rows)


def test_warmup_prompt_shares_the_measured_prompts_template_head(tmp_path):
    """The warmup puts what every measured prompt starts with in the prefix cache."""
    from sglang_ecospec_cpu.tiny import load_smollm2_tokenizer

    path = tmp_path / "mt.json"
    tokenizer = load_smollm2_tokenizer()
    prompts.write_sharegpt_file("mt-bench", 4, 0, path, tokenizer)
    measured = [
        tokenizer.encode(r["conversations"][0]["value"]) for r in json.loads(path.read_text())
    ]
    warmup = tokenizer.encode(prompts.warmup_prompt(tokenizer))
    head = 0
    while all(len(p) > head and p[head] == measured[0][head] for p in measured):
        head += 1
    assert head >= 10  # the system turn and the user header
    assert warmup[:head] == measured[0][:head]
    assert warmup != measured[0][: len(warmup)]  # the head only, no measured prompt itself


def test_table_marks_missing_values():
    table = report.format_table(
        [
            {"algorithm": "none", "concurrency": 1, "completed": 2, "output_throughput": 1.5},
            {
                "algorithm": "ecospec",
                "concurrency": 1,
                "completed": 2,
                "output_throughput": 0.5,
                "mean_tpot_ms": 20.0,
                "accept_length": 1.4,
                "experts_per_layer_step": 6.25,
                "predictor_recall": 0.5,
            },
        ]
    )
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["algorithm", "conc", "done"]
    assert lines[1].split()[-5:] == ["-", "-", "-", "-", "-"]
    assert lines[2].split()[-4:] == ["1.400", "6.25", "0.500", "-"]


def _record(algorithm, concurrency, tok_s, tpot, accept=None):
    return {
        "algorithm": algorithm,
        "concurrency": concurrency,
        "completed": 8,
        "output_throughput": tok_s,
        "mean_tpot_ms": tpot,
        "median_tpot_ms": tpot,
        "mean_ttft_ms": 200.0,
        "accept_length": accept,
        "experts_per_layer_step": None,
        "predictor_recall": None,
        "verify_steps_logged": 0,
        "wall_seconds": 10.0,
    }


def test_rounds_report_medians_and_the_ratio_to_no_speculation():
    rounds = [_record("ecospec", 1, t, 1000 / t, 1.0) for t in (10.0, 30.0, 12.0)]
    combined = report.combine(rounds)
    assert combined["output_throughput"] == 12.0 and combined["accept_length"] == 1.0
    assert combined["completed"] == 24 and combined["wall_seconds"] == 30.0
    assert [r["output_throughput"] for r in combined["rounds"]] == [10.0, 30.0, 12.0]
    assert combined["experts_per_layer_step"] is None  # no value in any round
    assert combined["gate_steps"] is None  # no gate counters
    counted = [
        {**r, "gate_steps": {"plain": p, "narrow": 2, "tree": 1}}
        for r, p in zip(rounds, (1, 5, 9), strict=True)
    ]
    assert report.combine(counted)["gate_steps"] == {"plain": 15, "narrow": 6, "tree": 3}
    runs = [_record("none", 1, 16.0, 60.0), combined, _record("eagle3", 4, 8.0, 90.0)]
    report.add_speed_ratios(runs)
    assert runs[0]["vs_none"] == 1.0 and runs[1]["vs_none"] == pytest.approx(0.75)
    assert runs[2]["vs_none"] is None  # no plain server at concurrency 4


@pytest.mark.e2e
@pytest.mark.skipif(gpu_present(), reason="runs the CPU development mode")
def test_script_runs_servers_and_writes_table(tmp_path):
    from sglang_ecospec_cpu import tiny

    target = tiny.make_tiny_target(tmp_path / "target")
    draft = tiny.make_tiny_draft(target, tmp_path / "draft")
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "bench_serving.sh"),
            "--model-path",
            str(target),
            "--draft-model-path",
            str(draft),
            "--algorithms",
            "none,ecospec",
            "--concurrency",
            "2",
            "--num-prompts",
            "2",
            "--output-len",
            "8",
            "--rounds",
            "2",
            "--json",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env={k: v for k, v in os.environ.items() if k != "SGLANG_ECOSPEC_GATE_MEMORY"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    # The run's ECOSPEC servers share a gate memory of the run's own.
    memory = str(tmp_path / "logs" / "gate-memory")
    assert data["config"]["ecospec_settings"] == {"gate_memory": memory}
    runs = {r["algorithm"]: r for r in data["runs"]}
    assert set(runs) == {"none", "ecospec"}
    for run in runs.values():  # two rounds of two prompts, the medians reported
        assert run["completed"] == 4 and run["output_throughput"] > 0
        assert len(run["rounds"]) == 2
    assert runs["none"]["vs_none"] == 1.0 and runs["ecospec"]["vs_none"] > 0
    assert runs["none"]["experts_per_layer_step"] is None
    assert runs["ecospec"]["accept_length"] >= 1.0
    config = json.loads((target / "config.json").read_text())
    assert (
        config["num_experts_per_tok"]
        <= runs["ecospec"]["experts_per_layer_step"]
        <= config["num_experts"]
    )
    assert "ecospec" in done.stdout.splitlines()[-1]


def test_outputs_are_compared_with_the_plain_server_per_round_and_request():
    def phase(algorithm, texts, concurrency=2):
        return {**_record(algorithm, concurrency, 10.0, 100.0), "generated_texts": texts}

    measured = {
        ("none", 2): [phase("none", ["ab", "cd"]), phase("none", ["ab", "cd"])],
        ("ecospec", 2): [phase("ecospec", ["ab", "cd"]), phase("ecospec", ["ab", "cx y"])],
        ("eagle3", 4): [phase("eagle3", ["ab"], concurrency=4)],  # no plain server at concurrency 4
    }
    runs = [report.combine(records) for records in measured.values()]
    assert all("generated_texts" not in r for r in runs)
    report.compare_outputs(runs, measured)
    plain, ours, unmatched = runs
    assert plain["same_outputs"] == "4/4" and "output_differences" not in plain
    assert ours["same_outputs"] == "3/4"
    assert ours["output_differences"] == [
        {"round": 2, "request": 1, "at": 1, "ours": "x y", "plain": "d"}
    ]
    assert unmatched["same_outputs"] is None
    assert report.format_table(runs).splitlines()[2].split()[-1] == "3/4"


def test_servers_run_one_at_a_time_when_their_memory_does_not_fit(tmp_path, monkeypatch):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (target / "model.safetensors").write_bytes(b"\0" * 1000)
    cfg = {
        "model_path": str(target),
        "draft_model_path": None,
        "server_args": ["--dtype", "float32"],
        "algorithms": ["none", "eagle3", "ecospec"],
        "servers": "auto",
        "cpu": True,
    }
    assert server_memory.served_weight_bytes(cfg) == 2000  # bf16 stored, served as fp32
    overhead = server_memory.SERVER_OVERHEAD_BYTES
    monkeypatch.setattr(server_memory, "_available_memory_bytes", lambda: 8 * overhead)
    assert server_memory.resolve_server_mode(cfg) == "together"
    monkeypatch.setattr(server_memory, "_available_memory_bytes", lambda: 3 * overhead)
    logged = []
    assert server_memory.resolve_server_mode(cfg, logged.append) == "one-at-a-time"
    assert "3 servers need about" in logged[0]
    assert server_memory.resolve_server_mode({**cfg, "cpu": False}, logged.append) == (
        "one-at-a-time"
    )
    assert server_memory.resolve_server_mode({**cfg, "servers": "together"}) == "together"


def test_predicted_tpot_prices_each_phase_by_its_steps_and_the_prefills_between_them():
    from sgl_ecospec.costmodel import formulas, get_hardware, get_model
    from sgl_ecospec.costmodel.performance import MoESDParams, PerformanceModel
    from sgl_ecospec.costmodel.prefill import PrefillLine
    from sgl_ecospec.lab.serving import predicted

    model = get_model("qwen3-30b-a3b")  # 128 experts, top 8
    params = MoESDParams(  # no compute terms: each step is bias + k2 x experts
        bias=0.1, k1=0.0, k2=0.001, k3=0.0, lam=1.0, s=1.0,
        draft_bias=0.01, draft_k=0.0, reject_bias=0.002, reject_k=0.0,
    )  # fmt: skip
    perf = PerformanceModel(model, get_hardware("h200"), params)
    pricing = predicted.Pricing(perf)  # no prefill line: prefills priced by the model
    cfg = {"num_prompts": 4, "num_steps": 3, "num_draft_tokens": 5, "output_len": 10}

    def phase(algorithm, concurrency, accept=None, experts=None):
        return {
            **_record(algorithm, concurrency, 10.0, 100.0, accept),
            "experts_per_layer_step": experts,
            "mean_input_len": 50.0,
        }

    # Concurrency = prompts: one wave, no prefill between decode steps.
    assert predicted.predicted_tpot_ms(phase("none", 4), cfg, pricing) == pytest.approx(
        1000 * float(perf.ar_time(4))
    )
    spec = phase("ecospec", 4, accept=2.0, experts=20.0)
    assert predicted.predicted_tpot_ms(spec, cfg, pricing) == pytest.approx(
        1000 * (3 * 0.01 + 0.1 + 0.001 * 20 + 0.002) / 2
    )
    # An ECOSPEC phase that decoded plainly but for a few probes is priced as none (its
    # logged experts are the probes').
    plain = phase("ecospec", 4, accept=1.004, experts=22.0)
    assert predicted.predicted_tpot_ms(plain, cfg, pricing) == pytest.approx(
        1000 * float(perf.ar_time(4))
    )
    # An ECOSPEC phase whose gate speculated in a share of its steps: its acceptance length
    # 1.2 mixes speculative steps of 2.0 (logged) with plain ones of 1, so 20% speculated.
    mixed = {**phase("ecospec", 4, accept=1.2, experts=20.0), "spec_accept_length": 2.0}
    assert predicted.speculative_share(mixed) == pytest.approx(0.2)
    speculative = 3 * 0.01 + 0.1 + 0.001 * 20 + 0.002
    assert predicted.predicted_tpot_ms(mixed, cfg, pricing) == pytest.approx(
        1000 * (0.2 * speculative + 0.8 * float(perf.ar_time(4))) / 1.2
    )
    # EAGLE3 has no gate: every step speculates whatever it logs.
    assert predicted.speculative_share({**mixed, "algorithm": "eagle3"}) == 1.0
    # Concurrency 2 of 4 prompts: 2 later starts stall 1 other request each, a prefill of 50
    # tokens on every expert (0.1 + 0.128 s) spread over 4 requests' 9 decode intervals.
    stall = (4 - 2) * (2 - 1) / 4 * (0.1 + 0.001 * 128) / 9
    plain2 = phase("none", 2)
    assert predicted.predicted_tpot_ms(plain2, cfg, pricing) == pytest.approx(
        1000 * (float(perf.ar_time(2)) + stall)
    )
    # With the gate's step counters each level is priced as it ran: 2 plain, 6 narrow (one
    # draft forward, 2 tokens per request, uniform-routing union) and 2 tree steps.
    counted = {**mixed, "accept_length": 1.5, "gate_steps": {"plain": 2, "narrow": 6, "tree": 2}}
    assert predicted.speculative_share(counted) == pytest.approx(0.8)
    narrow = 0.01 + float(perf.verify_time(4, 2)) + 0.002
    union = formulas.expected_unique_experts(8, 128, 8)
    assert narrow == pytest.approx(0.01 + 0.1 + 0.001 * union + 0.002)
    assert predicted.predicted_tpot_ms(counted, cfg, pricing) == pytest.approx(
        1000 * (0.2 * float(perf.ar_time(4)) + 0.6 * narrow + 0.2 * speculative) / 1.5
    )
    # With a measured prefill line, the stalls are priced by it: 0.5 + 0.01 x 50 = 1.0 s.
    line = PrefillLine.fit([10, 100], [0.6, 1.5])
    assert predicted.predicted_tpot_ms(plain2, cfg, predicted.Pricing(perf, line)) == (
        pytest.approx(1000 * (float(perf.ar_time(2)) + (4 - 2) * (2 - 1) / 4 * 1.0 / 9))
    )
    assert predicted.predicted_tpot_ms(phase("eagle3", 2), cfg, pricing) is None  # no acceptance
    runs = [plain2, phase("eagle3", 2)]
    predicted.add_predictions(runs, cfg, pricing)
    assert runs[0]["tpot_error"] == pytest.approx(runs[0]["predicted_tpot_ms"] / 100.0 - 1)
    assert runs[1]["predicted_tpot_ms"] is None and runs[1]["tpot_error"] is None
    assert "pred ms" in report.format_table(runs).splitlines()[0]


def test_predict_from_prices_an_earlier_run_and_refuses_a_bad_profile(tmp_path, capsys):
    profile = ROOT / "docs" / "results" / "cpu" / "2026-12-04-bandwidth-calibration.json"
    run = {
        "config": {"num_prompts": 16, "num_steps": 3, "num_draft_tokens": 5, "output_len": 32},
        "runs": [
            {**_record("none", 1, 4.67, 171.0), "mean_input_len": 108.6},
            {**_record("eagle3", 1, 3.73, 230.4, 1.817), "mean_input_len": 108.6},
        ],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert bench_serving.main(["--predict-from", str(path), "--profile", str(profile)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("the calibrated forward (no --server-step)")
    assert lines[1].split()[-2:] == ["ms", "error"]
    # The fitted plain step at batch 1 (bias + k1 G(1) + k2 x 8 experts): 170.8 ms.
    assert lines[2].split()[-2] == "170.8"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench_serving.main(["--predict-from", str(path), "--profile", str(bad)]) == 2
    assert "--profile" in capsys.readouterr().err
    assert bench_serving.main(["--predict-from", str(path)]) == 2


def test_each_round_starts_one_algorithm_later(tmp_path, monkeypatch):
    import contextlib

    import transformers

    order = []

    @contextlib.contextmanager
    def fake_server(cfg, work, algorithm, log_name, log=print):
        order.append((log_name, algorithm))
        yield algorithm

    def fake_measure(cfg, server, algorithm, concurrency, dataset_file, out, warmup):
        return {**_record(algorithm, concurrency, 10.0, 100.0), "generated_texts": ["ab"]}

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    monkeypatch.setattr(bench_serving, "write_sharegpt_file", lambda *args: None)
    monkeypatch.setattr(bench_serving, "warmup_prompt", lambda tokenizer: "hi")
    monkeypatch.setattr(bench_serving, "started_server", fake_server)
    monkeypatch.setattr(bench_serving, "measure", fake_measure)
    cfg = {
        "dataset": "mt-bench",
        "num_prompts": 1,
        "seed": 0,
        "model_path": "m",
        "algorithms": ["none", "eagle3", "ecospec"],
        "concurrency": [1, 2],
        "rounds": 4,
        "servers": "one-at-a-time",
        "ecospec_settings": {"gate_memory": str(tmp_path / "memory")},
    }
    runs = bench_serving.run(cfg, tmp_path, log=lambda line: None)
    assert [name for name, _ in order] == [
        f"server-{a}-r{r}.log"
        for r, algorithms in enumerate(
            (
                ["none", "eagle3", "ecospec"],
                ["eagle3", "ecospec", "none"],
                ["ecospec", "none", "eagle3"],
                ["none", "eagle3", "ecospec"],
            ),
            start=1,
        )
        for a in algorithms
    ]
    assert len(runs) == 6 and all(len(r["rounds"]) == 4 for r in runs)
    assert {r["same_outputs"] for r in runs} == {"4/4"}
    assert bench_serving.round_order(["none"], 3) == ["none"]
