"""The ``sgl-ecospec sweep`` command: verify-set policies across batch sizes, priced on
real model profiles with and without expert parallelism (docs/bench.md, "Batch-size sweep").

For every batch size B the testbed decodes the same real prompts in batches of B: once
greedily (no speculation, the baseline every speedup is over) and once per policy:

- ``confidence``: SGLang's choice (the top scores).
- ``ecospec``: P / (DeltaCost + eps), with eps from ``costmodel.selection_cost`` for the
  primary (first) profile at batch B, and layer weights that put one testbed expert in
  that profile's units (``testbed_expert_weight``).
- ``ecospec-ep``: ``ecospec`` with the expert-parallel cost (busiest-rank rise) for the
  largest ``--ep-sizes`` entry: testbed experts on ranks in contiguous blocks
  (``ep_cost.contiguous_expert_rank``), eps of that EP group.
- ``adaptive``: a per-batch-size gate, then per-step adaptive selection. The gate, like a
  bucket of SGLang's ``--speculative-adaptive-config``, turns speculation off at batch B
  for a profile and EP size when speculation as SGLang runs it (``confidence``, measured
  at B) is predicted no faster than no speculation, and after the adaptive run at B where
  that run is predicted no faster either; there ``adaptive`` is the greedy run
  (speedup 1; ``rule_speedup`` keeps the run's own figure). Where it is on,
  ``select_verify_set(policy="adaptive")`` takes
  ``ecospec``'s nodes only while they raise the step's tokens per cost, with eps and the
  step's starting account from ``selection_cost`` (primary profile, batch B).

With ``--paired`` the ecospec run also scores confidence's choice, and the ecospec-ep run
ecospec's, on each of its own steps (same tree, same predictions, same buffer seed), and
both sets' true expert unions are compared step by step (``paired``): the effect of the
selection alone, free of two decodes drifting apart.

Every run is priced for every profile at every EP size by ``ep_cost`` (unions scaled by the
effective-token method, busiest rank by the imbalance method, expert loads by the busiest
rank under EP), on the hardware profile times the EP size (EP 8 on ``8xh200``).
"""

import argparse
import math
import sys
import time

import numpy as np

from sgl_ecospec.costmodel import formulas
from sgl_ecospec.costmodel.profiles import HARDWARE, MODELS
from sgl_ecospec.costmodel.scaling import effective_tokens
from sgl_ecospec.lab.bench import ep_cost, metrics
from sgl_ecospec.lab.bench import report as bench_report
from sgl_ecospec.lab.bench.cli import (
    LosslessError,
    OutputCheck,
    _batches,
    _greedy,
    _Progress,
    add_model_arguments,
    add_predictor_arguments,
    add_tree_arguments,
    check_budget,
    check_model_arguments,
    check_predictor_arguments,
    num_candidates,
    open_engine,
    performance_model,
    run_predictor,
)
from sgl_ecospec.lab.costmodel_report import parse_positive_ints
from sgl_ecospec.lab.datasets import DATASETS, load_prompts, render_chat

POLICIES = ("confidence", "ecospec", "ecospec-ep", "adaptive")
DEFAULT_BATCH_SIZES = "1,2,4,8,16,32,64"
DEFAULT_PROFILES = "qwen3-235b-a22b,gpt-oss-120b,deepseek-v3"
DEFAULT_PLOT = "sweep_speedup.png"
NOTE = (
    "measured on the testbed: accept_length, verified_per_request, experts_per_layer_step, "
    "busiest_rank_experts; predicted for each profile by the MoESD model on a roofline prior "
    "(not measurements): *_scaled, step_ms, ar_ms, speedup"
)
METHOD = {
    "unions": (
        "effective-token method: t_eff solves N_t(t_eff) = measured testbed union (uniform "
        "routing expectation with E_t, K_t), the profile's union is N_p(t_eff), capped at "
        "tokens x K_p; per (step, layer)"
    ),
    "busiest_rank": (
        "imbalance method: testbed experts on EP ranks in contiguous blocks; the measured "
        "busiest-rank share of the union is kept: b_p = min(E_p / R, u_p x b_t / u_t); R = 1 "
        "gives b_p = u_p"
    ),
    "ep_pricing": (
        "EP R is priced on R x the hardware profile; a pass costs verify_time(tokens, u_p) + "
        "k2 (R b_p - u_p): every layer waits for its busiest rank, which streams its experts "
        "at 1/R of the group's bandwidth"
    ),
    "selection": (
        "eps (and adaptive's step_cost) from costmodel.selection_cost of the primary profile "
        "at each batch size; every testbed layer weighs moe_layers / L_t times the profile "
        "experts one testbed expert stands for between the roots' union and a full verify "
        "pass's (secant of the effective-token scaling)"
    ),
    "adaptive_gate": (
        "per (batch size, profile, EP size): speculate only where confidence selection, "
        "measured at that batch size, is predicted faster than no speculation, and the "
        "adaptive run at that batch size too; otherwise adaptive is the greedy run (speedup "
        "1; rule_speedup: the run's own prediction when it closed the gate)"
    ),
}
_LINE_STATUS = {"yes": "lossless", "tie": "lossless up to near ties", "NO": "NOT LOSSLESS"}
# Batch sizes where EcoSpec is meant to keep its expert reduction (the bar).
SMALL_BATCHES = (1, 2, 4, 8)
# With --paired: the policy each run's steps also score (the one it is measured against).
PAIRED_AGAINST = {"ecospec": "confidence", "ecospec-ep": "ecospec"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``sweep`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = subparsers.add_parser(
        "sweep",
        help="policies across batch sizes and EP sizes, speedup predicted for real models",
        description=(
            "Runs greedy decoding and speculative decoding per policy on the testbed at "
            "several batch sizes, and reports acceptance length, unique experts per layer per "
            "step, busiest-rank experts under expert parallelism, and the step time and "
            "speedup over no speculation predicted for real model profiles."
        ),
    )
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="comma-separated")
    sweep.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated: {', '.join(POLICIES)}",
    )
    sweep.add_argument("--ep-sizes", default="1,8", help="expert-parallel sizes to price")
    sweep.add_argument(
        "--profiles",
        default=DEFAULT_PROFILES,
        help=f"comma-separated, the first picks eps (one of: {', '.join(MODELS)})",
    )
    sweep.add_argument(
        "--hardware",
        default="h200",
        help=f"one device ({', '.join(HARDWARE)}); EP R is priced on R of them",
    )
    data = parser.add_argument_group("prompts")
    data.add_argument("--dataset", default="mt-bench", help=f"{', '.join(DATASETS)} or a .jsonl")
    data.add_argument(
        "--num-prompts",
        type=int,
        default=8,
        help="prompts per batch size (at least the batch size; whole batches)",
    )
    data.add_argument("--seed", type=int, default=0, help="picks the prompt subset")
    gen = parser.add_argument_group("decoding")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    add_tree_arguments(gen)
    add_predictor_arguments(gen)
    gen.add_argument(
        "--paired",
        action="store_true",
        help="ecospec also scores confidence's choice, and ecospec-ep ecospec's, on each of "
        "its own steps: both sets' true expert unions compared on the same trees (one extra "
        "target pass over the whole tree per step of those runs)",
    )
    gen.add_argument(
        "--share-buffer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one expert buffer (and one adaptive account) for the whole batch",
    )
    add_model_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the report as JSON")
    out.add_argument(
        "--plot",
        nargs="?",
        const=DEFAULT_PLOT,
        metavar="FILE",
        help=f"plot speedup vs batch size per policy (default file {DEFAULT_PLOT})",
    )
    out.add_argument(
        "--check-lossless",
        action="store_true",
        help="fail (exit 1) on the first output that differs from the target's greedy one",
    )
    parser.set_defaults(run=run)
    return parser


def _names(text: str, flag: str, valid) -> list[str]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(f"unknown {flag} {unknown or text!r}; valid: {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{flag} lists a name twice: {text!r}")
    return names


def _sizes(text: str, flag: str) -> list[int]:
    sizes = parse_positive_ints(text, flag)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"{flag} lists a size twice: {text!r}")
    return sorted(sizes)


def validate(args: argparse.Namespace) -> dict:
    """The sweep's configuration from parsed arguments; ValueError on anything invalid.

    Checks everything that needs no model, so bad arguments fail before any loading.
    """
    from sgl_ecospec.costmodel.profiles import get_hardware

    for flag in ("num_prompts", "topk", "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_new_tokens < 2:
        raise ValueError(
            f"--max-new-tokens must be >= 2 (the first token comes from the prefill, so "
            f"greedy decoding needs a second one to have a step), got {args.max_new_tokens}"
        )
    batch_sizes = _sizes(args.batch_sizes, "--batch-sizes")
    ep_sizes = _sizes(args.ep_sizes, "--ep-sizes")
    # The policies run in this order: adaptive's gate reads confidence's result.
    policies = [p for p in POLICIES if p in _names(args.policies, "--policies", POLICIES)]
    if "adaptive" in policies and "confidence" not in policies:
        raise ValueError(
            "adaptive's per-batch-size gate reads the speedup of confidence selection at "
            "the same batch size: add confidence to --policies"
        )
    if "ecospec-ep" in policies and max(ep_sizes) == 1:
        raise ValueError("ecospec-ep selects for expert parallelism: give --ep-sizes above 1")
    profiles = _names(args.profiles, "--profiles", MODELS)
    for name in profiles:
        experts = MODELS[name].num_experts
        bad = [r for r in ep_sizes if experts % r]
        if bad:
            raise ValueError(
                f"--ep-sizes {bad}: {name} has {experts} experts per layer, which EP "
                "ranks must split evenly"
            )
    hardware = get_hardware(args.hardware)
    if hardware.name not in HARDWARE:
        raise ValueError(
            f"--hardware is one device, got {args.hardware!r}: EP R is priced on R of them"
        )
    check_budget(args.budget, args.topk, args.steps)
    check_predictor_arguments(args)
    check_model_arguments(args)
    candidates = num_candidates(args.topk, args.steps)
    return {
        "batch_sizes": batch_sizes,
        "policies": policies,
        "ep_sizes": ep_sizes,
        "profiles": profiles,
        "hardware": hardware.name,
        "dataset": args.dataset.strip(),
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "topk": args.topk,
        "steps": args.steps,
        "candidates": candidates,
        "budget": args.budget,
        "share_buffer": args.share_buffer,
        "predictor": args.predictor,
        "predictor_file": args.predictor_file,
        "paired": args.paired,
        "target": args.target,
        "draft": args.draft,
        "small": args.small,
        "device": args.device,
        "dtype": args.dtype,
        "check_lossless": args.check_lossless,
    }


def prompts_per_batch_size(batch: int, num_prompts: int) -> int:
    """Prompts decoded at batch size ``batch``: at least ``num_prompts``, in whole batches."""
    return batch * math.ceil(max(num_prompts, batch) / batch)


def ep_hardware(hardware: str, ep_size: int) -> str:
    """The hardware profile of an EP group: ``hardware`` itself for 1, else ``<R>x...``."""
    return hardware if ep_size == 1 else f"{ep_size}x{hardware}"


def testbed_expert_weight(
    root_union: float, batch: int, budget: int, *, num_experts: int, top_k: int, profile
) -> float:
    """Profile experts one testbed expert stands for, over a selection's range.

    The secant of the effective-token scaling between the roots' union (t0 effective
    tokens, from ``root_union``, at most ``batch``) and a full verify pass of the same
    redundancy (t1 = (budget + 1) t0):
    (N_p(t1) - N_p(t0)) / (N_t(t1) - N_t(t0)). 1 when the profile has the testbed's shape.

    Args:
        root_union: the testbed's distinct experts per layer of a greedy step at ``batch``
            (in [K_t, E_t]).
        batch: B (>= 1), requests in the step.
        budget: candidates verified per request.
        num_experts, top_k: E_t, K_t.
        profile: the model profile (``num_experts``, ``top_k``).
    """
    t0 = min(float(effective_tokens(root_union, num_experts, top_k)), float(batch))
    t = np.array([t0, (budget + 1) * t0])
    testbed = np.asarray(formulas.expected_unique_experts(t, num_experts, top_k))
    scaled = np.asarray(formulas.expected_unique_experts(t, profile.num_experts, profile.top_k))
    # A testbed saturated at the roots adds no experts (DeltaCost 0), so any weight does.
    return float((scaled[1] - scaled[0]) / max(testbed[1] - testbed[0], 1e-12))


def selection_configs(cfg: dict, batch: int, root_union: float, testbed: dict) -> dict:
    """``SpecConfig`` keyword arguments per policy at batch size ``batch``.

    Args:
        cfg: from ``validate``.
        batch: B.
        root_union: the greedy run's mean distinct experts per layer per step at B.
        testbed: ``{"num_layers", "num_experts", "top_k"}`` of the target.

    Returns:
        policy -> dict of ``SpecConfig`` fields (see the module docstring).
    """
    from sgl_ecospec.costmodel import selection_cost

    perf = performance_model(cfg["profiles"][0], cfg["hardware"])
    budget, layers = cfg["budget"], testbed["num_layers"]
    weight = testbed_expert_weight(
        root_union,
        batch,
        budget,
        num_experts=testbed["num_experts"],
        top_k=testbed["top_k"],
        profile=perf.model,
    )
    weights = (perf.model.moe_layers / layers * weight,) * layers
    base = {
        "topk": cfg["topk"],
        "num_steps": cfg["steps"],
        "budget": budget,
        "share_buffer": cfg["share_buffer"],
    }
    cost = selection_cost(perf, batch, budget + 1, draft_steps=cfg["steps"])
    configs = {
        "confidence": {**base, "policy": "confidence"},
        "ecospec": {**base, "policy": "ecospec", "eps": cost.eps, "layer_weights": weights},
        "adaptive": {
            **base,
            "policy": "adaptive",
            "eps": cost.eps,
            "layer_weights": weights,
            "step_tokens": cost.step_tokens,
            "step_cost": cost.step_cost,
        },
    }
    ranks = max(cfg["ep_sizes"])
    if ranks > 1:
        perf_ep = performance_model(cfg["profiles"][0], ep_hardware(cfg["hardware"], ranks))
        cost_ep = selection_cost(perf_ep, batch, budget + 1, ep_size=ranks)
        placement = ep_cost.contiguous_expert_rank(testbed["num_experts"], ranks)
        configs["ecospec-ep"] = {
            **configs["ecospec"],
            "eps": cost_ep.eps,
            "expert_rank": tuple(placement.tolist()),
            "num_ranks": ranks,
        }
    return configs


def _busiest(steps, testbed: dict, ep_sizes) -> dict[str, float]:
    """Mean busiest-rank experts per layer per step on the testbed, per EP size."""
    return {
        str(r): float(ep_cost.busiest_rank_experts(steps, testbed["num_experts"], r).mean())
        for r in ep_sizes
    }


def paired_summary(steps, testbed: dict, ep_sizes) -> dict:
    """The paired comparison of a run's verify sets with the compared policy's.

    Per step, each quantity is the run's set minus the compared set on the same tree:
    distinct experts per layer (mean over layers), busiest-rank experts per layer at each
    EP size > 1 (contiguous placement), and summed cumulative draft probability (the
    draft's estimate of accepted tokens). Reported as the means of both, the mean
    difference and its standard error (steps taken as independent), and the share of
    steps whose two unions differ at all (``steps_differ``).

    Args:
        steps: ``StepStats`` with ``paired_bitmaps [2, L, W]`` and ``paired_scores``.
        testbed: ``{"num_experts", ...}`` of the target.
        ep_sizes: EP sizes; those above 1 get a busiest-rank entry.
    """
    import torch

    bitmaps = torch.stack([s.paired_bitmaps for s in steps])  # [S, 2, L, W]
    experts = testbed["num_experts"]
    values = {"experts_per_layer_step": ep_cost.busiest_rank_loads(bitmaps, experts, 1).mean(-1)}
    for r in ep_sizes:
        if r > 1:
            busiest = ep_cost.busiest_rank_loads(bitmaps, experts, r)  # [S, 2, L]
            values[f"busiest_rank_experts_ep{r}"] = busiest.mean(-1)
    values["draft_score"] = np.asarray([s.paired_scores for s in steps], dtype=np.float64)
    differ = (bitmaps[:, 0] != bitmaps[:, 1]).flatten(1).any(1)
    summary = {"steps": len(steps), "steps_differ": float(differ.double().mean())}
    for name, pair in values.items():  # pair: [S, 2]
        diff = pair[:, 0] - pair[:, 1]
        stderr = diff.std(ddof=1) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
        summary[name] = {
            "run": float(pair[:, 0].mean()),
            "against": float(pair[:, 1].mean()),
            "difference": float(diff.mean()),
            "stderr": float(stderr),
        }
    return summary


def _speculative(
    cfg, engine, spec, groups, prompts, greedy, progress, label, compare=None
) -> tuple:
    """One policy at one batch size over every batch: (steps, testbed metrics); with
    ``compare`` (a ``SpecConfig``) the steps also score its selection."""
    import torch

    torch.manual_seed(cfg["seed"])
    predictor = run_predictor(cfg, engine)
    limit, started = cfg["max_new_tokens"], time.perf_counter()
    steps, index = [], 0
    check = OutputCheck(engine, cfg["check_lossless"], label)
    progress.verify_steps = 0
    progress.bar.set_description(label)
    for group in groups:
        result = engine.generate_speculative(
            group, limit, spec, predictor=predictor, progress=progress.on_step, compare=compare
        )
        for ids, got in zip(group, result.outputs, strict=True):
            check.compare(prompts[index], ids, greedy[index], list(got[:limit]))
            index += 1
        steps += result.steps
        progress.bar.update()
    summary = metrics.summarize(steps)
    verified = sum(s.verified_tokens for s in steps) / sum(s.batch_size for s in steps)
    return steps, {
        **summary,
        "verified_per_request": verified,
        **check.fields(),
        "wall_seconds": time.perf_counter() - started,
    }


def _selection_record(kwargs: dict) -> dict:
    """The cost-model constants a run selected with (JSON-ready)."""
    record = {k: kwargs[k] for k in ("eps", "step_tokens", "step_cost", "num_ranks") if k in kwargs}
    if "layer_weights" in kwargs:
        record["layer_weight"] = kwargs["layer_weights"][0]
    return record


def run_sweep(cfg: dict, engine, prompts: list, *, out=None) -> dict:
    """Greedy and every policy at every batch size; returns the report.

    Args:
        cfg: from ``validate``.
        engine: an ``OfflineEngine`` (or anything with its API).
        prompts: the ``Prompt`` pool (at least as many as the largest batch size needs).
        out: where the lines go (default stdout; the progress bar goes to stderr).
    """
    from sgl_ecospec.lab.engine import SpecConfig

    out = out or sys.stdout
    testbed = {
        "num_layers": engine.num_layers,
        "num_experts": engine.num_experts,
        "top_k": engine.top_k,
    }
    shape = {"num_experts": engine.num_experts, "top_k": engine.top_k}
    pool = [render_chat(engine.tokenizer, p.text) for p in prompts]
    plan = {
        b: _batches(pool[: prompts_per_batch_size(b, cfg["num_prompts"])], b)
        for b in cfg["batch_sizes"]
    }
    perfs = {
        (p, r): performance_model(p, ep_hardware(cfg["hardware"], r))
        for p in cfg["profiles"]
        for r in cfg["ep_sizes"]
    }
    rep = {
        "note": NOTE,
        "config": cfg,
        "testbed": {"target": cfg["target"], "draft": cfg["draft"], **testbed},
        "profiles": {
            p: {
                f: getattr(MODELS[p], f)
                for f in ("moe_layers", "num_experts", "top_k", "bytes_per_expert")
            }
            for p in cfg["profiles"]
        },
        "hardware": {str(r): ep_hardware(cfg["hardware"], r) for r in cfg["ep_sizes"]},
        "method": METHOD,
        "greedy": [],
        "runs": [],
        "rows": [],
    }
    total = sum(len(groups) for groups in plan.values()) * (1 + len(cfg["policies"]))
    progress = _Progress(total)
    try:
        for batch, groups in plan.items():
            used = prompts[: sum(map(len, groups))]
            greedy, greedy_steps, seconds = _greedy(
                engine, {f"greedy batch {batch}": groups}, cfg["max_new_tokens"], progress
            )
            greedy = next(iter(greedy.values()))
            root_union, _ = metrics.expert_stats(greedy_steps)
            rep["greedy"].append(
                {
                    "batch_size": batch,
                    "prompts": len(used),
                    "steps": len(greedy_steps),
                    "experts_per_layer_step": root_union,
                    "busiest_rank_experts": _busiest(greedy_steps, testbed, cfg["ep_sizes"]),
                    "wall_seconds": seconds,
                }
            )
            ar = {
                key: ep_cost.price_steps(greedy_steps, perf, **shape, ep_size=key[1])
                for key, perf in perfs.items()
            }
            configs = selection_configs(cfg, batch, root_union, testbed)
            speedups = {}
            for policy in cfg["policies"]:
                entry = {"batch_size": batch, "policy": policy}
                gate = None
                if policy == "adaptive":
                    gate = {key: speedups["confidence", *key] > 1.0 for key in perfs}
                    entry["speculates"] = {p: {} for p in cfg["profiles"]}
                    for (p, r), on in gate.items():
                        entry["speculates"][p][str(r)] = on
                entry["selection"] = _selection_record(configs[policy])
                if gate is not None and not any(gate.values()):
                    entry["ran"] = False
                    progress.bar.update(len(groups))
                    progress.write(f"batch {batch:3d} {policy:<10} not run: gate closed", out)
                    spec_steps = None
                else:
                    label = f"batch {batch} {policy}"
                    against = PAIRED_AGAINST.get(policy) if cfg["paired"] else None
                    spec_steps, measured = _speculative(
                        cfg,
                        engine,
                        SpecConfig(**configs[policy]),
                        groups,
                        used,
                        greedy,
                        progress,
                        label,
                        compare=None if against is None else SpecConfig(**configs[against]),
                    )
                    entry.update(
                        ran=True,
                        **measured,
                        busiest_rank_experts=_busiest(spec_steps, testbed, cfg["ep_sizes"]),
                    )
                    if against is not None and spec_steps:  # no steps: nothing to pair
                        summary = paired_summary(spec_steps, testbed, cfg["ep_sizes"])
                        entry["paired"] = {"against": against, **summary}
                    progress.write(_run_line(entry, cfg), out)
                    for message in entry["mismatches"]:
                        progress.write(f"warning: not lossless: {label}: {message}", sys.stderr)
                rep["runs"].append(entry)
                for (p, r), perf in perfs.items():
                    no_spec = _no_speculation_row(rep["greedy"][-1], greedy_steps, ar[p, r], r)
                    if spec_steps is None or (gate is not None and not gate[p, r]):
                        row = no_spec
                    else:
                        priced = ep_cost.price_steps(spec_steps, perf, **shape, ep_size=r)
                        row = _row(entry, priced, spec_steps, greedy_steps, ar[p, r], perf, cfg)
                        if gate is not None and row["speedup"] <= 1.0:
                            # adaptive's own run at B is no faster: its bucket turns off.
                            entry["speculates"][p][str(r)] = False
                            row = {**no_spec, "rule_speedup": row["speedup"]}
                    speedups[policy, p, r] = row["speedup"]
                    rep["rows"].append(
                        {"batch_size": batch, "policy": policy, "profile": p, "ep_size": r, **row}
                    )
    finally:
        progress.bar.close()
    rep["checks"] = checks(rep)
    return rep


def _row(entry, priced, spec_steps, greedy_steps, ar, perf, cfg) -> dict:
    return {
        "speculates": True,
        "accept_length": entry["accept_length"],
        "verified_per_request": entry["verified_per_request"],
        "experts_per_layer_step": entry["experts_per_layer_step"],
        "experts_per_layer_step_scaled": float(priced.unique_scaled.mean()),
        "busiest_rank_experts": float(priced.busiest.mean()),
        "busiest_rank_experts_scaled": float(priced.busiest_scaled.mean()),
        **ep_cost.predicted_speedup(
            spec_steps, priced, greedy_steps, ar, perf, num_draft_steps=cfg["steps"]
        ),
    }


def _no_speculation_row(greedy: dict, greedy_steps, ar, ep_size: int) -> dict:
    """A row for decoding without speculation: the greedy run itself."""
    ar_ms = 1e3 * float(ar.seconds.mean())
    return {
        "speculates": False,
        "accept_length": 1.0,
        "verified_per_request": 1.0,
        "experts_per_layer_step": greedy["experts_per_layer_step"],
        "experts_per_layer_step_scaled": float(ar.unique_scaled.mean()),
        "busiest_rank_experts": float(ar.busiest.mean()),
        "busiest_rank_experts_scaled": float(ar.busiest_scaled.mean()),
        "step_ms": ar_ms,
        "verify_ms": ar_ms,
        "ar_ms": ar_ms,
        "speedup": 1.0,
        "speedup_stderr": 0.0,
    }


def checks(rep: dict) -> dict:
    """The issue's bars, evaluated on the report's rows.

    - ``adaptive_not_slower``: adaptive's speedup >= 1 at every (batch, profile, EP).
    - ``adaptive_within_noise_of_confidence``: adaptive's speedup >= confidence's minus
      twice the combined standard error (``ep_cost.predicted_speedup``).
    - ``ecospec_expert_reduction``: at batch sizes 1-8, ecospec's testbed experts per layer
      per step below confidence's.
    - ``ecospec_ep_lowers_busiest_rank``: at the largest EP size, ecospec-ep's busiest-rank
      experts below ecospec's, at every batch size (testbed, and scaled per profile).
    - ``ecospec_expert_reduction_paired`` and ``ecospec_ep_lowers_busiest_rank_paired``
      (``--paired`` runs only): the same two comparisons made on the same trees, each
      passed where the mean paired difference is below zero by more than twice its
      standard error.

    Each is ``{"passed": bool | None (not evaluated), "detail": [...]}``.
    """
    rows = {(r["batch_size"], r["policy"], r["profile"], r["ep_size"]): r for r in rep["rows"]}
    cfg = rep["config"]
    policies = set(cfg["policies"])
    keys = [(b, p, r) for b in cfg["batch_sizes"] for p in cfg["profiles"] for r in cfg["ep_sizes"]]
    result = {}

    def verdict(name, needed, detail):
        evaluated = needed <= policies and detail
        passed = all(d["passed"] for d in detail) if evaluated else None
        result[name] = {"passed": passed, "detail": detail}

    detail = []
    if "adaptive" in policies:
        for b, p, r in keys:
            speedup = rows[b, "adaptive", p, r]["speedup"]
            detail.append(
                {"batch_size": b, "profile": p, "ep_size": r, "speedup": speedup}
                | {"passed": speedup >= 1.0 - 1e-12}
            )
    verdict("adaptive_not_slower", {"adaptive"}, detail)

    detail = []
    if {"adaptive", "confidence"} <= policies:
        for b, p, r in keys:
            ours, theirs = rows[b, "adaptive", p, r], rows[b, "confidence", p, r]
            noise = 2 * math.hypot(ours["speedup_stderr"], theirs["speedup_stderr"])
            margin = ours["speedup"] - theirs["speedup"]
            detail.append(
                {"batch_size": b, "profile": p, "ep_size": r, "difference": margin}
                | {"noise": noise, "passed": margin >= -noise}
            )
    verdict("adaptive_within_noise_of_confidence", {"adaptive", "confidence"}, detail)

    detail = []
    runs = {(e["batch_size"], e["policy"]): e for e in rep["runs"]}
    if {"ecospec", "confidence"} <= policies:
        for b in (b for b in cfg["batch_sizes"] if b in SMALL_BATCHES):
            eco = runs[b, "ecospec"]["experts_per_layer_step"]
            conf = runs[b, "confidence"]["experts_per_layer_step"]
            detail.append({"batch_size": b, "reduction": 1 - eco / conf, "passed": eco < conf})
    verdict("ecospec_expert_reduction", {"ecospec", "confidence"}, detail)

    detail = []
    ranks = max(cfg["ep_sizes"])
    if {"ecospec", "ecospec-ep"} <= policies and ranks > 1:
        for b in cfg["batch_sizes"]:
            eco = runs[b, "ecospec"]["busiest_rank_experts"][str(ranks)]
            ep = runs[b, "ecospec-ep"]["busiest_rank_experts"][str(ranks)]
            scaled = {
                p: (
                    rows[b, "ecospec-ep", p, ranks]["busiest_rank_experts_scaled"],
                    rows[b, "ecospec", p, ranks]["busiest_rank_experts_scaled"],
                )
                for p in cfg["profiles"]
            }
            detail.append(
                {"batch_size": b, "ep_size": ranks, "ecospec": eco, "ecospec_ep": ep}
                | {"scaled": {p: {"ecospec_ep": a, "ecospec": c} for p, (a, c) in scaled.items()}}
                | {"passed": ep < eco and all(a < c for a, c in scaled.values())}
            )
    verdict("ecospec_ep_lowers_busiest_rank", {"ecospec", "ecospec-ep"}, detail)

    for name, policy, quantity, batches in (
        ("ecospec_expert_reduction_paired", "ecospec", "experts_per_layer_step", SMALL_BATCHES),
        (
            "ecospec_ep_lowers_busiest_rank_paired",
            "ecospec-ep",
            f"busiest_rank_experts_ep{ranks}",
            cfg["batch_sizes"],
        ),
    ):
        detail = []
        for b in (b for b in cfg["batch_sizes"] if b in batches):
            paired = runs.get((b, policy), {}).get("paired", {}).get(quantity)
            if paired is not None:
                diff, noise = paired["difference"], 2 * paired["stderr"]
                detail.append(
                    {"batch_size": b, "difference": diff, "noise": noise}
                    | {"relative": diff / paired["against"], "passed": diff < -noise}
                )
        verdict(name, {policy}, detail)
    return result


# --- output -------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _run_line(entry: dict, cfg: dict) -> str:
    busiest = ", ".join(
        f"EP{r} {v:.2f}" for r, v in entry["busiest_rank_experts"].items() if r != "1"
    )
    return (
        f"batch {entry['batch_size']:3d} {entry['policy']:<10} accept "
        f"{entry['accept_length']:.3f}, verified/request {entry['verified_per_request']:.2f}, "
        f"experts {entry['experts_per_layer_step']:.2f}"
        + (f", busiest {busiest}" if busiest else "")
        + _paired_cells(entry)
        + f", {_LINE_STATUS[metrics.lossless_status(entry)]}"
        f", {entry['wall_seconds']:.0f} s"
    )


def _paired_cells(entry: dict) -> str:
    """``, paired vs <policy>: experts d +- se, busiest EP<R> d +- se`` (empty unpaired)."""
    paired = entry.get("paired")
    if paired is None:
        return ""
    labels = {"experts_per_layer_step": "experts"}
    labels |= {n: f"busiest EP{n.rsplit('ep', 1)[1]}" for n in paired if n.startswith("busiest")}
    cells = [
        f"{label} {paired[n]['difference']:+.3f} +- {paired[n]['stderr']:.3f}"
        for n, label in labels.items()
    ]
    return f", paired vs {paired['against']}: " + ", ".join(cells)


def format_tables(rep: dict) -> str:
    """The testbed table (per batch size and policy), then one priced table per profile and
    EP size, then the bars."""
    cfg = rep["config"]
    ranks = [r for r in cfg["ep_sizes"] if r > 1]
    head = "batch policy     accept verif/req experts " + " ".join(f"busy@EP{r}" for r in ranks)
    lines = ["# measured on the testbed", head + " recall lossless"]
    greedy = {g["batch_size"]: g for g in rep["greedy"]}
    runs = [("none", greedy[b]) for b in cfg["batch_sizes"]]
    runs = sorted(
        runs + [(e["policy"], e) for e in rep["runs"]],
        key=lambda x: (x[1]["batch_size"], x[0] != "none"),
    )
    for policy, e in runs:
        baseline = policy == "none"
        busy = e.get("busiest_rank_experts", {})
        if baseline:
            status = "-"
        elif not e["ran"]:
            status = "gate off"
        else:
            status = metrics.lossless_status(e)
        cells = [
            f"{e['batch_size']:5d}",
            f"{policy:<10}",
            f"{_fmt(1.0 if baseline else e.get('accept_length'), '.3f'):>6}",
            f"{_fmt(1.0 if baseline else e.get('verified_per_request'), '.2f'):>9}",
            f"{_fmt(e.get('experts_per_layer_step'), '.2f'):>7}",
            *[f"{_fmt(busy.get(str(r)), '.2f'):>8}" for r in ranks],
            f"{_fmt(e.get('predictor_recall'), '.3f'):>6}",
            f"{status:>8}",
        ]
        lines.append(" ".join(cells))
    paired = [e for e in rep["runs"] if "paired" in e]
    if paired:
        lines += [
            "",
            "# paired on the same trees: run minus the compared policy's set, mean +- stderr",
            "batch policy     against    experts diff      +-  "
            + " ".join(f"busy@EP{r} diff     +-" for r in ranks)
            + "  draft score diff  differ",
        ]
        for e in paired:
            p = e["paired"]
            cells = [f"{e['batch_size']:5d} {e['policy']:<10} {p['against']:<10}"]
            for name in ["experts_per_layer_step"] + [f"busiest_rank_experts_ep{r}" for r in ranks]:
                cells.append(f"{p[name]['difference']:+12.3f} {p[name]['stderr']:6.3f}")
            cells.append(f"{p['draft_score']['difference']:+17.3f} {p['steps_differ']:8.2f}")
            lines.append(" ".join(cells))
    for profile in cfg["profiles"]:
        for r in cfg["ep_sizes"]:
            lines += [
                "",
                f"# predicted for {profile} on {rep['hardware'][str(r)]} (EP {r}), MoESD "
                "model on a roofline prior",
                "batch policy     spec accept experts_p busiest_p  step_ms    ar_ms speedup   +-",
            ]
            for row in rep["rows"]:
                if row["profile"] != profile or row["ep_size"] != r:
                    continue
                lines.append(
                    f"{row['batch_size']:5d} {row['policy']:<10} "
                    f"{'yes' if row['speculates'] else 'no':>4} {row['accept_length']:6.3f} "
                    f"{row['experts_per_layer_step_scaled']:9.2f} "
                    f"{row['busiest_rank_experts_scaled']:9.2f} {row['step_ms']:8.3f} "
                    f"{row['ar_ms']:8.3f} {row['speedup']:7.3f} {row['speedup_stderr']:5.3f}"
                )
    lines += ["", "# bars"]
    for name, check in rep["checks"].items():
        verdict = {True: "met", False: "NOT met", None: "not evaluated"}[check["passed"]]
        lines.append(f"{name}: {verdict}")
        lines += [f"  {_detail(d)}" for d in check["detail"] if not d["passed"]]
    return "\n".join(lines)


def _detail(d: dict) -> str:
    return ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in d.items()
        if k not in ("passed", "scaled")
    )


def write_plot(rep: dict, path: str) -> None:
    """Writes a PNG: predicted speedup over no speculation vs batch size, one line per
    policy, one panel per (EP size, profile)."""
    from matplotlib.figure import Figure

    cfg = rep["config"]
    profiles, ep_sizes = cfg["profiles"], cfg["ep_sizes"]
    fig = Figure(figsize=(4.2 * len(profiles), 3.4 * len(ep_sizes)), layout="constrained")
    axes = fig.subplots(len(ep_sizes), len(profiles), squeeze=False)
    for i, r in enumerate(ep_sizes):
        for j, profile in enumerate(profiles):
            ax = axes[i][j]
            for policy in cfg["policies"]:
                rows = [
                    row
                    for row in rep["rows"]
                    if row["policy"] == policy and row["profile"] == profile and row["ep_size"] == r
                ]
                ax.plot(
                    [row["batch_size"] for row in rows],
                    [row["speedup"] for row in rows],
                    marker="o",
                    label=policy,
                )
            ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
            ax.set_xscale("log", base=2)
            ax.set_xticks(cfg["batch_sizes"], [str(b) for b in cfg["batch_sizes"]])
            ax.set_title(f"{profile}, EP {r} ({rep['hardware'][str(r)]})", fontsize=10)
            ax.set_xlabel("batch size")
            ax.set_ylabel("predicted speedup vs no SD")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(
        f"testbed E={rep['testbed']['num_experts']}, K={rep['testbed']['top_k']}: "
        f"{cfg['dataset']}, topk {cfg['topk']}, {cfg['steps']} steps, budget {cfg['budget']}, "
        f"{cfg['max_new_tokens']} new tokens (MoESD model on a roofline prior)"
    )
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    """The ``sweep`` command: 0 on success, 1 when --check-lossless finds a mismatch."""
    cfg = validate(args)
    needed = max(prompts_per_batch_size(b, cfg["num_prompts"]) for b in cfg["batch_sizes"])
    prompts = load_prompts(cfg["dataset"], num_prompts=needed, seed=cfg["seed"])
    engine = open_engine(cfg, "sweep")
    bad = [r for r in cfg["ep_sizes"] if engine.num_experts % r]
    if bad:
        raise ValueError(
            f"--ep-sizes {bad}: the target has {engine.num_experts} experts per layer, which "
            "EP ranks must split evenly"
        )
    try:
        rep = run_sweep(cfg, engine, prompts)
    except LosslessError as exc:
        print(f"sgl-ecospec sweep: LOSSLESS CHECK FAILED: {exc}", file=sys.stderr)
        return 1
    print("\n" + format_tables(rep))
    if args.json:
        bench_report.write_json(rep, args.json)
    if args.plot:
        write_plot(rep, args.plot)
    return 0
