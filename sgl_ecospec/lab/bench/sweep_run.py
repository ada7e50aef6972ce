"""The sweep's runs: greedy and every policy at every batch size on the engine, each run
priced per profile and EP size, and the gate of adaptive and cascade (``sgl-ecospec sweep``,
docs/bench.md)."""

import math
import sys
import time

import numpy as np

from sgl_ecospec.lab.bench import ep_cost, metrics
from sgl_ecospec.lab.bench.peers import utility_gate
from sgl_ecospec.lab.bench.runs import (
    OutputCheck,
    Progress,
    batches,
    performance_model,
    run_greedy,
    run_predictor,
    speculative_batches,
)
from sgl_ecospec.lab.bench.sweep_plan import (
    PAIRED_AGAINST,
    ep_hardware,
    expert_exchange,
    prompts_per_batch_size,
    runs_per_batch,
    selection_configs,
    selection_groups,
    selection_record,
)
from sgl_ecospec.lab.bench.sweep_report import checks, new_report, run_label, run_line
from sgl_ecospec.lab.config import GATED_POLICIES, SweepConfig
from sgl_ecospec.lab.datasets import render_chat


def busiest(steps, testbed: dict, ep_sizes) -> dict[str, float]:
    """Mean busiest-rank experts per layer per step on the testbed, per EP size."""
    return {
        str(r): float(ep_cost.busiest_rank_experts(steps, testbed["num_experts"], r).mean())
        for r in ep_sizes
    }


def paired_summary(steps, testbed: dict, ep_sizes) -> dict:
    """The paired comparison of a run's verify sets with the compared policy's.

    Per step, each quantity is the run's set minus the compared set on the same tree:
    distinct experts per layer (mean over layers), busiest-rank experts per layer at each
    EP size > 1 (contiguous placement), summed cumulative draft probability (the draft's
    estimate of accepted tokens) and accepted draft tokens (both sets read from the same
    pass over the whole tree). Reported as the means of both, the mean
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
    values["accepted"] = np.asarray([s.paired_accepted for s in steps], dtype=np.float64)
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


def speculative_run(
    cfg, engine, spec, groups, prompts, greedy, progress, label, compare=None, exchange=None
):
    """One policy at one batch size over every batch: (steps, testbed metrics); with
    ``compare`` (a ``SpecConfig``) the steps also score its selection; with ``exchange``
    (an ``ExpertExchange``) selection follows its measured prices."""
    import torch

    torch.manual_seed(cfg.seed)
    predictor = run_predictor(cfg, engine)
    limit, started = cfg.max_new_tokens, time.perf_counter()
    steps = []
    check = OutputCheck(engine, cfg.check_lossless, label)
    progress.verify_steps = 0
    progress.describe(label)
    run = dict(predictor=predictor, compare=compare, exchange=exchange)
    for result in speculative_batches(
        engine, groups, limit, spec, progress, check, prompts, greedy, **run
    ):
        steps += result.steps
    summary = metrics.summarize(steps)
    verified = sum(s.verified_tokens for s in steps) / sum(s.batch_size for s in steps)
    return steps, {
        **summary,
        "verified_per_request": verified,
        **check.fields(),
        "wall_seconds": time.perf_counter() - started,
    }


def speculation_row(entry, priced, spec_steps, greedy_steps, ar, perf, num_draft_steps) -> dict:
    """A priced row of a run that speculated (``ep_cost.price_steps`` of its steps)."""
    return {
        "speculates": True,
        "accept_length": entry["accept_length"],
        "verified_per_request": entry["verified_per_request"],
        "experts_per_layer_step": entry["experts_per_layer_step"],
        "experts_per_layer_step_scaled": float(priced.unique_scaled.mean()),
        "busiest_rank_experts": float(priced.busiest.mean()),
        "busiest_rank_experts_scaled": float(priced.busiest_scaled.mean()),
        **ep_cost.predicted_speedup(
            spec_steps, priced, greedy_steps, ar, perf, num_draft_steps=num_draft_steps
        ),
    }


def no_speculation_row(greedy: dict, ar) -> dict:
    """A row for decoding without speculation: the greedy run itself (``ar``, priced)."""
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


def batch_results(policies, keys, run_policy, price, no_speculation) -> tuple[dict, dict]:
    """Every policy's run entries and priced rows at one batch size, keyed by policy.

    Args:
        policies: the policies to run, in any order: the result does not depend on it.
        keys: the (profile, EP size) pairs to price.
        run_policy: ``(policy, gate, ep_size) -> (entry, steps)`` runs the policy (``gate``:
            None, or per key for a gated policy, adaptive or cascade; ``ep_size``: the EP
            size it selects for, None for a policy run once for every key,
            ``sweep_plan.selection_groups``); ``steps`` is None for a run the closed gate
            skipped.
        price: ``(entry, steps, key) -> row`` of a run that speculated.
        no_speculation: ``key -> row`` of the greedy run.

    Returns:
        (policy -> list of run entries, policy -> key -> row); a key's row comes from the run
        whose group holds it.

    cascade's gate (``peers.utility_gate``) reads confidence's rows from the results keyed
    by policy, so it runs after the others; adaptive's gate is open until its own run is
    priced. Where a gated policy's own run is predicted no faster than no speculation, its
    bucket turns off (the row is the greedy one, ``rule_speedup`` keeps the run's figure).
    """
    entries, rows = {}, {}
    for policy in sorted(policies, key=lambda p: p == "cascade"):  # the gate's inputs first
        entries[policy], rows[policy] = [], {}
        for ep_size, group in selection_groups(policy, keys):
            gate = None
            if policy == "cascade":
                gate = utility_gate({key: rows["confidence"][key] for key in group})
            elif policy in GATED_POLICIES:
                gate = dict.fromkeys(group, True)
            entry, steps = run_policy(policy, gate, ep_size)
            for key in group:
                if steps is None or (gate is not None and not gate[key]):
                    row = no_speculation(key)
                else:
                    row = price(entry, steps, key)
                    if gate is not None and row["speedup"] <= 1.0:
                        # the gated policy's own run at B is no faster: its bucket turns off.
                        entry["speculates"][key[0]][str(key[1])] = False
                        row = {**no_speculation(key), "rule_speedup": row["speedup"]}
                rows[policy][key] = row
            entries[policy].append(entry)
    return entries, rows


def run_batch(cfg: SweepConfig, engine, batch: int, groups, prompts, perfs, progress, out):
    """Greedy and every policy at batch size ``batch``: the greedy entry, and the run
    entries and priced rows per policy (``batch_results``)."""
    from sgl_ecospec.lab.engine import SpecConfig

    testbed = {k: getattr(engine, k) for k in ("num_layers", "num_experts", "top_k")}
    shape = {"num_experts": engine.num_experts, "top_k": engine.top_k}
    greedy, greedy_steps, seconds = run_greedy(
        engine, {f"greedy batch {batch}": groups}, cfg.max_new_tokens, progress
    )
    greedy = next(iter(greedy.values()))
    root_union, _ = metrics.expert_stats(greedy_steps)
    greedy_entry = {
        "batch_size": batch,
        "prompts": len(prompts),
        "steps": len(greedy_steps),
        "experts_per_layer_step": root_union,
        "busiest_rank_experts": busiest(greedy_steps, testbed, cfg.ep_sizes),
        "wall_seconds": seconds,
    }
    ar = {
        key: ep_cost.price_steps(greedy_steps, perf, **shape, ep_size=key[1])
        for key, perf in perfs.items()
    }
    configs = {
        r: selection_configs(cfg, batch, root_union, testbed, ep_size=r)
        for r in sorted({1, *cfg.ep_sizes})
    }
    decoded = {}  # policy -> (entry, steps) of the runs that decoded once for every key

    def run_policy(policy, gate, ep_size):
        entry = {"batch_size": batch, "policy": policy}
        if ep_size is not None:
            entry["selection_ep_size"] = ep_size
        selected = configs[ep_size or 1]
        if gate is not None:
            entry["speculates"] = {p: {} for p in cfg.profiles}
            for (p, r), on in gate.items():
                entry["speculates"][p][str(r)] = on
        entry["selection"] = selection_record(selected[policy])
        if gate is not None and not any(gate.values()):
            entry["ran"] = False
            progress.advance(len(groups))
            progress.write(f"batch {batch:3d} {run_label(entry):<12} not run: gate closed", out)
            return entry, None
        if policy == "cascade":  # where open, cascade decodes exactly as confidence does
            confidence, spec_steps = decoded["confidence"]
            entry.update({k: v for k, v in confidence.items() if k not in entry})
            entry["same_run_as"] = "confidence"
            progress.advance(len(groups))
            progress.write(run_line(entry), out)
            return entry, spec_steps
        label = f"batch {batch} {run_label(entry)}"
        against = PAIRED_AGAINST.get(policy) if cfg.paired else None
        exchange = None
        if policy == "adaptive":  # prices candidates at the rate the sweep charges them
            exchange = expert_exchange(
                cfg.profiles[0],
                cfg.hardware,
                batch,
                root_union,
                testbed,
                ep_size=ep_size or 1,
                total_weight=selected[policy].get("total_weight"),
            )
        spec_steps, measured = speculative_run(
            cfg,
            engine,
            SpecConfig.from_fields(**selected[policy]),
            groups,
            prompts,
            greedy,
            progress,
            label,
            compare=None if against is None else SpecConfig.from_fields(**selected[against]),
            exchange=exchange,
        )
        if exchange is not None:
            rate, others = exchange.prices()
            entry["expert_exchange"] = {"prior": exchange.prior, "rate": rate, "others": others}
        entry.update(
            ran=True, **measured, busiest_rank_experts=busiest(spec_steps, testbed, cfg.ep_sizes)
        )
        if against is not None and spec_steps:  # no steps: nothing to pair
            entry["paired"] = {
                "against": against,
                **paired_summary(spec_steps, testbed, cfg.ep_sizes),
            }
        progress.write(run_line(entry), out)
        for message in entry["mismatches"]:
            progress.write(f"warning: not lossless: {label}: {message}", sys.stderr)
        if ep_size is None:
            decoded[policy] = entry, spec_steps
        return entry, spec_steps

    def price(entry, spec_steps, key):
        priced = ep_cost.price_steps(spec_steps, perfs[key], **shape, ep_size=key[1])
        row = speculation_row(
            entry, priced, spec_steps, greedy_steps, ar[key], perfs[key], cfg.steps
        )
        if "paired" in entry:  # both sets on the same trees, priced alike
            paired = ep_cost.paired_speedup(
                spec_steps,
                greedy_steps,
                ar[key],
                perfs[key],
                **shape,
                ep_size=key[1],
                num_draft_steps=cfg.steps,
            )
            row["paired_speedup"] = {"against": entry["paired"]["against"], **paired}
        return row

    def no_speculation(key):
        return no_speculation_row(greedy_entry, ar[key])

    entries, rows = batch_results(cfg.policies, list(perfs), run_policy, price, no_speculation)
    return greedy_entry, entries, rows


def run_sweep(cfg: SweepConfig, engine, prompts: list, *, out=None) -> dict:
    """Greedy and every policy at every batch size; returns the report.

    Args:
        cfg: the configuration, its target and draft named (``config.with_models``).
        engine: an ``OfflineEngine`` (or anything with its API).
        prompts: the ``Prompt`` pool (at least as many as the largest batch size needs).
        out: where the lines go (default stdout; the progress bar goes to stderr).
    """
    out = out or sys.stdout
    testbed = {k: getattr(engine, k) for k in ("num_layers", "num_experts", "top_k")}
    pool = [render_chat(engine.tokenizer, p.text) for p in prompts]
    plan = {
        b: batches(pool[: prompts_per_batch_size(b, cfg.num_prompts)], b) for b in cfg.batch_sizes
    }
    perfs = {
        (p, r): performance_model(p, ep_hardware(cfg.hardware, r))
        for p in cfg.profiles
        for r in cfg.ep_sizes
    }
    rep = new_report(cfg, testbed)
    runs = runs_per_batch(cfg.policies, cfg.ep_sizes)
    progress = Progress(sum(len(groups) for groups in plan.values()) * runs)
    try:
        for batch, groups in plan.items():
            used = prompts[: sum(map(len, groups))]
            greedy, entries, rows = run_batch(
                cfg, engine, batch, groups, used, perfs, progress, out
            )
            rep["greedy"].append(greedy)
            for policy in cfg.policies:  # the report's order
                rep["runs"] += entries[policy]
                rep["rows"] += [
                    {"batch_size": batch, "policy": policy, "profile": p, "ep_size": r, **row}
                    for (p, r), row in rows[policy].items()
                ]
    finally:
        progress.close()
    rep["checks"] = checks(rep)
    return rep
