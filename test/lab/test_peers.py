"""The benchmark's peers: evict's truncation against a brute-force search, cascade's gate,
the policy names in the run configurations, and both peers plus the Pareto plot in a bench
run on tiny models."""

import argparse
import json

import pytest
import torch
from _selection import assert_valid_selection, random_tree

from sgl_ecospec import select_verify_set
from sgl_ecospec.costmodel.expert_parallel import uniform_ep_verify_time
from sgl_ecospec.lab.bench import cli as bench_cli
from sgl_ecospec.lab.bench import pareto, peers, sweep, sweep_run
from sgl_ecospec.lab.bench.runs import performance_model
from sgl_ecospec.lab.config import BenchConfig, SweepConfig
from sgl_ecospec.lab.engine import ENGINE_SELECTION, SpecConfig
from sgl_ecospec.lab.engine.evict import confidence_order, evict_selection
from sgl_ecospec.lab.engine.stats import StepStats

# --- evict: the truncation against a brute-force search ---------------------------------


def brute_force_evict(scores, parents, budget, seconds, step_tokens=1.0):
    """Plain Python: confidence's frontier greedy for ``budget`` nodes (highest score, ties to
    the lowest index), then every prefix length k tried; the first best k wins."""
    rows = []
    for b in range(scores.shape[0]):
        score = [float(s) for s in scores[b].double()]
        parent = [int(p) for p in parents[b]]
        order, taken = [], set()
        for _ in range(budget):
            frontier = [
                i
                for i in range(len(score))
                if i not in taken and (parent[i] < 0 or parent[i] in taken)
            ]
            if not frontier:
                break
            best = max(frontier, key=lambda i: (score[i], -i))
            order.append(best)
            taken.add(best)
        rates = []
        for k in range(len(order) + 1):
            expected = step_tokens
            for i in order[:k]:
                expected += score[i]
            rates.append(expected / seconds[k])
        k = rates.index(max(rates))
        rows.append((order, sorted(order[:k]) + [-1] * (budget - k)))
    return rows


def _confidence(scores, parents, node_experts, budget):
    return select_verify_set(
        scores, parents, node_experts, budget, policy="confidence", impl="reference"
    )


@pytest.mark.parametrize("tie_levels", [0, 3])
def test_evict_matches_brute_force_on_random_trees(tie_levels):
    gen = torch.Generator().manual_seed(7)
    for trial in range(40):
        batch = 1 + trial % 4
        num_nodes = 3 + trial % 9
        budget = 1 + trial % num_nodes
        scores, parents, node_experts, _ = random_tree(
            gen, batch, num_nodes, 2, 16, 2, tie_levels=tie_levels
        )
        # Increasing step seconds: a fixed part and a random rise per verified token; some
        # trials rise steeply (k = 0 is best), some barely (the whole choice is kept).
        rise = torch.rand(budget, generator=gen, dtype=torch.float64) * (0.02, 0.5, 3.0)[trial % 3]
        seconds = torch.cat([torch.ones(1, dtype=torch.float64), 1 + rise.cumsum(0)])
        selected = _confidence(scores, parents, node_experts, budget)
        order = confidence_order(scores, parents, selected)
        got = evict_selection(scores, parents, selected, seconds)
        expected = brute_force_evict(scores, parents, budget, seconds.tolist())
        assert order.tolist() == [o + [-1] * (budget - len(o)) for o, _ in expected]
        assert got.tolist() == [row for _, row in expected]
        assert_valid_selection(got, parents, budget, full=False)
        # Every prefix of the order is ancestor-closed, and the cut is a prefix of it.
        for b, row in enumerate(got.tolist()):
            kept = [i for i in row if i >= 0]
            assert set(kept) == set(order[b, : len(kept)].tolist())
            assert set(kept) <= set(selected[b].tolist())


def test_evict_extremes_and_ties():
    scores = torch.tensor([[0.5, 0.5, 0.25, 0.5]])  # ties: the lowest index first
    parents = torch.tensor([[-1, -1, 0, 2]])  # node 3's score rises over its parent's
    selected = torch.tensor([[0, 1, 2, 3]])
    assert confidence_order(scores, parents, selected).tolist() == [[0, 1, 2, 3]]
    flat = torch.ones(5, dtype=torch.float64)
    assert evict_selection(scores, parents, selected, flat).tolist() == [[0, 1, 2, 3]]
    steep = torch.tensor([1.0, 10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    assert evict_selection(scores, parents, selected, steep).tolist() == [[-1, -1, -1, -1]]
    # Rates (1 + sum P) / seconds: 1/1, 1.5/1.5, 2/2, 2.25/2.25, 2.75/2.75 all tie: k = 0.
    tied = torch.tensor([1.0, 1.5, 2.0, 2.25, 2.75], dtype=torch.float64)
    assert evict_selection(scores, parents, selected, tied).tolist() == [[-1, -1, -1, -1]]
    # Best at k = 2: 2 / 1.6 = 1.25 beats 1/1, 1.5/1.4, 2.25/2.0 and 2.75/2.5.
    best_two = torch.tensor([1.0, 1.4, 1.6, 2.0, 2.5], dtype=torch.float64)
    assert evict_selection(scores, parents, selected, best_two).tolist() == [[0, 1, -1, -1]]
    # Padding in the choice: k never counts it.
    short = torch.tensor([[1, -1, -1, -1]])
    order = confidence_order(scores, parents, short)
    assert order.tolist() == [[1, -1, -1, -1]]
    assert evict_selection(scores, parents, short, flat).tolist() == [[1, -1, -1, -1]]
    with pytest.raises(ValueError, match=r"step_seconds must have shape \[S \+ 1\] = \[5\]"):
        evict_selection(scores, parents, selected, flat[:4])


def test_evict_step_seconds_depend_on_tokens_only():
    perf = performance_model("qwen3-235b-a22b", "h200")
    seconds = peers.evict_step_seconds(perf, 4, 3, 3)
    assert len(seconds) == 4 and list(seconds) == sorted(seconds)
    fixed = 3 * perf.draft_time(4) + perf.reject_time(4)
    for k, s in enumerate(seconds):
        assert s == pytest.approx(fixed + perf.verify_time(4, 1 + k))
    fields = peers.spec_fields("evict", perf, 4, 3, 3)
    spec = SpecConfig.from_fields(topk=2, num_steps=2, budget=3, **fields)
    assert spec.evict_seconds == seconds and spec.selection.policy == "confidence"
    assert spec.policy == "evict"
    assert peers.spec_fields("cascade", perf, 4, 3, 3) == {"policy": "confidence"}
    assert peers.spec_fields("ecospec", perf, 4, 3, 3) == {"policy": "ecospec"}
    # Under EP the profiled step is the EP deployment's: its experts load at the busiest
    # rank's pace, so every k costs more than the union alone says.
    perf8 = performance_model("qwen3-235b-a22b", "8xh200")
    at8 = peers.evict_step_seconds(perf8, 4, 3, 3, ep_size=8)
    fixed8 = 3 * perf8.draft_time(4) + perf8.reject_time(4)
    for k, s in enumerate(at8):
        assert s == pytest.approx(fixed8 + uniform_ep_verify_time(perf8, 4, 1 + k, 8))
        assert s > fixed8 + perf8.verify_time(4, 1 + k)
    assert peers.spec_fields("evict", perf8, 4, 3, 3, 8)["evict_seconds"] == at8


def test_spec_config_checks_evict_seconds():
    with pytest.raises(ValueError, match="policy 'evict' needs evict_seconds: budget \\+ 1"):
        SpecConfig.from_fields(budget=2, policy="evict")
    with pytest.raises(ValueError, match="needs evict_seconds: budget \\+ 1 = 3"):
        SpecConfig(budget=2, evict_seconds=(1.0, 2.0))
    with pytest.raises(ValueError, match="needs evict_seconds"):
        SpecConfig(budget=2, evict_seconds=(1.0, 0.0, 2.0))
    with pytest.raises(ValueError, match="evict_seconds is for policy 'evict', not 'confidence'"):
        SpecConfig.from_fields(budget=2, evict_seconds=(1.0, 2.0, 3.0))
    ecospec = ENGINE_SELECTION.replace(policy="ecospec")
    with pytest.raises(ValueError, match="cuts confidence's choice, but selection.policy is 'eco"):
        SpecConfig(budget=2, selection=ecospec, evict_seconds=(1.0, 2.0, 3.0))
    evict = SpecConfig(budget=2, evict_seconds=[1, 2, 3])
    assert evict.policy == "evict" and evict.evict_seconds == (1.0, 2.0, 3.0)
    assert evict == SpecConfig.from_fields(budget=2, policy="evict", evict_seconds=(1, 2, 3))


# --- cascade: the gate -------------------------------------------------------------------


def _greedy_steps():
    return [StepStats(2, 2, [0, 0], [3, 5]) for _ in range(4)]


def _confidence_entry(speedup):
    return {
        "policy": "confidence",
        "budget": 4,
        "accept_length": 2.5,
        "experts_per_layer_step": 9.0,
        "lossless": True,
        "wall_seconds": 3.0,
        "predicted": {"speedup": speedup},
    }


def test_cascade_entry_follows_the_gate():
    perf = performance_model("qwen3-235b-a22b", "h200")
    shape = {"num_experts": 16, "top_k": 2}
    opened = peers.cascade_entry(_confidence_entry(1.2), _greedy_steps(), perf, **shape)
    assert opened["policy"] == "cascade" and opened["speculates"] is True
    assert opened["accept_length"] == 2.5 and opened["predicted"]["speedup"] == 1.2
    assert opened["gate"] == {"open": True, "confidence_speedup": 1.2}
    for speedup in (1.0, 0.7):  # no faster than plain decoding: the gate closes
        closed = peers.cascade_entry(_confidence_entry(speedup), _greedy_steps(), perf, **shape)
        assert closed["speculates"] is False and closed["gate"]["open"] is False
        assert closed["accept_length"] == 1.0 and closed["experts_per_layer_step"] == 4.0
        assert closed["predicted"]["speedup"] == 1.0 and closed["lossless"] is True
        assert closed["predicted"]["verify_ms"] == closed["predicted"]["ar_ms"] > 0
        assert "closed: plain decoding" in peers.gate_note(closed)
    assert peers.gate_note({"policy": "confidence"}) is None


def test_cascade_reuses_confidence_in_bench_order():
    runs = [(b, p) for b in (2, 4) for p in peers.run_order(["cascade", "evict", "confidence"])]
    assert runs[:3] == [(2, "evict"), (2, "confidence"), (2, "cascade")]
    assert peers.decoded_runs(runs) == [(2, "evict"), (2, "confidence")] + [
        (4, "evict"),
        (4, "confidence"),
    ]
    assert peers.decoded_runs([(4, "cascade")]) == [(4, "cascade")]  # no confidence: decodes


KEYS = [("p", 1), ("p", 8)]
SPEEDUPS = {
    "confidence": {("p", 1): 0.9, ("p", 8): 1.3},
    "evict": {("p", 1): 0.95, ("p", 8): 1.35},
    "adaptive": {("p", 1): 1.1, ("p", 8): 1.2},
}


def _batch(policies):
    ran = []

    def run_policy(policy, gate, ep_size):
        entry = {"policy": policy}
        if gate is not None:
            entry["speculates"] = {"p": {str(r): on for (_, r), on in gate.items()}}
            if not any(gate.values()):
                return {**entry, "ran": False}, None
        ran.append(policy)
        return {**entry, "ran": True}, ["a step"]

    def price(entry, steps, key):
        source = "confidence" if entry["policy"] == "cascade" else entry["policy"]
        return {"speculates": True, "speedup": SPEEDUPS[source][key]}

    def no_speculation(key):
        return {"speculates": False, "speedup": 1.0}

    entries, rows = sweep_run.batch_results(policies, KEYS, run_policy, price, no_speculation)
    return entries, rows, ran


def test_sweep_gates_cascade_by_confidence_and_adaptive_by_itself():
    forward = _batch(["confidence", "evict", "adaptive", "cascade"])
    entries, rows, ran = _batch(["cascade", "adaptive", "evict", "confidence"])
    assert (entries, rows) == forward[:2]
    assert ran.index("confidence") < ran.index("cascade")  # cascade's gate input first
    # adaptive's own run pays at both keys, whatever confidence's prediction.
    assert [e["speculates"] for e in entries["adaptive"]] == [
        {"p": {"1": True}},
        {"p": {"8": True}},
    ]
    assert rows["adaptive"][("p", 1)] == {"speculates": True, "speedup": 1.1}
    assert [e["speculates"] for e in entries["cascade"]] == [{"p": {"1": False, "8": True}}]
    assert rows["cascade"][("p", 1)] == {"speculates": False, "speedup": 1.0}
    assert rows["cascade"][("p", 8)] == {"speculates": True, "speedup": 1.3}
    assert len(entries["evict"]) == 2  # one run per EP size, not gated
    assert all("speculates" not in e for e in entries["evict"])
    assert rows["evict"][("p", 1)]["speedup"] == 0.95


# --- names and options in the run configurations -----------------------------------------


def _parse(module, command, argv):
    parser = argparse.ArgumentParser(prog="sgl-ecospec")
    module.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args([command, *argv])


def test_configurations_accept_the_peers():
    cfg = BenchConfig.from_args(_parse(bench_cli, "bench", ["--policy", "evict,cascade"]))
    assert cfg.policies == ("evict", "cascade") and cfg.pareto is False
    assert "pareto" not in cfg.to_dict() and "pareto_eps" not in cfg.to_dict()
    with pytest.raises(ValueError, match=r"unknown --policy \['evicted'\].*'evict', 'cascade'"):
        BenchConfig.from_args(_parse(bench_cli, "bench", ["--policy", "evicted"]))
    argv = ["--pareto", "p.png", "--pareto-eps", "1,0.5,1"]
    cfg = BenchConfig.from_args(_parse(bench_cli, "bench", argv))
    assert cfg.pareto is True and cfg.pareto_eps == (0.5, 1.0)
    for bad, message in (("0,1", "numbers > 0"), ("x", "comma-separated numbers")):
        with pytest.raises(ValueError, match=f"--pareto-eps must be {message}"):
            BenchConfig.from_args(_parse(bench_cli, "bench", ["--pareto-eps", bad]))
    sweep_cfg = SweepConfig.from_args(
        _parse(sweep, "sweep", ["--policies", "cascade,evict,confidence"])
    )
    assert sweep_cfg.policies == ("confidence", "evict", "cascade")
    assert SweepConfig().policies[-2:] == ("evict", "cascade")
    with pytest.raises(ValueError, match="cascade: the per-batch-size gate .* add confidence"):
        SweepConfig(policies=("evict", "cascade"))


def test_pareto_extra_runs():
    cfg = BenchConfig(
        topk=2, steps=2, budget=2, budgets=(4,), policies=("confidence", "ecospec"), pareto=True
    )
    assert pareto.confidence_budgets(cfg) == (1, 2, 3, 4, 5)  # 6 candidates
    assert pareto.ecospec_eps(cfg) == (0.01, 0.03, 0.1, 0.3, 1.0)
    assert pareto.extra_runs(cfg) == [(1, "confidence", 0.1), (3, "confidence", 0.1)] + [
        (5, "confidence", 0.1)
    ] + [(2, "ecospec", e) for e in (0.01, 0.03, 0.3, 1.0)]
    assert "7 extra runs" in pareto.announce(cfg)
    without = BenchConfig(pareto=True, policies=("evict",), pareto_eps=(0.5,))
    assert pareto.extra_runs(without) == [(b, "confidence", 0.1) for b in range(1, 8)] + [
        (4, "ecospec", 0.5)
    ]


# --- on tiny models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny random Qwen2-MoE target (byte tokenizer) and an EAGLE-3 draft fitted to its
    greedy continuations of the prompts (``_models.tiny_chat_models``)."""
    from _models import tiny_chat_models

    root = tmp_path_factory.mktemp("peers")
    tiny_chat_models(root, ["Hi!", "2+2?", "Yes."], 25)
    return root


def test_evict_in_the_engine_is_lossless_and_cuts(tiny_models):
    from sgl_ecospec.lab.datasets import load_prompts, render_chat
    from sgl_ecospec.lab.engine import OfflineEngine

    engine = OfflineEngine(str(tiny_models / "target"), str(tiny_models / "draft"))
    ids = [
        render_chat(engine.tokenizer, p.text)
        for p in load_prompts(str(tiny_models / "prompts.jsonl"))
    ]
    greedy = engine.generate_greedy(ids, 8).outputs
    tree = {"topk": 2, "num_steps": 2, "budget": 3}
    confidence = engine.generate_speculative(ids, 8, SpecConfig(**tree))
    runs = {}
    for name, seconds in (("flat", (1.0,) * 4), ("steep", (1.0, 9.0, 18.0, 27.0))):
        spec = SpecConfig(**tree, evict_seconds=seconds)
        runs[name] = engine.generate_speculative(ids, 8, spec)
        assert runs[name].outputs == greedy
    # Flat seconds keep confidence's whole choice; steep ones verify the roots alone.
    flat, steep = runs["flat"].steps, runs["steep"].steps
    assert [s.verified_tokens for s in flat] == [s.verified_tokens for s in confidence.steps]
    assert [s.accepted for s in flat] == [s.accepted for s in confidence.steps]
    assert all(s.verified_tokens == s.batch_size and sum(s.accepted) == 0 for s in steep)


@pytest.mark.slow  # nine runs (three in the table, six for the Pareto lines): about 30 s
def test_bench_peers_and_pareto_on_tiny_models(tiny_models, tmp_path, capsys):
    root = tiny_models
    out_json, out_png = tmp_path / "bench.json", tmp_path / "pareto.png"
    argv = ["--target", str(root / "target"), "--draft", str(root / "draft")]
    argv += ["--prompts", str(root / "prompts.jsonl"), "--num-prompts", "3"]
    argv += ["--max-new-tokens", "8", "--batch-size", "2", "--topk", "2", "--steps", "2"]
    argv += ["--budget", "2", "--policy", "cascade,confidence,ecospec,evict"]
    argv += ["--pareto", str(out_png), "--pareto-eps", "0.05,1", "--check-lossless"]
    argv += ["--json", str(out_json)]
    args = _parse(bench_cli, "bench", argv)
    assert args.run(args) == 0
    captured = capsys.readouterr()
    assert "--pareto: 6 extra runs" in captured.err
    assert "cascade budget 2: gate" in captured.out
    assert "pareto ecospec budget 2 eps 1" in captured.out
    report = json.loads(out_json.read_text())
    assert [r["policy"] for r in report["sweep"]] == ["confidence", "ecospec", "evict", "cascade"]
    assert all(r["lossless"] is True for r in report["sweep"])
    cascade, confidence = report["policies"]["cascade"], report["policies"]["confidence"]
    assert cascade["gate"]["confidence_speedup"] == confidence["predicted"]["speedup"]
    if cascade["speculates"]:
        assert cascade["accept_length"] == confidence["accept_length"]
    else:
        assert cascade["accept_length"] == 1.0 and cascade["predicted"]["speedup"] == 1.0
    evict = report["policies"]["evict"]
    assert 1.0 <= evict["accept_length"] <= 1 + 2  # 2 draft steps
    front = report["pareto"]
    assert [p["budget"] for p in front["confidence"]] == [1, 2, 3, 4, 5]
    assert [p["extra"] for p in front["confidence"]] == [True, False, True, True, True]
    assert [p["eps"] for p in front["ecospec"]] == [0.05, 0.1, 1.0]
    assert [p["policy"] for p in front["runs"]] == ["confidence", "ecospec", "evict", "cascade"]
    assert all(p["lossless"] == "yes" for p in front["confidence"] + front["ecospec"])
    # More budget: more experts per step on the confidence line.
    experts = [p["experts_per_layer_step"] for p in front["confidence"]]
    assert experts[0] < experts[-1]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
