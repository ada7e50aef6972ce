"""The ``sgl-ecospec bench`` command: offline speculative decoding on the testbed, per policy.

Runs the target greedily once (the reference output and the autoregressive baseline), then
speculative decoding once per (budget, policy), and reports acceptance, unique experts per
layer per verify step and predictor recall as measured, plus expert bytes, verify time
and speedup predicted for a real model profile (docs/bench.md).
"""

import argparse
import functools
import os
import sys
import time

from sgl_ecospec.costmodel.profiles import HARDWARE, MODELS
from sgl_ecospec.lab.bench import metrics, report
from sgl_ecospec.lab.costmodel_report import parse_positive_ints
from sgl_ecospec.lab.datasets import DATASETS, load_prompts, render_chat
from sgl_ecospec.ops.selection import DEFAULT_EPS, POLICIES

PREDICTORS = ("online", "oracle", "head")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PLOT = "bench_experts.png"
NOTE = (
    "measured on the testbed: accept, experts, p90, uniform, recall, lossless; predicted for "
    "the profile by the MoESD model on a roofline prior (not measurements): prof_exp, "
    "GB/step, verify_ms, speedup"
)
# Mismatches kept per run in the JSON.
_MAX_MISMATCHES = 5
# Logit difference below which a divergence counts as a near tie (OutputCheck).
TIE_TOLERANCE = 0.1


class LosslessError(RuntimeError):
    """A speculative output differs from the target's greedy output."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``bench`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark verify-set policies on the testbed (acceptance, experts, speedup)",
        description=(
            "Runs greedy decoding and speculative decoding per policy on a small MoE target "
            "(the testbed by default) and reports acceptance length, unique experts per layer "
            "per verify step, predictor recall, and the verify cost predicted for a real "
            "model profile by the MoESD cost model."
        ),
    )
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
    gen = parser.add_argument_group("decoding")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--batch-size", type=int, default=1, help="prompts per batch")
    add_tree_arguments(gen)
    gen.add_argument("--budgets", help="comma-separated budgets for the sweep and the plot")
    gen.add_argument(
        "--policy", default="confidence,ecospec", help=f"comma-separated: {', '.join(POLICIES)}"
    )
    add_predictor_arguments(gen)
    gen.add_argument("--eps", type=float, default=DEFAULT_EPS, help="EcoSpec's P / (cost + eps)")
    gen.add_argument(
        "--share-buffer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one expert buffer for the whole batch",
    )
    add_model_arguments(parser)
    cost = parser.add_argument_group("cost model")
    cost.add_argument("--profile", default="qwen3-235b-a22b", help=f"one of: {', '.join(MODELS)}")
    cost.add_argument("--hardware", default="h200", help=f"{', '.join(HARDWARE)}, or e.g. 8xh200")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the report as JSON")
    out.add_argument(
        "--plot",
        nargs="?",
        const=DEFAULT_PLOT,
        metavar="FILE",
        help=f"plot experts vs budget per policy (needs --budgets; default file {DEFAULT_PLOT})",
    )
    out.add_argument(
        "--save-predictor",
        metavar="FILE",
        help="write the online predictor learned in the last policy's run at --budget: a warm "
        "start for the SGLang plugin (SGLANG_ECOSPEC_PREDICTOR_FILE) on the same target",
    )
    out.add_argument(
        "--check-lossless",
        action="store_true",
        help="fail (exit 1) on the first output that differs from the target's greedy one",
    )
    parser.set_defaults(run=run)
    return parser


def add_predictor_arguments(group) -> None:
    """``--predictor`` and ``--predictor-file`` (shared by ``bench`` and ``sweep``)."""
    group.add_argument(
        "--predictor",
        choices=PREDICTORS,
        default="online",
        help="online: routing counts learnt while decoding; oracle: the true routing; head: "
        "a trained LowRankExpertHead (--predictor-file, from `sgl-ecospec train-head`)",
    )
    group.add_argument(
        "--predictor-file",
        metavar="FILE",
        help="the head for --predictor head, or a saved online predictor to start from "
        "(every run starts from the file)",
    )


def check_predictor_arguments(args: argparse.Namespace) -> None:
    """Errors for ``--predictor`` / ``--predictor-file`` combinations that cannot work."""
    if args.predictor == "head" and not args.predictor_file:
        raise ValueError("--predictor head needs --predictor-file (write one with train-head)")
    if args.predictor == "oracle" and args.predictor_file:
        raise ValueError("--predictor oracle reads the true routing; drop --predictor-file")
    if args.predictor_file and not os.path.isfile(args.predictor_file):
        raise FileNotFoundError(f"--predictor-file {args.predictor_file!r} does not exist")


def add_tree_arguments(group) -> None:
    """--topk, --steps, --budget: the draft tree and its verify budget (bench and sweep)."""
    group.add_argument("--topk", type=int, default=4, help="draft tree branching")
    group.add_argument("--steps", type=int, default=3, help="draft tree depth")
    group.add_argument("--budget", type=int, default=4, help="draft tokens verified per request")


def add_model_arguments(parser) -> None:
    """The "models" group: --target, --draft, --small, --device, --dtype (bench and sweep)."""
    models = parser.add_argument_group("models")
    models.add_argument("--target", metavar="DIR", help="target checkpoint (default: testbed)")
    models.add_argument("--draft", metavar="DIR", help="EAGLE-3 draft checkpoint")
    models.add_argument("--small", action="store_true", help="use the small testbed")
    models.add_argument("--device", default="cpu")
    models.add_argument("--dtype", choices=DTYPES, default="float32")


def num_candidates(topk: int, steps: int) -> int:
    """Draft-tree candidates: topk at the first step, topk^2 at each later step."""
    return topk + (steps - 1) * topk**2


def check_budget(budget: int, topk: int, steps: int) -> None:
    """ValueError unless ``budget`` leaves a choice among the tree's candidates."""
    candidates = num_candidates(topk, steps)
    if not 1 <= budget < candidates:
        raise ValueError(
            f"budget {budget} must be in [1, {candidates - 1}]: the draft tree has "
            f"topk + (steps - 1) x topk^2 = {candidates} candidates (topk {topk}, "
            f"steps {steps}) and verifying all of them leaves nothing to select"
        )


def check_model_arguments(args: argparse.Namespace) -> None:
    """ValueError on an inconsistent --target / --draft / --small (``add_model_arguments``)."""
    if (args.target is None) != (args.draft is None):
        raise ValueError("give both --target and --draft, or neither (the testbed)")
    if args.small and args.target:
        raise ValueError("--small picks the small testbed; it conflicts with --target/--draft")


def validate(args: argparse.Namespace) -> dict:
    """The run's configuration from parsed arguments; ValueError on anything invalid.

    Checks everything that needs no model, so bad arguments fail before any loading.
    """
    from sgl_ecospec.costmodel.profiles import get_hardware, get_model

    for flag in ("num_prompts", "max_new_tokens", "batch_size", "topk", "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    policies = [p.strip() for p in args.policy.split(",")]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"unknown --policy {unknown or args.policy!r}; valid: {POLICIES}")
    if len(set(policies)) != len(policies):
        raise ValueError(f"--policy lists a policy twice: {args.policy!r}")
    candidates = num_candidates(args.topk, args.steps)
    budgets = parse_positive_ints(args.budgets, "--budgets") if args.budgets else []
    for budget in [args.budget, *budgets]:
        check_budget(budget, args.topk, args.steps)
    budgets = sorted({args.budget, *budgets})
    if args.plot and len(budgets) < 2:
        raise ValueError(
            "--plot draws experts against budget: give several, e.g. --budgets 1,2,4,8"
        )
    if not args.eps > 0:
        raise ValueError(f"--eps must be > 0, got {args.eps}")
    if args.save_predictor and args.predictor != "online":
        raise ValueError("--save-predictor writes the online predictor; use --predictor online")
    check_predictor_arguments(args)
    check_model_arguments(args)
    datasets = [d.strip() for d in (args.dataset or "").split(",") if d.strip()]
    datasets += args.prompts or []
    if len(set(datasets)) != len(datasets):
        raise ValueError(f"a dataset is listed twice: {datasets}")
    profile, hardware = get_model(args.profile), get_hardware(args.hardware)
    return {
        "datasets": datasets or ["mt-bench"],
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "topk": args.topk,
        "steps": args.steps,
        "candidates": candidates,
        "budget": args.budget,
        "budgets": budgets,
        "policies": policies,
        "predictor": args.predictor,
        "predictor_file": args.predictor_file,
        "eps": args.eps,
        "share_buffer": args.share_buffer,
        "target": args.target,
        "draft": args.draft,
        "small": args.small,
        "device": args.device,
        "dtype": args.dtype,
        "profile": profile.name,
        "hardware": hardware.name,
        "check_lossless": args.check_lossless,
        "save_predictor": args.save_predictor,
    }


def default_models(small: bool) -> tuple[str, str]:
    """The testbed's (target, draft) directories, built on first use."""
    from sgl_ecospec.lab.testbed.build import build
    from sgl_ecospec.lab.testbed.recipe import RECIPES

    out = build(RECIPES["small" if small else "full"])
    return str(out / "target"), str(out / "draft")


@functools.lru_cache(maxsize=8)
def performance_model(profile: str, hardware: str):
    """MoESD model of ``profile`` on ``hardware`` with the analytic (roofline) parameters."""
    from sgl_ecospec.costmodel import PerformanceModel, analytic_params, get_hardware, get_model

    model, hw = get_model(profile), get_hardware(hardware)
    return PerformanceModel(model, hw, analytic_params(model, hw).params)


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _describe_mismatch(engine, prompt, position: int, expected: list, got: list) -> str:
    def text(ids):
        try:
            return repr(engine.tokenizer.decode(ids))
        except Exception:  # decoding is only a courtesy in an error message
            return "?"

    window = slice(max(0, position - 8), position + 1)
    return (
        f"{prompt.source}: first difference at generated token {position}: greedy "
        f"{expected[window]} {text(expected[window])}, speculative {got[window]} "
        f"{text(got[window])}"
    )


def _logit_gap(engine, ids: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| of the target after ``ids``, one sequence alone."""
    import torch

    with torch.no_grad():
        logits = engine.target.model(torch.tensor([ids], device=engine.device)).logits[0, -1]
    return abs(float(logits[a].float() - logits[b].float()))


class OutputCheck:
    """Compares one run's speculative outputs with the greedy ones (bench and sweep).

    A divergence is a *near tie* when, at the first differing token, the target's own logits
    for the two tokens (computed for the greedy prefix, one sequence alone) differ by at most
    ``TIE_TOLERANCE``: in float32 a batched forward's result depends on the batch around it,
    and with MoE routing a router near-tie can flip an expert and move the logits by a few
    hundredths, so both tokens are greedy choices within arithmetic error. Any other
    divergence is a mismatch: with ``check_lossless`` it raises :class:`LosslessError`.
    """

    def __init__(self, engine, check_lossless: bool, label: str):
        self.engine, self.check_lossless, self.label = engine, check_lossless, label
        self.mismatches: list[str] = []
        self.near_ties: list[str] = []

    def compare(self, prompt, prompt_ids: list[int], expected: list[int], got: list[int]):
        position = metrics.first_mismatch(expected, got)
        if position is None:
            return
        message = _describe_mismatch(self.engine, prompt, position, expected, got)
        if position < len(expected) and position < len(got):
            prefix = prompt_ids + expected[:position]
            gap = _logit_gap(self.engine, prefix, expected[position], got[position])
            message += f"; the target's logits of the two tokens differ by {gap:.4f}"
            if gap <= TIE_TOLERANCE:
                self.near_ties.append(message + " (near tie)")
                return
        if self.check_lossless:
            raise LosslessError(f"{self.label}: {message}")
        self.mismatches.append(message)

    def fields(self) -> dict:
        """``lossless`` (every output equal), ``near_ties`` (outputs that diverged only at
        a near tie), ``mismatch_count`` (the other diverged outputs) and ``mismatches``
        (the first messages, mismatches first)."""
        return {
            "lossless": not (self.mismatches or self.near_ties),
            "near_ties": len(self.near_ties),
            "mismatch_count": len(self.mismatches),
            "mismatches": (self.mismatches + self.near_ties)[:_MAX_MISMATCHES],
        }


class _Progress:
    """The tqdm bar on stderr (shown on a terminal only), counting batches; its postfix
    counts the verify steps of the current run."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="batch", file=sys.stderr, disable=None)
        self.verify_steps = 0

    def on_step(self, step) -> None:
        self.verify_steps += 1
        self.bar.set_postfix(verify_steps=self.verify_steps, refresh=False)

    def write(self, text: str, file) -> None:
        self.bar.write(text, file=file)


def _greedy(engine, batches: dict, limit: int, progress: _Progress):
    """Greedy outputs per dataset (cut at ``limit``), all greedy steps, wall seconds."""
    outputs, steps, started = {}, [], time.perf_counter()
    for name, groups in batches.items():
        progress.bar.set_description(f"greedy {name}")
        outputs[name] = []
        for group in groups:
            result = engine.generate_greedy(group, limit)
            outputs[name] += [o[:limit] for o in result.outputs]
            steps += result.steps
            progress.bar.update()
    return outputs, steps, time.perf_counter() - started


def _speculative(cfg, engine, budget, policy, batches, prompts, greedy, progress) -> dict:
    """One (budget, policy) run over every batch: the testbed metrics (no pricing).

    Raises:
        LosslessError: with ``check_lossless``, at the first output unlike greedy.
    """
    import torch

    from sgl_ecospec.lab.engine import SpecConfig

    torch.manual_seed(cfg["seed"])
    spec = SpecConfig(
        topk=cfg["topk"],
        num_steps=cfg["steps"],
        budget=budget,
        policy=policy,
        eps=cfg["eps"],
        share_buffer=cfg["share_buffer"],
    )
    predictor = run_predictor(cfg, engine)
    limit, started = cfg["max_new_tokens"], time.perf_counter()
    steps, per_dataset, engine_recalls = [], {}, []
    check = OutputCheck(engine, cfg["check_lossless"], f"policy {policy}, budget {budget}")
    progress.verify_steps = 0
    for name, groups in batches.items():
        progress.bar.set_description(f"{policy} budget {budget} {name}")
        ds_steps, index = [], 0
        ds_check = OutputCheck(engine, cfg["check_lossless"], check.label)
        for group in groups:
            result = engine.generate_speculative(
                group, limit, spec, predictor=predictor, progress=progress.on_step
            )
            for ids, got in zip(group, result.outputs, strict=True):
                ds_check.compare(prompts[name][index], ids, greedy[name][index], list(got[:limit]))
                index += 1
            ds_steps += result.steps
            if result.predictor_recall is not None:
                engine_recalls.append((result.predictor_recall, len(result.steps)))
            progress.bar.update()
        per_dataset[name] = {**metrics.summarize(ds_steps), **ds_check.fields()}
        steps += ds_steps
        check.mismatches += ds_check.mismatches
        check.near_ties += ds_check.near_ties
    summary = metrics.summarize(steps)
    if summary["predictor_recall"] is None and engine_recalls:
        # Steps carry no recall: fall back to the engine's per-call figure, step-weighted.
        weight = sum(n for _, n in engine_recalls) or 1
        summary["predictor_recall"] = sum(r * n for r, n in engine_recalls) / weight
    return {
        "policy": policy,
        "budget": budget,
        **summary,
        "uniform_experts_per_layer_step": metrics.uniform_experts(
            steps, engine.num_experts, engine.top_k
        ),
        **check.fields(),
        "wall_seconds": time.perf_counter() - started,
        "per_dataset": per_dataset,
        "steps": steps,  # popped by run_bench after pricing
        "predictor": predictor,  # popped by run_bench
    }


def run_predictor(cfg: dict, engine):
    """The predictor a run starts with: a fresh one per run, learning over all of its
    batches, so every policy starts from the same state and sees the same prompts
    (``--predictor-file`` loaded anew, an empty online table, or "oracle")."""
    from sgl_ecospec.predictors import OnlineExpertPredictor

    if cfg.get("predictor_file"):
        return load_run_predictor(cfg, engine)
    if cfg["predictor"] == "online":
        return OnlineExpertPredictor(
            engine.num_layers, engine.num_experts, engine.top_k, device=cfg["device"]
        )
    return cfg["predictor"]


def load_run_predictor(cfg: dict, engine):
    """``--predictor-file`` loaded for ``engine``'s target and draft, and of the kind
    ``--predictor`` names (a head, or an online table to start from)."""
    from sgl_ecospec.predictors import LowRankExpertHead, load_predictor

    predictor = load_predictor(
        cfg["predictor_file"],
        device=cfg["device"],
        num_layers=engine.num_layers,
        num_experts=engine.num_experts,
        top_k=engine.top_k,
        hidden_size=engine.draft.config.hidden_size,
    )
    is_head = isinstance(predictor, LowRankExpertHead)
    if is_head != (cfg["predictor"] == "head"):
        kind = "a LowRankExpertHead" if is_head else "an online predictor table"
        raise ValueError(
            f"--predictor-file {cfg['predictor_file']!r} holds {kind}; pass --predictor "
            f"{'head' if is_head else 'online'}"
        )
    return predictor


def run_bench(cfg: dict, engine, prompts: dict, *, out=None) -> dict:
    """Greedy once, then speculative decoding per (budget, policy); returns the report.

    Args:
        cfg: from ``validate``.
        engine: an ``OfflineEngine`` (or anything with its API).
        prompts: dataset name -> list of ``Prompt``.
        out: where the table goes (default stdout; the progress bar goes to stderr).
    """
    out = out or sys.stdout
    shape = {"num_experts": engine.num_experts, "top_k": engine.top_k}
    perf = performance_model(cfg["profile"], cfg["hardware"])
    batches = {
        name: _batches([render_chat(engine.tokenizer, p.text) for p in ps], cfg["batch_size"])
        for name, ps in prompts.items()
    }
    runs = [(b, p) for b in cfg["budgets"] for p in cfg["policies"]]
    progress = _Progress(sum(map(len, batches.values())) * (1 + len(runs)))
    try:
        greedy, greedy_steps, seconds = _greedy(engine, batches, cfg["max_new_tokens"], progress)
        mean, p90 = metrics.expert_stats(greedy_steps)
        profile = perf.model
        rep = {
            "note": NOTE,
            "config": {**cfg, "num_prompts": {n: len(ps) for n, ps in prompts.items()}},
            "testbed": {"num_layers": engine.num_layers, **shape},
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
                "experts_per_layer_step": mean,
                "experts_per_layer_step_p90": p90,
                "wall_seconds": seconds,
                "predicted": metrics.predicted_ar(greedy_steps, perf, **shape),
            },
            "policies": {},
            "sweep": [],
        }
        progress.write(report.preamble(rep) + "\n\n" + report.table_header(), out)
        for budget, policy in runs:
            entry = _speculative(cfg, engine, budget, policy, batches, prompts, greedy, progress)
            predictor = entry.pop("predictor")
            if cfg.get("save_predictor") and budget == cfg["budget"] and hasattr(predictor, "save"):
                predictor.save(cfg["save_predictor"])
            entry["predicted"] = metrics.predicted_cost(
                entry.pop("steps"), greedy_steps, perf, **shape, num_draft_steps=cfg["steps"]
            )
            rep["sweep"].append(entry)
            if budget == cfg["budget"]:
                rep["policies"][policy] = entry
            progress.write(report.table_row(entry), out)
            for message in entry["mismatches"]:
                progress.write(
                    f"warning: not lossless: {policy} budget {budget}: {message}", sys.stderr
                )
    finally:
        progress.bar.close()
    per_dataset_table = report.format_dataset_table(rep)
    if per_dataset_table:
        print("\n" + per_dataset_table, file=out)
    return rep


def open_engine(cfg: dict, command: str):
    """The ``OfflineEngine`` of ``cfg``'s target and draft (the testbed, built on first use,
    when none is given; ``cfg`` then names its directories), checked for what the benchmark
    commands need: a chat template and routing that leaves a choice. ``command`` names the
    caller in error messages."""
    if cfg["target"] is None:
        cfg["target"], cfg["draft"] = default_models(cfg["small"])
    for flag in ("target", "draft"):
        if not os.path.isdir(cfg[flag]):
            raise FileNotFoundError(f"--{flag} {cfg[flag]!r} is not a directory")

    import torch

    from sgl_ecospec.lab.engine import OfflineEngine

    engine = OfflineEngine(
        cfg["target"], cfg["draft"], device=cfg["device"], dtype=getattr(torch, cfg["dtype"])
    )
    if engine.tokenizer is None:
        raise ValueError(
            f"{cfg['target']} has no tokenizer: the {command} renders prompts with its chat "
            "template"
        )
    if engine.top_k >= engine.num_experts:
        raise ValueError(
            f"the target routes every token to all {engine.num_experts} experts: nothing to "
            "select or scale"
        )
    return engine


def run(args: argparse.Namespace) -> int:
    """The ``bench`` command: 0 on success, 1 when --check-lossless finds a mismatch."""
    cfg = validate(args)
    prompts = {
        name: load_prompts(name, num_prompts=cfg["num_prompts"], seed=cfg["seed"])
        for name in cfg["datasets"]
    }
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
    return 0
