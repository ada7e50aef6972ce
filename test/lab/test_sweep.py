"""Tests of ``sgl-ecospec sweep``: the selection
constants per batch size, the adaptive gate, argument checks, and the whole command on
tiny models (JSON schema, bars, plot)."""

import argparse
import dataclasses
import json

import numpy as np
import pytest
import torch

from sgl_ecospec import select_verify_set
from sgl_ecospec.costmodel import get_model, selection_cost
from sgl_ecospec.costmodel.scaling import scale_unique_experts
from sgl_ecospec.lab.bench import ep_cost, peers, sweep, sweep_plan, sweep_report
from sgl_ecospec.lab.bench.runs import performance_model
from sgl_ecospec.lab.config import SweepConfig
from sgl_ecospec.lab.engine import SpecConfig
from sgl_ecospec.lab.engine.stats import StepStats, rank_loads
from sgl_ecospec.ops.bitmaps import topk_to_bitmap

QWEN3 = get_model("qwen3-235b-a22b")


def step_from_ids(batch, verified, accepted, ids_per_layer, num_experts):
    """A step whose layer l read exactly the experts ``ids_per_layer[l]``."""
    bitmap = torch.stack(
        [topk_to_bitmap(torch.tensor([ids]), num_experts)[0] for ids in ids_per_layer]
    )
    counts = [len(set(ids)) for ids in ids_per_layer]
    return StepStats(batch, verified, accepted, counts, expert_bitmap=bitmap)


# --- selection constants per batch size ---------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser(prog="sgl-ecospec")
    sweep.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sweep", *argv])


def _validate(argv):
    return SweepConfig.from_args(_parse(argv))


def test_testbed_expert_weight():
    same = dataclasses.replace(QWEN3, num_experts=64, top_k=8)
    for union, batch in [(8.0, 1), (30.0, 4), (60.0, 64)]:
        assert sweep_plan.testbed_expert_weight(
            union, batch, num_experts=64, top_k=8, profile=same
        ) == pytest.approx(1.0)
    # The testbed (64 experts) saturates before Qwen3 (128): later testbed experts stand for
    # more of Qwen3's.
    weights = [
        sweep_plan.testbed_expert_weight(u, 64, num_experts=64, top_k=8, profile=QWEN3)
        for u in (8.0, 30.0, 50.0)
    ]
    assert weights == sorted(weights) and weights[-1] > 2 * weights[0]
    # The weight is the pricing's own exchange rate: the derivative of the profile's union
    # (scale_unique_experts, what the run is priced on) by the testbed's at the roots' union.
    for union in (20.0, 57.9):
        h = 1e-4
        scaled = [
            scale_unique_experts(u, num_experts=64, top_k=8, profile=QWEN3)
            for u in (union - h, union + h)
        ]
        assert sweep_plan.testbed_expert_weight(
            union, 64, num_experts=64, top_k=8, profile=QWEN3
        ) == pytest.approx((scaled[1] - scaled[0]) / (2 * h), rel=1e-5)
    # The roots' effective tokens never exceed the batch: a union wider than uniform
    # routing at batch 1 is treated as batch 1.
    assert sweep_plan.testbed_expert_weight(
        30.0, 1, num_experts=64, top_k=8, profile=QWEN3
    ) == sweep_plan.testbed_expert_weight(8.0, 1, num_experts=64, top_k=8, profile=QWEN3)


def test_selection_configs_follow_the_cost_model():
    cfg = _validate(["--profiles", "qwen3-235b-a22b,deepseek-v3", "--ep-sizes", "1,4"])
    testbed = {"num_layers": 2, "num_experts": 16, "top_k": 2}
    configs = sweep_plan.selection_configs(cfg, 32, 6.0, testbed)
    assert set(configs) == {"confidence", "ecospec", "ecospec-ep", "adaptive", "evict", "cascade"}
    perf = performance_model("qwen3-235b-a22b", "h200")
    cost = selection_cost(perf, 32, 5, draft_steps=3)
    adaptive = configs["adaptive"]
    assert adaptive["eps"] == cost.eps and adaptive["step_cost"] == cost.step_cost
    assert adaptive["step_tokens"] == cost.step_tokens == 1.0
    weight = sweep_plan.testbed_expert_weight(6.0, 32, num_experts=16, top_k=2, profile=QWEN3)
    assert adaptive["layer_weights"] == pytest.approx((94 / 2 * weight,) * 2)
    assert configs["ecospec"]["eps"] == cost.eps
    assert configs["evict"]["evict_seconds"] == peers.evict_step_seconds(perf, 32, 4, 3)
    assert configs["cascade"]["policy"] == "confidence"
    ep = configs["ecospec-ep"]
    cost4 = selection_cost(performance_model("qwen3-235b-a22b", "4xh200"), 32, 5, ep_size=4)
    assert ep["eps"] == cost4.eps and ep["num_ranks"] == 4
    assert ep["expert_rank"] == tuple(i // 4 for i in range(16))
    for kwargs in configs.values():
        spec = SpecConfig.from_fields(**kwargs)
        assert spec.budget == 4 and spec.selection.share_buffer
    # At EP 4 adaptive and evict select with the 4-GPU group's cost, the others as at EP 1.
    at4 = sweep_plan.selection_configs(cfg, 32, 6.0, testbed, ep_size=4)
    perf4 = performance_model("qwen3-235b-a22b", "4xh200")
    cost4_steps = selection_cost(perf4, 32, 5, draft_steps=3, ep_size=4)
    assert at4["adaptive"]["eps"] == cost4_steps.eps
    assert at4["adaptive"]["step_cost"] == cost4_steps.step_cost != cost.step_cost
    assert at4["adaptive"]["layer_weights"] == adaptive["layer_weights"]
    # ... and the placement, as the plugin under EP: DeltaCost counts the busiest rank's rise.
    assert at4["adaptive"]["expert_rank"] == ep["expert_rank"]
    assert at4["adaptive"]["num_ranks"] == 4 and "expert_rank" not in adaptive
    assert at4["evict"]["evict_seconds"] == peers.evict_step_seconds(perf4, 32, 4, 3, 4)
    assert at4["evict"]["evict_seconds"] != configs["evict"]["evict_seconds"]
    for policy in ("confidence", "ecospec", "ecospec-ep", "cascade"):
        assert at4[policy] == configs[policy]
    assert sweep_plan.selection_groups("adaptive", [("p", 1), ("q", 4), ("p", 4)]) == [
        (1, [("p", 1)]),
        (4, [("q", 4), ("p", 4)]),
    ]
    assert sweep_plan.selection_groups("confidence", [("p", 1), ("p", 4)]) == [
        (None, [("p", 1), ("p", 4)])
    ]
    policies = ("confidence", "adaptive", "evict", "cascade")
    assert sweep_plan.runs_per_batch(policies, (1, 4)) == 7
    assert configs["confidence"] == {
        "topk": 4,
        "num_steps": 3,
        "budget": 4,
        "share_buffer": True,
        "policy": "confidence",
    }


def test_ecospec_ep_lowers_the_busiest_rank_on_a_constructed_tree():
    """Root experts 0, 1 (rank 0). Node 0 (P 0.6) adds experts 2, 3, also on rank 0; node 1
    (P 0.5) adds 4, 8, 12, one on each other rank. EcoSpec counts 2 < 3 new experts and
    takes node 0; the EP cost sees node 0 raise the busiest rank by 2 and node 1 by 0."""
    cfg = _validate(["--ep-sizes", "1,4"])
    testbed = {"num_layers": 1, "num_experts": 16, "top_k": 2}
    configs = sweep_plan.selection_configs(cfg, 1, 2.0, testbed)
    scores, parents = torch.tensor([[0.6, 0.5]]), torch.tensor([[-1, -1]])
    nodes = topk_to_bitmap(torch.tensor([[[[2, 3, 3]]], [[[4, 8, 12]]]]), 16).view(1, 2, 1, 1)
    root = topk_to_bitmap(torch.tensor([[[0, 1]]]), 16)

    def select(policy):
        kwargs = configs[policy]
        extra = {}
        if "expert_rank" in kwargs:
            extra = {
                "expert_rank": torch.tensor(kwargs["expert_rank"]),
                "num_ranks": kwargs["num_ranks"],
            }
        return select_verify_set(
            scores,
            parents,
            nodes,
            1,
            root_experts=root,
            eps=kwargs["eps"],
            layer_weights=torch.tensor(kwargs["layer_weights"], dtype=torch.float64),
            **extra,
        )

    placement = ep_cost.contiguous_expert_rank(16, 4)
    busiest = {}
    for policy in ("ecospec", "ecospec-ep"):
        chosen = select(policy)
        union = root | nodes[0, chosen[0, 0]]
        busiest[policy] = int(rank_loads(union, placement, 4).amax())
    assert busiest == {"ecospec": 4, "ecospec-ep": 2}


# --- arguments ----------------------------------------------------------------------------


def test_defaults_validate():
    cfg = _validate([]).to_dict()
    assert cfg["batch_sizes"] == [1, 2, 4, 8, 16, 32, 64]
    assert cfg["policies"] == [
        "confidence",
        "ecospec",
        "ecospec-ep",
        "adaptive",
        "evict",
        "cascade",
    ]
    assert cfg["ep_sizes"] == [1, 8]
    assert cfg["profiles"] == ["qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3"]
    assert cfg["hardware"] == "h200" and cfg["dataset"] == "mt-bench"
    assert cfg["budget"] == 4 and cfg["candidates"] == 36
    # Policies are reported in a fixed order (adaptive's gate does not depend on it).
    cfg = _validate(["--policies", "adaptive,confidence", "--batch-sizes", "8,2"]).to_dict()
    assert cfg["policies"] == ["confidence", "adaptive"] and cfg["batch_sizes"] == [2, 8]
    assert [sweep_plan.prompts_per_batch_size(b, 8) for b in (1, 3, 8, 16)] == [8, 9, 8, 16]
    assert (
        sweep_plan.ep_hardware("h200", 1) == "h200"
        and sweep_plan.ep_hardware("h200", 8) == "8xh200"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "confidence,greedy"], r"unknown --policies \['greedy'\]"),
        (["--policies", "ecospec,ecospec"], "lists a name twice"),
        (["--policies", "cascade"], "add confidence to --policies"),
        (["--ep-sizes", "1"], "ecospec-ep selects for expert parallelism"),
        (["--ep-sizes", "1,3"], r"--ep-sizes \[3\]: qwen3-235b-a22b has 128 experts"),
        (["--batch-sizes", "1,0"], "--batch-sizes must be comma-separated positive ints"),
        (["--batch-sizes", "2,2"], "lists a size twice"),
        (["--profiles", "qwen9"], r"unknown --profiles \['qwen9'\]"),
        (["--hardware", "8xh200"], "--hardware is one device"),
        (["--hardware", "a100"], "unknown hardware 'a100'"),
        (["--budget", "36"], r"budget 36 must be in \[1, 35\]"),
        (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--target", "t"], "give both --target and --draft"),
        (["--small", "--target", "t", "--draft", "d"], "conflicts with --target"),
        (["--predictor", "head"], "--predictor head needs --predictor-file"),
        (["--predictor", "oracle", "--predictor-file", "t.pt"], "drop --predictor-file"),
    ],
)
def test_invalid_arguments(argv, message):
    with pytest.raises(ValueError, match=message):
        _validate(argv)


def test_registered_on_the_cli():
    from sgl_ecospec.lab.cli import build_parser

    args = build_parser().parse_args(["sweep", "--batch-sizes", "1,2"])
    assert args.run is sweep.run


# --- the command on tiny models -------------------------------------------------------------

PROFILES = ["qwen3-235b-a22b", "gpt-oss-120b"]
BATCHES = [1, 4]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Qwen2-MoE target (byte tokenizer, 16 experts top-4), an EAGLE-3 draft fitted to
    its greedy continuations of the prompts (accepted often), and an unfitted one (almost
    never accepted)."""
    from _models import tiny_chat_models, train_draft

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sweep")
    texts = [f"Question {i}: what is {i} + {3 * i}?" for i in range(6)]
    target, sequences = tiny_chat_models(root, texts, 40)
    train_draft(target, sequences, 0).save_pretrained(root / "random_draft")
    yield root
    torch.set_num_threads(threads)


def _sweep(root, draft, tmp_path, *extra):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--target", str(root / "target"), "--draft", str(root / draft)]
    argv += ["--dataset", str(root / "prompts.jsonl"), "--num-prompts", "2"]
    argv += ["--batch-sizes", ",".join(map(str, BATCHES)), "--ep-sizes", "1,4"]
    argv += ["--profiles", ",".join(PROFILES), "--max-new-tokens", "10", "--check-lossless"]
    argv += ["--json", str(out_json), "--plot", str(out_png), *extra]
    args = _parse(argv)
    assert args.run(args) == 0
    return json.loads(out_json.read_text()), out_png


@pytest.fixture(scope="module")
def fitted_report(tiny_models, tmp_path_factory):
    return _sweep(tiny_models, "draft", tmp_path_factory.mktemp("fitted"))


def test_sweep_report_schema_and_plot(fitted_report):
    rep, png = fitted_report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(rep) == {
        "note",
        "config",
        "testbed",
        "profiles",
        "hardware",
        "method",
        "greedy",
        "runs",
        "rows",
        "checks",
    }
    assert rep["testbed"]["num_experts"] == 16 and rep["testbed"]["top_k"] == 4
    assert rep["hardware"] == {"1": "h200", "4": "4xh200"}
    assert set(rep["method"]) >= {"unions", "busiest_rank", "ep_pricing", "adaptive_gate"}
    assert [g["batch_size"] for g in rep["greedy"]] == BATCHES
    assert [g["prompts"] for g in rep["greedy"]] == [2, 4]
    policies = rep["config"]["policies"]
    # adaptive and evict run once per EP size (1 and 4), each selecting for it.
    assert len(rep["runs"]) == len(BATCHES) * (len(policies) + 2)
    assert len(rep["rows"]) == len(BATCHES) * len(policies) * len(PROFILES) * 2
    for run in rep["runs"]:
        assert ("selection_ep_size" in run) == (run["policy"] in sweep_plan.EP_SELECTED)
        if run["ran"]:
            assert run["lossless"] is True and run["mismatches"] == []
            assert 1.0 <= run["accept_length"] <= 4.0
            assert 1.0 <= run["verified_per_request"] <= 5.0
            union = run["busiest_rank_experts"]["1"]
            assert union == pytest.approx(run["experts_per_layer_step"])
            assert union / 4 <= run["busiest_rank_experts"]["4"] <= min(union, 4)
        if run["policy"] in ("confidence", "ecospec", "ecospec-ep"):
            assert run["ran"] and run["verified_per_request"] == 5.0
        if run["policy"] == "evict":  # a prefix of confidence's choice, down to the root alone
            assert run["ran"] and 1.0 <= run["verified_per_request"] <= 5.0
    row_keys = {
        "batch_size",
        "policy",
        "profile",
        "ep_size",
        "speculates",
        "accept_length",
        "verified_per_request",
        "experts_per_layer_step",
        "experts_per_layer_step_scaled",
        "busiest_rank_experts",
        "busiest_rank_experts_scaled",
        "step_ms",
        "verify_ms",
        "ar_ms",
        "speedup",
        "speedup_stderr",
    }
    for row in rep["rows"]:
        assert set(row) - {"rule_speedup"} == row_keys
        assert np.isfinite([row["speedup"], row["step_ms"], row["ar_ms"]]).all()
        if row["ep_size"] == 1:
            assert row["busiest_rank_experts_scaled"] == pytest.approx(
                row["experts_per_layer_step_scaled"]
            )
    assert set(rep["checks"]) == {
        "adaptive_not_slower",
        "adaptive_within_noise_of_confidence",
        "adaptive_not_below_peers",
        "ecospec_expert_reduction",
        "ecospec_ep_lowers_busiest_rank",
        "ecospec_expert_reduction_paired",
        "ecospec_ep_lowers_busiest_rank_paired",
        "adaptive_above_evict_paired",
    }
    assert rep["checks"]["adaptive_above_evict_paired"]["passed"] is None  # not --paired
    printed = sweep_report.format_tables(rep)
    assert "# measured on the testbed" in printed and "# bars" in printed
    assert "predicted for gpt-oss-120b on 4xh200 (EP 4)" in printed
    assert len(printed.splitlines()) > len(rep["rows"])


def test_adaptive_is_never_slower_than_no_speculation(fitted_report):
    rep, _ = fitted_report
    rows = {(r["batch_size"], r["policy"], r["profile"], r["ep_size"]): r for r in rep["rows"]}
    runs = {
        (r["batch_size"], r["policy"], r["selection_ep_size"]): r
        for r in rep["runs"]
        if r["policy"] == "adaptive"
    }
    for (batch, policy, profile, ranks), row in rows.items():
        if policy != "adaptive":
            continue
        run = runs[batch, "adaptive", ranks]  # the run that selected for this EP size
        # The gate: speculate exactly where the adaptive run itself is predicted to pay (its
        # own figure is kept when it closed the gate), whatever confidence's prediction.
        own = row["speedup"] if row["speculates"] else row["rule_speedup"]
        assert row["speculates"] == (own > 1.0)
        if "rule_speedup" in row:
            assert row["rule_speedup"] <= 1.0
        assert run["speculates"][profile] == {str(ranks): row["speculates"]}
        if row["speculates"]:
            assert row["accept_length"] == run["accept_length"]
            assert row["verified_per_request"] == run["verified_per_request"]
        else:
            assert row["speedup"] == 1.0 and row["step_ms"] == row["ar_ms"]
        assert row["speedup"] >= 1.0
    assert rep["checks"]["adaptive_not_slower"]["passed"] is True


def test_cascade_is_confidence_behind_the_gate(fitted_report):
    rep, _ = fitted_report
    rows = {(r["batch_size"], r["policy"], r["profile"], r["ep_size"]): r for r in rep["rows"]}
    runs = {(r["batch_size"], r["policy"]): r for r in rep["runs"]}
    greedy = {g["batch_size"]: g for g in rep["greedy"]}
    for (batch, policy, profile, ranks), row in rows.items():
        if policy != "cascade":
            continue
        confidence = rows[batch, "confidence", profile, ranks]
        assert row["speculates"] == (confidence["speedup"] > 1.0)
        assert runs[batch, "cascade"]["speculates"][profile][str(ranks)] == row["speculates"]
        if row["speculates"]:
            assert row == {**confidence, "policy": "cascade"}
        else:
            assert row["speedup"] == 1.0 and row["accept_length"] == 1.0
            assert row["experts_per_layer_step"] == greedy[batch]["experts_per_layer_step"]
    for batch in BATCHES:
        cascade, confidence = runs[batch, "cascade"], runs[batch, "confidence"]
        if cascade["ran"]:
            assert cascade["same_run_as"] == "confidence"
            assert cascade["accept_length"] == confidence["accept_length"]
    assert rep["checks"]["adaptive_not_below_peers"]["passed"] in (True, False)


def test_adaptive_does_not_speculate_where_it_cannot_pay(tiny_models, tmp_path):
    # An unfitted draft is (almost) never accepted, so no speculation pays anywhere.
    rep, _ = _sweep(tiny_models, "random_draft", tmp_path, "--policies", "confidence,adaptive")
    confidence = [r for r in rep["rows"] if r["policy"] == "confidence"]
    assert all(r["speedup"] < 1.0 for r in confidence)
    for row in rep["rows"]:  # adaptive ran, found its own speculation slower, decodes plainly
        if row["policy"] == "adaptive":
            assert not row["speculates"] and row["speedup"] == 1.0
            assert row["rule_speedup"] <= 1.0
            assert row["accept_length"] == 1.0 and row["verified_per_request"] == 1.0
    greedy = {g["batch_size"]: g for g in rep["greedy"]}
    assert all(
        r["experts_per_layer_step"] == greedy[r["batch_size"]]["experts_per_layer_step"]
        for r in rep["rows"]
        if r["policy"] == "adaptive"
    )
    checks = rep["checks"]
    assert checks["adaptive_not_slower"]["passed"] is True
    assert checks["adaptive_within_noise_of_confidence"]["passed"] is True
    assert checks["ecospec_expert_reduction"]["passed"] is None  # ecospec not run


def test_oracle_predictor_sweep(tiny_models, tmp_path):
    rep, _ = _sweep(tiny_models, "draft", tmp_path, "--policies", "ecospec,ecospec-ep")
    assert rep["config"]["predictor"] == "online"
    assert all(r["predictor_recall"] < 1.0 for r in rep["runs"])
    rep, _ = _sweep(
        tiny_models, "draft", tmp_path, "--policies", "ecospec,ecospec-ep", "--predictor", "oracle"
    )
    assert rep["config"]["predictor"] == "oracle"
    assert [r["predictor_recall"] for r in rep["runs"]] == [1.0] * 2 * len(BATCHES)


def test_warm_started_predictor_sweep(tiny_models, tmp_path):
    from sgl_ecospec.lab.datasets import render_chat
    from sgl_ecospec.lab.engine import OfflineEngine
    from sgl_ecospec.predictors import OnlineExpertPredictor

    missing = str(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="missing.pt' does not exist"):
        _validate(["--predictor-file", missing])
    # A table that has seen the greedy routing of every prompt predicts far better than an
    # empty one from the first step on.
    engine = OfflineEngine(str(tiny_models / "target"), str(tiny_models / "draft"))
    rep, _ = _sweep(tiny_models, "draft", tmp_path, "--policies", "ecospec")
    cold = {r["batch_size"]: r["predictor_recall"] for r in rep["runs"]}
    table = OnlineExpertPredictor(engine.num_layers, engine.num_experts, engine.top_k)
    prompts = [json.loads(line)["prompt"] for line in open(tiny_models / "prompts.jsonl")]
    prompts = [render_chat(engine.tokenizer, p) for p in prompts]
    outputs = engine.generate_greedy(prompts, 10).outputs
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            out = engine.target.model(ids, output_router_logits=True)
        routing = torch.stack([g.topk(engine.top_k, -1).indices for g in out.router_logits], 1)
        table.observe(ids[0], routing)
    table.save(tmp_path / "table.pt")
    rep, _ = _sweep(
        tiny_models,
        "draft",
        tmp_path,
        "--policies",
        "ecospec",
        "--predictor-file",
        str(tmp_path / "table.pt"),
    )
    assert rep["config"]["predictor_file"] == str(tmp_path / "table.pt")
    warm = {r["batch_size"]: r["predictor_recall"] for r in rep["runs"]}
    assert all(warm[b] > cold[b] for b in BATCHES), (warm, cold)


def test_paired_sweep_on_the_engine(tiny_models, tmp_path):
    policies = "confidence,ecospec,ecospec-ep,adaptive,evict"
    rep, _ = _sweep(tiny_models, "draft", tmp_path, "--policies", policies, "--paired")
    assert rep["config"]["paired"] is True
    for run in rep["runs"]:
        if run["policy"] not in sweep_plan.PAIRED_AGAINST or not run.get("ran", True):
            assert "paired" not in run
            continue
        paired = run["paired"]
        assert paired["against"] == sweep_plan.PAIRED_AGAINST[run["policy"]]
        assert paired["steps"] > 0
        assert set(paired) == {
            "against",
            "steps",
            "steps_differ",
            "experts_per_layer_step",
            "busiest_rank_experts_ep4",
            "draft_score",
            "accepted",
        }
        # The run's own sets are the ones it verified (the tiny target routes the whole
        # tree as it routes the verify rows).
        assert paired["experts_per_layer_step"]["run"] == pytest.approx(
            run["experts_per_layer_step"]
        )
        assert paired["busiest_rank_experts_ep4"]["run"] == pytest.approx(
            run["busiest_rank_experts"]["4"]
        )
        line = sweep_report.run_line(run)
        assert f"paired vs {paired['against']}: experts " in line and "busiest EP4 " in line
        for value in paired.values():
            if isinstance(value, dict):
                assert value["difference"] == pytest.approx(value["run"] - value["against"])
                assert value["stderr"] >= 0
    # Adaptive's rows priced on the same trees as evict's cut: both speedups and their
    # difference; the adaptive run's own set is priced as its run is.
    adaptive = [
        row for row in rep["rows"] if row["policy"] == "adaptive" and "paired_speedup" in row
    ]
    assert adaptive, "adaptive should speculate somewhere on the fitted draft"
    for row in adaptive:
        paired = row["paired_speedup"]
        assert paired["against"] == "evict"
        assert paired["run"] == pytest.approx(row["speedup"], rel=1e-6)
        assert paired["difference"] == pytest.approx(paired["run"] - paired["compared"])
    assert rep["checks"]["adaptive_above_evict_paired"]["passed"] is not None
    assert "paired vs evict: " in sweep_report.format_tables(rep)
    # Confidence takes the top draft scores, so ecospec's sets never score higher.
    eco = [r for r in rep["runs"] if r["policy"] == "ecospec"]
    assert all(r["paired"]["draft_score"]["difference"] <= 1e-9 for r in eco)
    checks = rep["checks"]
    assert checks["ecospec_expert_reduction_paired"]["passed"] is not None
    assert len(checks["ecospec_ep_lowers_busiest_rank_paired"]["detail"]) == len(BATCHES)
    printed = sweep_report.format_tables(rep)
    assert "# paired on the same trees" in printed
    assert "ecospec-ep   ecospec " in printed
