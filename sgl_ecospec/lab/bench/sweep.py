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
- ``adaptive``: per-step adaptive selection behind a per-batch-size gate on its own
  utility, as the server's gate measures ECOSPEC's own: where the adaptive run at B is
  predicted no faster than no speculation for a profile and EP size, ``adaptive`` is the
  greedy run there (speedup 1; ``rule_speedup`` keeps the run's own figure). Its layer
  weights (and under EP its ``total_weight``) follow the prices of testbed experts in the
  profile's loads that the pricing charges its own verified candidates
  (``bench.expert_exchange``), with ``testbed_expert_weight`` as the prior.
  ``select_verify_set(policy="adaptive")`` takes ``ecospec``'s nodes only while they raise
  the step's tokens per cost, with eps and the step's starting account from
  ``selection_cost`` (primary profile, batch B, the EP group's cost); with
  ``--recall-weighted-cost`` (also for ``ecospec``) DeltaCost trusts only what the
  predictor knows.
- ``evict`` (a peer, ``bench.peers``): confidence's choice cut per step to the prefix of
  its order that maximises expected tokens per predicted step time, the time of the primary
  profile at batch B depending on the number of verified tokens only (``engine.evict``).

``adaptive`` and ``evict`` size their sets by the deployment's step cost, so each runs once
per ``--ep-sizes`` entry, selecting with that EP group's cost model as a server at that EP
size would (``sweep_plan.EP_SELECTED``), and each EP size is priced with its own run
(``adaptive@EP8`` in the tables).
- ``cascade`` (a peer): confidence selection behind Cascade's gate per batch size, profile
  and EP size (confidence's own predicted speedup above 1); where open, its run is
  confidence's own (reused, not decoded again), where closed it is the greedy run (speedup 1).

With ``--paired`` the ecospec run also scores confidence's choice, and the ecospec-ep run
ecospec's, on each of its own steps (same tree, same predictions, same buffer seed), and
both sets' true expert unions are compared step by step (``paired``): the effect of the
selection alone, free of two decodes drifting apart.

Every run is priced for every profile at every EP size by ``ep_cost`` (unions scaled by the
effective-token method, busiest rank by the imbalance method, expert loads by the busiest
rank under EP), on the hardware profile times the EP size (EP 8 on ``8xh200``).

Modules: ``sweep_plan`` (prompts per batch size, selection constants), ``sweep_run`` (the
runs, their pricing, adaptive's gate), ``sweep_report`` (bars, tables, plot); this one
registers the command.
"""

import argparse
import sys

from sgl_ecospec.costmodel.profiles import HARDWARE, MODELS
from sgl_ecospec.lab.bench import arguments
from sgl_ecospec.lab.bench import report as bench_report
from sgl_ecospec.lab.bench.runs import LosslessError, open_engine
from sgl_ecospec.lab.bench.sweep_plan import prompts_per_batch_size
from sgl_ecospec.lab.bench.sweep_report import format_tables, write_plot
from sgl_ecospec.lab.bench.sweep_run import run_sweep
from sgl_ecospec.lab.command_line import add_command
from sgl_ecospec.lab.config import SWEEP_POLICIES as POLICIES
from sgl_ecospec.lab.config import SweepConfig, with_models
from sgl_ecospec.lab.datasets import DATASETS, load_prompts

DEFAULT_BATCH_SIZES = "1,2,4,8,16,32,64"
DEFAULT_PROFILES = "qwen3-235b-a22b,gpt-oss-120b,deepseek-v3"
DEFAULT_PLOT = "sweep_speedup.png"
HELP = "policies across batch sizes and EP sizes, speedup predicted for real models"
DESCRIPTION = (
    "Runs greedy decoding and speculative decoding per policy on the testbed at several batch "
    "sizes, and reports acceptance length, unique experts per layer per step, busiest-rank "
    "experts under expert parallelism, and the step time and speedup over no speculation "
    "predicted for real model profiles."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``sweep`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = add_command(subparsers, "sweep", run, HELP, DESCRIPTION)
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
    arguments.add_tree_arguments(gen)
    arguments.add_predictor_arguments(gen)
    gen.add_argument(
        "--paired",
        action="store_true",
        help="ecospec also scores confidence's choice, and ecospec-ep ecospec's, on each of "
        "its own steps: both sets' true expert unions compared on the same trees (one extra "
        "target pass over the whole tree per step of those runs)",
    )
    arguments.add_share_buffer_argument(
        gen, "one expert buffer (and one adaptive account) for the whole batch"
    )
    arguments.add_recall_weighted_argument(gen, default=False)
    arguments.add_model_arguments(parser)
    out = arguments.add_output_arguments(
        parser,
        default_plot=DEFAULT_PLOT,
        plot_help=f"plot speedup vs batch size per policy (default file {DEFAULT_PLOT})",
    )
    arguments.add_check_lossless_argument(out)
    return parser


def run(args: argparse.Namespace) -> int:
    """The ``sweep`` command: 0 on success, 1 when --check-lossless finds a mismatch.

    Without --target/--draft it runs on the testbed, building it first when missing."""
    cfg = SweepConfig.from_args(args)
    needed = max(prompts_per_batch_size(b, cfg.num_prompts) for b in cfg.batch_sizes)
    prompts = load_prompts(cfg.dataset, num_prompts=needed, seed=cfg.seed)
    cfg = with_models(cfg, build_testbed=True)
    engine = open_engine(cfg, "sweep")
    bad = [r for r in cfg.ep_sizes if engine.num_experts % r]
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
