"""Tests of ``sgl-ecospec bench``: argument checks, and the whole command on a fake engine
(JSON schema, table, plot, lossless check) and on tiny models (metrics: test_bench_metrics)."""

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from sgl_ecospec.costmodel import get_model, selection_cost
from sgl_ecospec.lab.bench import cli as bench_cli
from sgl_ecospec.lab.bench import metrics, runs, sweep_plan
from sgl_ecospec.lab.config import BenchConfig
from sgl_ecospec.lab.engine import OracleExpertPredictor, SpecConfig
from sgl_ecospec.lab.engine.stats import StepStats as Step
from sgl_ecospec.ops.options import SERVED_MIN_SCORE

QWEN3 = get_model("qwen3-235b-a22b")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="sgl-ecospec")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def _validate(argv):
    """The configuration of ``bench`` with ``argv``, as the JSON report carries it."""
    return BenchConfig.from_args(_parse(argv)).to_dict()


def test_defaults_validate():
    cfg = _validate([])
    assert cfg["datasets"] == ["mt-bench"]
    assert cfg["policies"] == ["confidence", "ecospec"]
    assert cfg["budgets"] == [4] and cfg["candidates"] == 4 + 2 * 16
    assert cfg["share_buffer"] is True and cfg["predictor"] == "online"
    cfg = _validate(["--budgets", "8,1,2", "--dataset", "gsm8k", "--prompts", "a.jsonl"])
    assert cfg["budgets"] == [1, 2, 4, 8] and cfg["datasets"] == ["gsm8k", "a.jsonl"]
    assert _validate(["--no-share-buffer"])["share_buffer"] is False
    assert cfg["round_sync"] is False and _validate(["--round-sync"])["round_sync"] is True
    assert _validate(["--plot", "--budgets", "1,2"])["budgets"] == [1, 2, 4]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "confidence,greedy"], r"unknown --policy \['greedy'\]"),
        (["--policy", "ecospec,ecospec"], "lists a policy twice"),
        (["--topk", "2", "--steps", "2", "--budget", "6"], r"budget 6 must be in \[1, 5\]"),
        (["--budget", "2", "--budgets", "1,36"], r"budget 36 must be in \[1, 35\]"),
        (["--budget", "0"], r"budget 0 must be in \[1, 35\]"),
        (["--budgets", "1,x"], "--budgets must be comma-separated positive ints"),
        (["--plot"], "--plot draws experts against budget"),
        (["--eps", "0"], "--eps must be > 0"),
        (["--round-sync", "--no-share-buffer"], "--round-sync changes how the batch's one"),
        (["--min-score", "-0.1"], "--min-score must be a draft probability >= 0"),
        (["--min-score", "0.1", "--policy", "confidence,evict"], "--min-score floors ecospec"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--target", "t"], "give both --target and --draft"),
        (["--small", "--target", "t", "--draft", "d"], "conflicts with --target"),
        (["--profile", "qwen9"], "unknown model 'qwen9'"),
        (["--hardware", "a100"], "unknown hardware 'a100'"),
        (["--dataset", "gsm8k,gsm8k"], "listed twice"),
        (["--save-predictor", "p.pt", "--predictor", "oracle"], "writes the online predictor"),
        (["--predictor", "head"], "--predictor head needs --predictor-file"),
        (["--predictor", "oracle", "--predictor-file", "p.pt"], "drop --predictor-file"),
    ],
)
def test_invalid_arguments(argv, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig.from_args(_parse(argv))


def test_argparse_rejects_unknown_predictor(capsys):
    with pytest.raises(SystemExit):
        _parse(["--predictor", "learned"])
    assert "invalid choice: 'learned'" in capsys.readouterr().err


# --- the command on a fake engine --------------------------------------------------------

E, K, L = 16, 2, 3


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, **kwargs):
        assert kwargs["add_generation_prompt"] and kwargs["tokenize"]
        return [1] + [ord(c) % 50 + 3 for c in messages[0]["content"][:12]] + [2]

    def decode(self, ids):
        return " ".join(map(str, ids))


class FakeEngine:
    """Greedy output derived from the prompt; speculative output equal unless corrupted.

    ecospec reads fewer experts than confidence, more with a larger budget.
    """

    corrupt = False
    calls: list = []
    logit_step = 1.0  # the target's logit of token t is t * logit_step (ties: small steps)

    def __init__(self, target_dir, draft_dir, *, device="cpu", dtype=None):
        self.tokenizer = FakeTokenizer()
        self.num_layers, self.num_experts, self.top_k = L, E, K
        self.device = "cpu"
        step = self.logit_step

        def model(ids):
            logits = torch.arange(128.0).expand(*ids.shape, -1) * step
            return types.SimpleNamespace(logits=logits)

        self.target = types.SimpleNamespace(model=model)

    @staticmethod
    def _output(prompt, n):
        return [(sum(prompt) + 7 * i) % 101 for i in range(n)]

    def generate_greedy(self, prompts, max_new_tokens):
        steps = [
            Step(len(prompts), len(prompts), [0] * len(prompts), [min(E, K * len(prompts))] * L)
            for _ in range(max_new_tokens - 1)
        ]
        return types.SimpleNamespace(
            outputs=[self._output(p, max_new_tokens) for p in prompts], steps=steps
        )

    def generate_speculative(
        self,
        prompts,
        max_new_tokens,
        spec,
        predictor=None,
        progress=None,
        calibrator=None,
        exchange=None,
        compare=None,
    ):
        FakeEngine.calls.append((spec, predictor, calibrator, exchange, compare))
        budget = spec.budget
        experts = min(E, K + budget + (2 if spec.policy == "confidence" else 0))
        n = len(prompts)
        predicted = {"predicted_accepted": [0.5] * n, "predicted_accepted_raw": [2.0] * n}
        steps = [
            Step(n, n * (budget + 1), [1] * n, [experts] * L, 0.75, **predicted)
            for _ in range(max_new_tokens // 2)
        ]
        if compare is not None:
            # Each step: the run's set (1 accepted per request), confidence at b (2 more
            # experts, as many accepted), at b - 1 (1 more expert, none accepted).
            for i, step in enumerate(steps):
                more = (0, 2, 1) if i % 2 else (0, 2, 2)
                union = torch.tensor([[[(1 << (experts + m)) - 1]] * L for m in more])
                step.paired_bitmaps = union
                step.paired_accepted = [n, n, 0]
        outputs = [self._output(p, max_new_tokens) for p in prompts]
        if self.corrupt:
            outputs[-1][3] += 1
        return types.SimpleNamespace(outputs=outputs, steps=steps, predictor_recall=0.75)


@pytest.fixture
def fake_engine(monkeypatch):
    module = types.ModuleType("sgl_ecospec.lab.engine")
    module.SpecConfig, module.OfflineEngine = SpecConfig, FakeEngine
    module.OracleExpertPredictor = OracleExpertPredictor
    monkeypatch.setitem(sys.modules, "sgl_ecospec.lab.engine", module)
    monkeypatch.setattr(FakeEngine, "corrupt", False)
    monkeypatch.setattr(FakeEngine, "logit_step", 1.0)
    monkeypatch.setattr(FakeEngine, "calls", [])
    return FakeEngine


HERE = str(Path(__file__).parent)  # any existing directory passes for the fake's checkpoints


def _run(argv):
    args = _parse(["--target", HERE, "--draft", HERE, "--max-new-tokens", "8", *argv])
    return args.run(args)


def test_bench_on_fake_engine_writes_table_json_and_plot(fake_engine, tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--dataset", "mt-bench,gsm8k", "--num-prompts", "3", "--batch-size", "2"]
    argv += ["--budgets", "1,2,8", "--json", str(out_json), "--plot", str(out_png)]
    assert _run(argv) == 0

    table = capsys.readouterr().out
    assert "accept" in table and "speedup" in table and "gsm8k" in table
    main_table = next(b for b in table.split("\n\n") if b.startswith("budget policy     accept"))
    assert len(main_table.splitlines()) == 1 + 8  # header, one row per (budget, policy)
    assert main_table.splitlines()[-1].startswith("     8 ecospec     2.000")

    report = json.loads(out_json.read_text())
    assert set(report) >= {"config", "policies", "sweep", "greedy", "profile", "testbed"}
    assert report["config"]["num_prompts"] == {"mt-bench": 3, "gsm8k": 3}
    assert report["config"]["budgets"] == [1, 2, 4, 8]
    assert set(report["policies"]) == {"confidence", "ecospec"}
    assert len(report["sweep"]) == 4 * 2
    for name, entry in report["policies"].items():
        assert entry["budget"] == 4
        assert isinstance(entry["accept_length"], float) and entry["accept_length"] == 2.0
        assert isinstance(entry["experts_per_layer_step"], float)
        assert isinstance(entry["predictor_recall"], float) and entry["lossless"] is True
        assert set(entry["per_dataset"]) == {"mt-bench", "gsm8k"}
        assert set(entry["predicted"]) >= {"expert_bytes_per_step", "verify_ms", "speedup"}
        assert entry["experts_per_layer_step"] == 6 + 2 * (name == "confidence")
    eco, conf = report["policies"]["ecospec"], report["policies"]["confidence"]
    assert eco["predicted"]["speedup"] > conf["predicted"]["speedup"]
    # 2 datasets x 2 batches of (2, 1) prompts, 4 steps each.
    assert eco["verify_steps"] == 2 * 2 * 4
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # One fresh online predictor per run, shared by that run's batches.
    calls = fake_engine.calls
    assert len(calls) == 8 * 4
    assert {c[0].budget for c in calls} == {1, 2, 4, 8}
    assert len({id(c[1]) for c in calls}) == 8
    # bench times each prediction through a wrapper (predictor_stats.TimedPredictor).
    assert type(calls[0][1].inner).__name__ == "OnlineExpertPredictor"


def test_bench_reports_predicted_against_measured_acceptance(fake_engine, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    argv = ["--dataset", "mt-bench,gsm8k", "--num-prompts", "3", "--batch-size", "2"]
    assert _run([*argv, "--calibrated-acceptance", "--json", str(out_json)]) == 0
    assert "selection by calibrated probabilities" in capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["config"]["calibrated_acceptance"] is True
    for entry in report["policies"].values():
        # The fake accepts 1 draft per step (length 2), forecast 0.5 calibrated, 2.0 raw.
        assert entry["accept_length"] == 2.0
        assert entry["predicted_accept_length"] == 1.5
        assert entry["predicted_accept_length_raw"] == 3.0
        assert entry["predicted_accept_ratio"] == 0.75
        assert entry["predicted_accept_ratio_raw"] == 1.5
        for figures in entry["per_dataset"].values():
            assert figures["predicted_accept_length"] == 1.5
    # Every run selects on calibrated scores and keeps one calibrator over its batches.
    calls = fake_engine.calls
    assert all(call[0].calibrated_acceptance for call in calls)
    per_run = len(calls) // 2
    assert len({id(c[2]) for c in calls[:per_run]}) == 1
    assert {id(c[2]) for c in calls[:per_run]} != {id(c[2]) for c in calls[per_run:]}
    assert type(calls[0][2]).__name__ == "AcceptanceCalibrator"
    assert calls[0][2].max_depth == 3


def test_bench_oracle_predictor_and_jsonl_prompts(fake_engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    out_json = tmp_path / "bench.json"
    argv = ["--prompts", str(prompts), "--num-prompts", "2", "--predictor", "oracle"]
    assert _run([*argv, "--policy", "ecospec", "--json", str(out_json)]) == 0
    # one oracle for the run's batches, so its live recall learns over all of them
    oracles = {id(c[1]) for c in fake_engine.calls}
    assert len(fake_engine.calls) == 2 and len(oracles) == 1
    assert isinstance(fake_engine.calls[0][1], OracleExpertPredictor)
    report = json.loads(out_json.read_text())
    assert list(report["policies"]) == ["ecospec"]
    assert report["config"]["datasets"] == [str(prompts)]


def test_check_lossless_fails_loudly(fake_engine, tmp_path, capsys):
    fake_engine.corrupt = True
    out_json = tmp_path / "bench.json"
    assert _run(["--num-prompts", "2", "--check-lossless", "--json", str(out_json)]) == 1
    err = capsys.readouterr().err
    assert "LOSSLESS CHECK FAILED" in err and "first difference at generated token 3" in err
    assert not out_json.exists()

    # Without the flag the run completes and reports the mismatch.
    assert _run(["--num-prompts", "2", "--json", str(out_json)]) == 0
    assert "warning: not lossless" in capsys.readouterr().err
    report = json.loads(out_json.read_text())
    assert report["policies"]["confidence"]["lossless"] is False
    assert report["policies"]["confidence"]["near_ties"] == 0
    message = report["policies"]["confidence"]["mismatches"][0]
    assert "mt-bench:" in message and "logits of the two tokens differ by 1.0000" in message


def test_divergence_at_a_near_tie_is_reported_not_fatal(fake_engine, tmp_path, capsys):
    fake_engine.corrupt = True
    fake_engine.logit_step = 0.01  # the corrupted token is within 0.01 of the greedy one
    out_json = tmp_path / "bench.json"
    assert _run(["--num-prompts", "2", "--check-lossless", "--json", str(out_json)]) == 0
    assert "tie" in capsys.readouterr().out
    run = json.loads(out_json.read_text())["policies"]["confidence"]
    assert run["lossless"] is False and run["near_ties"] == 2  # both prompts (batch 1)
    assert run["mismatches"][0].endswith("differ by 0.0100 (near tie)")
    assert metrics.lossless_status(run) == "tie"


def test_a_mismatch_among_many_near_ties_is_not_a_tie():
    check = runs.OutputCheck(None, check_lossless=False, label="run")
    check.mismatches = ["mismatch"]
    check.near_ties = [f"tie {i} (near tie)" for i in range(runs.MAX_MISMATCHES + 1)]
    fields = check.fields()
    assert fields["mismatches"][0] == "mismatch" and fields["mismatch_count"] == 1
    assert metrics.lossless_status(fields) == "NO"
    check.mismatches = []
    assert metrics.lossless_status(check.fields()) == "tie"


def test_testbed_without_routing_choice_is_rejected(fake_engine, monkeypatch):
    monkeypatch.setattr(FakeEngine, "__init__", _dense_init)
    with pytest.raises(ValueError, match="routes every token to all 2 experts"):
        _run(["--num-prompts", "1"])


def _dense_init(self, *args, **kwargs):
    self.tokenizer = FakeTokenizer()
    self.num_layers, self.num_experts, self.top_k = 1, 2, 2


def test_checkpoints_and_tokenizer_are_checked(fake_engine, monkeypatch, tmp_path):
    args = _parse(["--target", str(tmp_path / "nope"), "--draft", HERE, "--num-prompts", "1"])
    with pytest.raises(FileNotFoundError, match="--target .*nope' is not a directory"):
        args.run(args)

    def no_tokenizer(self, *a, **kw):
        _dense_init(self)
        self.tokenizer, self.num_experts = None, 16

    monkeypatch.setattr(FakeEngine, "__init__", no_tokenizer)
    with pytest.raises(ValueError, match="has no tokenizer"):
        _run(["--num-prompts", "1"])


def test_pricing_uses_the_chosen_profile(fake_engine, tmp_path):
    results = {}
    for profile in ("qwen3-235b-a22b", "deepseek-v3"):
        path = tmp_path / f"{profile}.json"
        assert _run(["--num-prompts", "1", "--profile", profile, "--json", str(path)]) == 0
        results[profile] = json.loads(path.read_text())
    qwen, deepseek = (results[p]["policies"]["ecospec"]["predicted"] for p in results)
    assert results["deepseek-v3"]["profile"]["num_experts"] == 256
    assert qwen["experts_per_layer_step"] != deepseek["experts_per_layer_step"]
    assert np.isfinite([qwen["speedup"], deepseek["speedup"]]).all()


def test_adaptive_selects_with_the_cost_model_and_the_measured_prices(fake_engine, tmp_path):
    """bench's adaptive is the sweep's: eps and step account of ``selection_cost`` for the
    profile at the batch size, the layer weights priced from the greedy roots' union, and
    the expert prices measured over the run (its JSON entry carries them)."""
    path = tmp_path / "bench.json"
    argv = ["--num-prompts", "2", "--batch-size", "2", "--policy", "confidence,adaptive"]
    assert _run([*argv, "--eps", "7", "--json", str(path)]) == 0
    spec, _, _, exchange, _ = next(c for c in fake_engine.calls if c[0].policy == "adaptive")
    testbed = {"num_layers": L, "num_experts": E, "top_k": K}
    # The fake's greedy steps read min(E, K x 2) experts per layer at batch 2.
    fields = sweep_plan.adaptive_fields("qwen3-235b-a22b", "h200", 2, 4, 3, min(E, 2 * K), testbed)
    cost = selection_cost(runs.performance_model("qwen3-235b-a22b", "h200"), 2, 5, draft_steps=3)
    assert spec.selection.eps == fields["eps"] == cost.eps != 7  # --eps is ecospec's
    assert spec.selection.step_cost == cost.step_cost
    assert spec.layer_weights == pytest.approx(fields["layer_weights"])
    assert spec.recall_weighted_cost is True  # bench's default
    assert exchange.prior == pytest.approx(fields["layer_weights"][0] * L / QWEN3.moe_layers)
    entry = json.loads(path.read_text())["policies"]["adaptive"]
    assert set(entry["expert_exchange"]) == {"prior", "rate", "others"}
    confidence = next(c for c in fake_engine.calls if c[0].policy == "confidence")
    assert confidence[3] is None and confidence[0].selection.eps == 7


def test_min_score_floors_ecospec_and_adaptive_not_the_peers(fake_engine, tmp_path):
    path = tmp_path / "bench.json"
    policies = "confidence,ecospec,adaptive,evict"
    argv = ["--num-prompts", "2", "--budget", "2", "--policy", policies, "--min-score", "0.05"]
    argv.append("--paired")
    assert _run([*argv, "--json", str(path)]) == 0
    floors = {c[0].policy: c[0].selection.min_score for c in fake_engine.calls}
    assert floors == {"confidence": 0.0, "ecospec": 0.05, "adaptive": 0.05, "evict": 0.0}
    compares = [c[4] for c in fake_engine.calls if c[0].policy == "ecospec"][0]
    assert {c.selection.min_score for c in compares} == {0.0}  # confidence's line
    assert json.loads(path.read_text())["config"]["min_score"] == 0.05


def test_the_served_floor_and_recall_weighted_cost_are_the_defaults(fake_engine):
    assert _run(["--num-prompts", "2", "--budget", "2", "--policy", "confidence,ecospec"]) == 0
    runs = {c[0].policy: c[0] for c in fake_engine.calls}
    assert runs["ecospec"].selection.min_score == SERVED_MIN_SCORE > 0
    assert runs["confidence"].selection.min_score == 0.0  # the peers as published
    assert runs["ecospec"].recall_weighted_cost is True
    fake_engine.calls.clear()  # the confidence-only run takes the default floor silently
    argv = ["--num-prompts", "2", "--budget", "2", "--policy", "confidence"]
    assert _run([*argv, "--no-recall-weighted-cost"]) == 0
    assert {c[0].recall_weighted_cost for c in fake_engine.calls} == {False}


def test_paired_scores_ecospec_against_confidence_at_b_and_below(fake_engine, tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--num-prompts", "2", "--budget", "2", "--policy", "confidence,ecospec", "--paired"]
    assert _run([*argv, "--json", str(path)]) == 0
    compares = {c[0].policy: c[4] for c in fake_engine.calls}
    assert compares["confidence"] is None
    assert [(c.policy, c.budget) for c in compares["ecospec"]] == [
        ("confidence", 2),
        ("confidence", 1),
    ]
    line = json.loads(path.read_text())["policies"]["ecospec"]["paired_line"]
    # The fake: the run 4 experts and 1 accepted per step, confidence at 2 two more experts
    # and as many accepted, at 1 one or two more and none accepted.
    assert line["accept_length"] == {"run": 2.0, "confidence_b2": 2.0, "confidence_b1": 1.0}
    assert line["experts_per_layer_step"] == {
        "run": 4.0,
        "confidence_b2": 6.0,
        "confidence_b1": 5.5,
    }
    assert (
        line["line"]
        == line["curve"]
        == {
            "budgets": [1, 2],
            "slope": 0.5,
            "experts_above": -2.0,
            "standard_error": 0.0,
        }
    )
    assert line["steps"] == 2 * 4
    out = capsys.readouterr().out  # the curve is the line here: printed once
    assert "-2.000 experts above confidence's line (b1-b2)" in out and "curve" not in out


@pytest.mark.parametrize(
    "argv", [["--policy", "confidence", "--paired"], ["--budget", "1", "--paired"]]
)
def test_paired_needs_ecospec_or_adaptive_at_a_budget_of_2(argv):
    with pytest.raises(ValueError, match="--paired scores ecospec and adaptive runs"):
        _validate(argv)


# --- end to end on the real engine ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny random Qwen2-MoE target (with a byte tokenizer) and an EAGLE-3 draft fitted to
    its greedy continuations of the prompts (``_models.tiny_chat_models``)."""
    from _models import tiny_chat_models

    root = tmp_path_factory.mktemp("bench_e2e")
    tiny_chat_models(root, ["Hi!", "2+2?", "Yes."], 25)
    return root


def test_bench_end_to_end_on_tiny_models(tiny_models, tmp_path, capsys):
    root = tiny_models
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--target", str(root / "target"), "--draft", str(root / "draft")]
    argv += ["--prompts", str(root / "prompts.jsonl"), "--num-prompts", "3"]
    argv += ["--max-new-tokens", "8", "--batch-size", "2", "--budgets", "1,4"]
    argv += ["--check-lossless", "--json", str(out_json), "--plot", str(out_png)]
    argv += ["--save-predictor", str(tmp_path / "predictor.pt")]
    args = _parse(argv)
    assert args.run(args) == 0
    assert "speedup" in capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["testbed"] == {"num_layers": 4, "num_experts": 16, "top_k": 4}
    assert len(report["sweep"]) == 4 and set(report["policies"]) == {"confidence", "ecospec"}
    for run in report["sweep"]:
        assert run["lossless"] is True
        assert 1.0 <= run["accept_length"] <= 1 + 3
        tokens = 2 * (run["budget"] + 1)  # a full batch of 2
        assert 4 <= run["experts_per_layer_step"] <= min(16, tokens * 4)
        assert 0.0 < run["predictor_recall"] <= 1.0
        assert run["predicted"]["speedup"] > 0
    # The draft was fitted to these very continuations: most drafts are accepted.
    assert report["policies"]["confidence"]["accept_length"] > 2.0
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    # The saved table is a warm start for the plugin on this target: it loads for the
    # target's shape and has observed the run's verify passes.
    from sglang_ecospec.settings import EcoSpecSettings

    from sgl_ecospec.predictors import OnlineExpertPredictor

    saved = OnlineExpertPredictor.load(
        tmp_path / "predictor.pt", num_layers=4, num_experts=16, top_k=4
    )
    assert saved.observe_calls > 0
    assert EcoSpecSettings(predictor_file=str(tmp_path / "predictor.pt")).predictor_file


def test_bench_adaptive_and_paired_end_to_end_on_tiny_models(tiny_models, tmp_path):
    """adaptive runs in bench (it needs the cost model's step account) and stays lossless;
    --paired scores it and ecospec against confidence at the budget and one less."""
    root = tiny_models
    out_json = tmp_path / "bench.json"
    argv = ["--target", str(root / "target"), "--draft", str(root / "draft")]
    argv += ["--prompts", str(root / "prompts.jsonl"), "--num-prompts", "3"]
    argv += ["--max-new-tokens", "8", "--batch-size", "1", "--budget", "3"]
    argv += ["--policy", "confidence,adaptive,ecospec", "--recall-weighted-cost", "--paired"]
    argv += ["--check-lossless", "--json", str(out_json)]
    args = _parse(argv)
    assert args.run(args) == 0
    report = json.loads(out_json.read_text())
    adaptive, confidence = report["policies"]["adaptive"], report["policies"]["confidence"]
    assert adaptive["lossless"] is True and adaptive["expert_exchange"]["rate"] > 0
    assert 1.0 <= adaptive["accept_length"] <= 1 + 3
    # The root's 4 experts, up to 3 candidates' more (K = 4 of E = 16).
    assert 4 <= adaptive["experts_per_layer_step"] <= 16
    assert confidence["lossless"] is True and "paired_line" not in confidence
    for run in (adaptive, report["policies"]["ecospec"]):
        # --paired: the run's own set, scored in the whole-tree pass, is what it verified.
        line = run["paired_line"]
        assert line["steps"] == run["verify_steps"]
        assert line["accept_length"]["run"] == pytest.approx(run["accept_length"])
        assert line["experts_per_layer_step"]["run"] == pytest.approx(run["experts_per_layer_step"])
        # Confidence at k is a prefix of its choice at k + 1: it accepts and loads no more.
        length, experts = line["accept_length"], line["experts_per_layer_step"]
        for k in (1, 2):
            assert length[f"confidence_b{k}"] <= length[f"confidence_b{k + 1}"]
            assert experts[f"confidence_b{k}"] <= experts[f"confidence_b{k + 1}"]
        assert line["line"]["budgets"] == [2, 3]


def test_train_head_then_bench_with_it(tiny_models, tmp_path, capsys):
    from sgl_ecospec.lab.cli import main
    from sgl_ecospec.predictors import LowRankExpertHead, OnlineExpertPredictor

    root = tiny_models
    models = ["--target", str(root / "target"), "--draft", str(root / "draft")]
    head_file, train_json = tmp_path / "head.pt", tmp_path / "train.json"
    argv = ["train-head", *models, "--dataset", str(root / "prompts.jsonl"), "--num-prompts", "3"]
    argv += ["--max-new-tokens", "12", "--batch-size", "2", "--rank", "8", "--epochs", "3"]
    argv += ["--token-buckets", "64", "--out", str(head_file), "--json", str(train_json)]
    argv += ["--save-table", str(tmp_path / "table.pt")]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "recording: batch 2/2" in out.err and "held-out recall" in out.out
    report = json.loads(train_json.read_text())
    assert report["recorded_rows"] > 10 and len(report["history"]) == 3
    assert 0.0 < report["online_recall"] <= 1.0 and 0.0 < report["val_recall"] <= 1.0
    assert 0.0 < report["online_table_val_recall"] <= 1.0
    head = LowRankExpertHead.load(head_file, num_layers=4, num_experts=16, top_k=4)
    assert head.rank == 8 and head.token_buckets == 64
    table = OnlineExpertPredictor.load(tmp_path / "table.pt", num_layers=4, num_experts=16)
    assert table.prior.sum() == report["recorded_rows"] * 4 * 4  # every row, layer, expert

    bench_json = tmp_path / "bench.json"
    argv = ["bench", *models, "--prompts", str(root / "prompts.jsonl"), "--num-prompts", "3"]
    argv += ["--max-new-tokens", "8", "--batch-size", "2", "--check-lossless"]
    argv += ["--predictor", "head", "--predictor-file", str(head_file), "--json", str(bench_json)]
    assert main(argv) == 0
    policies = json.loads(bench_json.read_text())["policies"]
    for run in policies.values():
        assert run["lossless"] is True and 0.0 < run["predictor_recall"] <= 1.0
    # The file's kind must match --predictor.
    assert main([*argv[:-4], "--predictor", "online", "--predictor-file", str(head_file)]) == 2
    assert "holds a LowRankExpertHead; pass --predictor head" in capsys.readouterr().err


def test_testbed_models_are_the_testbed(monkeypatch, tmp_path, capsys):
    import sgl_ecospec.lab.testbed.build as testbed_build
    from sgl_ecospec.lab.config import testbed_models
    from sgl_ecospec.lab.testbed.recipe import RECIPES

    monkeypatch.setenv("SGL_ECOSPEC_CACHE", str(tmp_path / "cache"))
    built = []
    monkeypatch.setattr(testbed_build, "build", lambda recipe: built.append(recipe) or tmp_path)
    assert testbed_models(small=True) == (str(tmp_path / "target"), str(tmp_path / "draft"))
    assert testbed_models(small=False)[0] == str(tmp_path / "target")
    assert built == [RECIPES["small"], RECIPES["full"]]
    # A build is announced on stderr before it starts (nothing is cached here).
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[testbed] building the small testbed (")
    assert err[1].startswith("[testbed] building the full testbed (2 cores: about 8-10 minutes")
    assert err[1].endswith("; later runs reuse it") and str(tmp_path / "cache") in err[1]
