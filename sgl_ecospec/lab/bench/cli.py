"""The ``sgl-ecospec bench`` command: offline speculative decoding on the testbed, per policy.

Runs the target greedily once (the reference output and the autoregressive baseline), then
speculative decoding once per (budget, policy), and reports acceptance, unique experts per
layer per verify step and predictor recall as measured, plus expert bytes, verify time
and speedup predicted for a real model profile (docs/bench.md).
"""

import argparse
import dataclasses
import sys
import time

from sgl_ecospec.costmodel.profiles import HARDWARE, MODELS
from sgl_ecospec.lab import numerics
from sgl_ecospec.lab.bench import (
    arguments,
    metrics,
    paired_line,
    pareto,
    peers,
    predictor_stats,
    report,
    sweep_plan,
)
from sgl_ecospec.lab.bench.runs import (
    LosslessError,
    OutputCheck,
    Progress,
    batches,
    open_engine,
    performance_model,
    run_greedy,
    run_predictor,
    speculative_batches,
)
from sgl_ecospec.lab.command_line import add_command
from sgl_ecospec.lab.config import (
    BENCH_POLICIES,
    FLOORED_POLICIES,
    PAIRED_POLICIES,
    BenchConfig,
    with_models,
)
from sgl_ecospec.lab.datasets import DATASETS, load_prompts, render_chat
from sgl_ecospec.ops.options import SERVED_MIN_SCORE
from sgl_ecospec.ops.selection import DEFAULT_EPS

DEFAULT_PLOT = "bench_experts.png"
NOTE = (
    "measured on the testbed: accept, experts, p90, uniform, recall, lossless; predicted for "
    "the profile by the MoESD model on a roofline prior (not measurements): prof_exp, "
    "GB/step, verify_ms, speedup"
)
HELP = "benchmark verify-set policies on the testbed (acceptance, experts, speedup)"
DESCRIPTION = (
    "Runs greedy decoding and speculative decoding per policy on a small MoE target (the "
    "testbed by default) and reports acceptance length, unique experts per layer per verify "
    "step, predictor recall, and the verify cost predicted for a real model profile by the "
    "MoESD cost model."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``bench`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = add_command(subparsers, "bench", run, HELP, DESCRIPTION)
    data = parser.add_argument_group("prompts")
    data.add_argument(
        "--dataset",
        help=f"comma-separated: {', '.join(DATASETS)} or .jsonl paths (default: mt-bench)",
    )
    data.add_argument(
        "--prompts", action="append", metavar="FILE", help='a JSONL file of {"prompt": ...}'
    )
    data.add_argument("--num-prompts", type=int, default=16, help="prompts per dataset")
    data.add_argument("--seed", type=int, default=0, help="picks the prompt subset")
    gen = arguments.add_decoding_group(parser, batch_size=1)
    gen.add_argument("--budgets", help="comma-separated budgets for the sweep and the plot")
    gen.add_argument(
        "--policy",
        default="confidence,ecospec",
        help=f"comma-separated: {', '.join(BENCH_POLICIES)} (docs/bench.md, 'Peers')",
    )
    arguments.add_predictor_arguments(gen)
    gen.add_argument(
        "--eps",
        type=float,
        default=DEFAULT_EPS,
        help="EcoSpec's P / (cost + eps) (adaptive: the cost model's)",
    )
    arguments.add_share_buffer_argument(gen, "one expert buffer for the whole batch")
    gen.add_argument(
        "--round-sync",
        action="store_true",
        help="with the shared buffer: the batch's requests pick their k-th candidates at once, "
        "against the buffer as it stood before (the GPU kernel runs such rounds in parallel), "
        "instead of each seeing the picks before its own",
    )
    arguments.add_recall_weighted_argument(gen, default=True)
    gen.add_argument(
        "--calibrated-acceptance",
        action="store_true",
        help="select by each candidate's acceptance probability learnt online from the verify "
        "results, not by its cumulative draft probability (predicted vs measured acceptance "
        "length is reported either way)",
    )
    gen.add_argument(
        "--min-score",
        type=float,
        default=None,
        help="ecospec and adaptive verify no candidate whose draft probability is below this "
        "(so a step may verify fewer than --budget; the peers run as published; default "
        f"{SERVED_MIN_SCORE}, the served default; 0: no floor)",
    )
    gen.add_argument(
        "--paired",
        action="store_true",
        help="score each ecospec and adaptive run at budget b against confidence at b, b - 1, "
        "..., 1 on its own steps (one extra target pass over the whole tree per step): its "
        "distance above confidence's line and curve with a standard error (docs/bench.md)",
    )
    arguments.add_model_arguments(parser)
    cost = parser.add_argument_group("cost model")
    cost.add_argument("--profile", default="qwen3-235b-a22b", help=f"one of: {', '.join(MODELS)}")
    cost.add_argument("--hardware", default="h200", help=f"{', '.join(HARDWARE)}, or e.g. 8xh200")
    out = arguments.add_output_arguments(
        parser,
        default_plot=DEFAULT_PLOT,
        plot_help="plot experts vs budget per policy (needs --budgets; default file "
        f"{DEFAULT_PLOT})",
    )
    out.add_argument(
        "--save-predictor",
        metavar="FILE",
        help="write the online predictor learned in the last policy's run at --budget: a warm "
        "start for the SGLang plugin (SGLANG_ECOSPEC_PREDICTOR_FILE) on the same target",
    )
    pareto.add_arguments(out)
    arguments.add_check_lossless_argument(out)
    return parser


def speculative_run(
    cfg, engine, budget, policy, groups_by_name, prompts, greedy, progress, root_union
):
    """One (budget, policy) run over every batch: the testbed metrics (no pricing).

    ``root_union`` is the greedy run's mean distinct experts per layer per step, from which
    ``adaptive`` prices a testbed expert in the profile's loads (as the sweep does).

    Raises:
        LosslessError: with ``check_lossless``, at the first output unlike greedy.
    """
    import torch

    from sgl_ecospec.acceptance import AcceptanceCalibrator
    from sgl_ecospec.lab.engine import SpecConfig

    torch.manual_seed(cfg.seed)
    perf = performance_model(cfg.profile, cfg.hardware)  # evict's step seconds
    selection = {
        "eps": cfg.eps,
        **peers.spec_fields(policy, perf, cfg.batch_size, budget, cfg.steps),
    }
    floor = {"min_score": cfg.min_score} if policy in FLOORED_POLICIES else {}
    exchange = None
    if policy == "adaptive":  # the cost model's eps and step account, the sweep's prices
        testbed = {k: getattr(engine, k) for k in ("num_layers", "num_experts", "top_k")}
        at = (cfg.profile, cfg.hardware, cfg.batch_size)
        selection = sweep_plan.adaptive_fields(*at, budget, cfg.steps, root_union, testbed)
        exchange = sweep_plan.expert_exchange(*at, root_union, testbed)
    tree = {"topk": cfg.topk, "num_steps": cfg.steps, "share_buffer": cfg.share_buffer}
    tree["round_sync"] = cfg.round_sync
    spec = SpecConfig.from_fields(
        **tree,
        budget=budget,
        **selection,
        **floor,
        calibrated_acceptance=cfg.calibrated_acceptance,
        recall_weighted_cost=cfg.recall_weighted_cost,
    )
    compare = None  # confidence at budget b, b - 1, ..., 1, scored on the run's own steps
    if cfg.paired and policy in PAIRED_POLICIES and budget >= 2:
        compare = tuple(SpecConfig.from_fields(**tree, budget=b) for b in range(budget, 0, -1))
    predictor = predictor_stats.timed(run_predictor(cfg, engine))
    # One calibrator per run, learning over all of its batches, as the predictor does.
    calibrator = AcceptanceCalibrator(cfg.steps, device=cfg.device)
    limit, started = cfg.max_new_tokens, time.perf_counter()
    steps, per_dataset, engine_recalls = [], {}, []
    check = OutputCheck(engine, cfg.check_lossless, f"policy {policy}, budget {budget}")
    progress.verify_steps = 0
    for name, groups in groups_by_name.items():
        progress.describe(f"{policy} budget {budget} {name}")
        ds_steps = []
        ds_check = OutputCheck(engine, cfg.check_lossless, check.label)
        for result in speculative_batches(
            engine,
            groups,
            limit,
            spec,
            progress,
            ds_check,
            prompts[name],
            greedy[name],
            predictor=predictor,
            calibrator=calibrator,
            exchange=exchange,
            compare=compare,
        ):
            ds_steps += result.steps
            if result.predictor_recall is not None:
                engine_recalls.append((result.predictor_recall, len(result.steps)))
        per_dataset[name] = {
            **metrics.summarize(ds_steps),
            **metrics.predicted_acceptance(ds_steps),
            **ds_check.fields(),
        }
        steps += ds_steps
        check.mismatches += ds_check.mismatches
        check.near_ties += ds_check.near_ties
    summary = {**metrics.summarize(steps), **metrics.predicted_acceptance(steps)}
    if summary["predictor_recall"] is None and engine_recalls:
        # Steps carry no recall: fall back to the engine's per-call figure, step-weighted.
        weight = sum(n for _, n in engine_recalls) or 1
        summary["predictor_recall"] = sum(r * n for r, n in engine_recalls) / weight
    if exchange is not None:
        rate, others = exchange.prices()
        summary["expert_exchange"] = {"prior": exchange.prior, "rate": rate, "others": others}
    if compare is not None:
        summary["paired_line"] = paired_line.paired_line(steps, budget)
    return {
        "policy": policy,
        "budget": budget,
        **summary,
        **predictor_stats.predictor_fields(predictor),
        "uniform_experts_per_layer_step": metrics.uniform_experts(
            steps, engine.num_experts, engine.top_k
        ),
        **check.fields(),
        "wall_seconds": time.perf_counter() - started,
        "per_dataset": per_dataset,
        "steps": steps,  # popped by run_bench after pricing
        "predictor": predictor,  # popped by run_bench
    }


# Wall time of one speculative run over the greedy pass's (CPU, testbed, batch 1: four runs
# took about 240 s after a 384 s greedy pass in the main job, docs/RESULTS.md).
SPEC_RUN_VS_GREEDY = 0.16


def _time_estimate(greedy_seconds: float, num_runs: int) -> str:
    minutes = greedy_seconds * SPEC_RUN_VS_GREEDY * num_runs / 60
    return (
        f"[bench] greedy pass: {greedy_seconds:.0f}s; {num_runs} speculative runs follow, "
        f"about {max(1, round(minutes))} min"
    )


def run_bench(cfg: BenchConfig, engine, prompts: dict, *, out=None) -> dict:
    """Greedy once, then speculative decoding per (budget, policy); returns the report.

    Args:
        cfg: the configuration, its target and draft named (``config.with_models``).
        engine: an ``OfflineEngine`` (or anything with its API).
        prompts: dataset name -> list of ``Prompt``.
        out: where the table goes (default stdout; the progress bar goes to stderr).
    """
    out = out or sys.stdout
    shape = {"num_experts": engine.num_experts, "top_k": engine.top_k}
    perf = performance_model(cfg.profile, cfg.hardware)
    groups_by_name = {
        name: batches([render_chat(engine.tokenizer, p.text) for p in ps], cfg.batch_size)
        for name, ps in prompts.items()
    }
    runs = [(b, p) for b in cfg.budgets for p in peers.run_order(cfg.policies)]
    extra_runs = pareto.extra_runs(cfg) if cfg.pareto else []
    num_decoded = len(peers.decoded_runs(runs)) + len(extra_runs)
    progress = Progress(sum(map(len, groups_by_name.values())) * (1 + num_decoded))

    def priced_run(run_cfg, budget, policy):
        entry = speculative_run(
            run_cfg, engine, budget, policy, groups_by_name, prompts, greedy, progress, root_union
        )
        predictor = entry.pop("predictor")
        entry["predicted"] = metrics.predicted_cost(
            entry.pop("steps"), greedy_steps, perf, **shape, num_draft_steps=cfg.steps
        )
        return entry, predictor

    try:
        greedy, greedy_steps, seconds = run_greedy(
            engine, groups_by_name, cfg.max_new_tokens, progress
        )
        root_union, p90 = metrics.expert_stats(greedy_steps)
        profile = perf.model
        rep = {
            "note": NOTE,
            "config": {**cfg.to_dict(), "num_prompts": {n: len(ps) for n, ps in prompts.items()}},
            "testbed": {"num_layers": engine.num_layers, **shape},
            "numerics": "pinned" if numerics.pinned() else "native",
            "profile": {
                f: getattr(profile, f)
                for f in ("name", "moe_layers", "num_experts", "top_k", "bytes_per_expert")
            },
            "hardware": {
                "name": perf.hardware.name,
                "memory_bandwidth": perf.hardware.memory_bandwidth,
            },
            "greedy": {
                "steps": len(greedy_steps),
                "experts_per_layer_step": root_union,
                "experts_per_layer_step_p90": p90,
                "wall_seconds": seconds,
                "predicted": metrics.predicted_ar(greedy_steps, perf, **shape),
            },
            "policies": {},
            "sweep": [],
        }
        progress.write(_time_estimate(seconds, num_decoded), sys.stderr)
        if cfg.pareto:
            progress.write(pareto.announce(cfg), sys.stderr)
        progress.write(report.preamble(rep) + "\n\n" + report.table_header(), out)
        for budget, policy in runs:
            # cascade reuses confidence's run at this budget when there is one.
            entry = peers.confidence_run(rep["sweep"], budget) if policy == "cascade" else None
            if entry is None:
                entry, predictor = priced_run(cfg, budget, policy)
                if cfg.save_predictor and budget == cfg.budget and hasattr(predictor, "save"):
                    predictor.save(cfg.save_predictor)
            if policy == "cascade":
                entry = peers.cascade_entry(entry, greedy_steps, perf, **shape)
            rep["sweep"].append(entry)
            if budget == cfg.budget:
                rep["policies"][policy] = entry
            progress.write(report.table_row(entry), out)
            for note in (peers.gate_note(entry), paired_line.note(entry)):
                if note:
                    progress.write(note, out)
            for message in entry["mismatches"]:
                progress.write(
                    f"warning: not lossless: {policy} budget {budget}: {message}", sys.stderr
                )
        extra = []
        for budget, policy, eps in extra_runs:
            entry, _ = priced_run(dataclasses.replace(cfg, eps=eps), budget, policy)
            extra.append((entry, eps))
            progress.write(pareto.format_line(pareto.point(entry, eps, True)), out)
        if cfg.pareto:
            rep["pareto"] = pareto.collect(cfg, rep, extra)
    finally:
        progress.close()
    per_dataset_table = report.format_dataset_table(rep)
    if per_dataset_table:
        print("\n" + per_dataset_table, file=out)
    return rep


def run(args: argparse.Namespace) -> int:
    """The ``bench`` command: 0 on success, 1 when --check-lossless finds a mismatch.

    Without --target/--draft it runs on the testbed, building it first when missing."""
    cfg = BenchConfig.from_args(args)
    prompts = {
        name: load_prompts(name, num_prompts=cfg.num_prompts, seed=cfg.seed)
        for name in cfg.datasets
    }
    cfg = with_models(cfg, build_testbed=True)
    engine = open_engine(cfg, "benchmark")
    try:
        rep = run_bench(cfg, engine, prompts)
    except LosslessError as exc:
        print(f"sgl-ecospec bench: LOSSLESS CHECK FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        report.write_json(rep, args.json)
    if args.plot:
        report.write_plot(rep, args.plot)
    if args.pareto:
        pareto.write_plot(rep, args.pareto)
    return 0
