"""Typed run configurations of the offline commands: ``bench``, ``sweep`` and ``train-head``.

Each is a frozen dataclass built once from the parsed arguments (``from_args``) and checked
when constructed, before any model is loaded: a ValueError (FileNotFoundError for a missing
``--predictor-file``) names the flag at fault. ``to_dict`` is the configuration as the JSON
reports carry it.

Where the models are is resolved separately and explicitly: ``target`` and ``draft`` stay
None until :func:`with_models` returns a copy naming the directories, building the testbed
(announced on stderr first) only when the calling command asks for it.
"""

import dataclasses
import os
import sys

from sgl_ecospec.costmodel.profiles import HARDWARE, MODELS, get_hardware, get_model
from sgl_ecospec.lab.command_line import parse_positive_ints
from sgl_ecospec.lab.testbed import build as testbed_build
from sgl_ecospec.lab.testbed.recipe import RECIPES, build_dir
from sgl_ecospec.ops.options import (
    POLICIES,
    SERVED_MIN_SCORE,
    SERVED_SHARE_BUFFER,
    SelectionOptions,
)
from sgl_ecospec.predictors.catalog import ONLINE_PREDICTORS

# The peers of ../shared/docs/PEERS.md as benchmark policies (docs/bench.md, "Peers"):
# "evict" cuts confidence's choice to its best prefix per step (lab/engine/evict.py),
# "cascade" is confidence behind the utility gate (lab/bench/peers.py).
PEER_POLICIES = ("evict", "cascade")
# bench's policies: the op's, then the peers.
BENCH_POLICIES = (*POLICIES, *PEER_POLICIES)
# The sweep's policies, in the order they are reported.
SWEEP_POLICIES = ("confidence", "ecospec", "ecospec-ep", "adaptive", *PEER_POLICIES)
# bench --paired: the policies scored on their own steps against confidence's line.
PAIRED_POLICIES = ("ecospec", "adaptive")
# bench --min-score: EcoSpec's policies take the floor; the peers run as published.
FLOORED_POLICIES = ("ecospec", "adaptive")
# Policies gated per batch size: cascade by confidence's predicted speedup (Cascade's rule,
# sweep_run.utility_gate), adaptive by its own run's (as the server's gate measures ECOSPEC's
# own utility).
GATED_POLICIES = ("adaptive", "cascade")
# Testbed build times on two cores (docs/testbed.md), for the announcement.
_BUILD_TIME = {
    "full": "about 8-10 minutes with the shipped draft, 40-50 if it must train a draft",
    "small": "about 3 to 7 minutes",
}


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


def _check_at_least_one(config, names) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _check_models(target, draft) -> None:
    if (target is None) != (draft is None):
        raise ValueError("give both --target and --draft, or neither (the testbed)")


def _model_fields(args) -> dict:
    """The model flags; --small with --target/--draft is an error (once resolved, a
    configuration names the small testbed's directories with ``small`` set)."""
    _check_models(args.target, args.draft)
    if args.small and args.target:
        raise ValueError("--small picks the small testbed; it conflicts with --target/--draft")
    return {k: getattr(args, k) for k in ("target", "draft", "small", "device", "dtype")}


def _check_predictor(predictor: str, predictor_file) -> None:
    if predictor == "head" and not predictor_file:
        raise ValueError("--predictor head needs --predictor-file (write one with train-head)")
    if predictor == "oracle" and predictor_file:
        raise ValueError("--predictor oracle reads the true routing; drop --predictor-file")
    if predictor_file and not os.path.isfile(predictor_file):
        raise FileNotFoundError(f"--predictor-file {predictor_file!r} does not exist")


def _names(text: str, flag: str, valid) -> tuple[str, ...]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(f"unknown {flag} {unknown or text!r}; valid: {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{flag} lists a name twice: {text!r}")
    return tuple(names)


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def _sizes(text: str, flag: str) -> tuple[int, ...]:
    sizes = parse_positive_ints(text, flag)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"{flag} lists a size twice: {text!r}")
    return tuple(sorted(sizes))


class _Config:
    """``to_dict`` for the configurations below (tuples become lists, as in JSON)."""

    def to_dict(self) -> dict:
        return {
            f.name: list(v) if isinstance(v, tuple) else v
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }


@dataclasses.dataclass(frozen=True)
class BenchConfig(_Config):
    """``sgl-ecospec bench``: greedy once, then speculative decoding per (budget, policy).

    ``budget`` is the main budget (the per-policy results); ``budgets`` every budget run,
    sorted, ``budget`` among them. ``candidates`` follows from ``topk`` and ``steps``.
    """

    datasets: tuple[str, ...] = ("mt-bench",)
    num_prompts: int = 16
    seed: int = 0
    max_new_tokens: int = 64
    batch_size: int = 1
    topk: int = 4
    steps: int = 3
    candidates: int = dataclasses.field(init=False)
    budget: int = 4
    budgets: tuple[int, ...] = ()
    policies: tuple[str, ...] = ("confidence", "ecospec")
    predictor: str = "online"
    predictor_file: str | None = None
    eps: float = SelectionOptions.eps
    share_buffer: bool = SERVED_SHARE_BUFFER
    calibrated_acceptance: bool = False
    recall_weighted_cost: bool = True
    min_score: float | None = None
    target: str | None = None
    draft: str | None = None
    small: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    profile: str = "qwen3-235b-a22b"
    hardware: str = "h200"
    check_lossless: bool = False
    save_predictor: str | None = None
    pareto: bool = False
    pareto_eps: tuple[float, ...] = (0.01, 0.03, 0.3, 1.0)
    paired: bool = False
    round_sync: bool = False
    plot: bool = dataclasses.field(default=False, repr=False, compare=False)

    def __post_init__(self):
        _check_at_least_one(self, ("num_prompts", "max_new_tokens", "batch_size", "topk", "steps"))
        if self.round_sync and not self.share_buffer:
            raise ValueError(
                "--round-sync changes how the batch's one buffer fills: drop --no-share-buffer"
            )
        unknown = [p for p in self.policies if p not in BENCH_POLICIES]
        if unknown or not self.policies:
            raise ValueError(
                f"unknown --policy {unknown or self.policies!r}; valid: {BENCH_POLICIES}"
            )
        if not self.pareto_eps or not all(e > 0 for e in self.pareto_eps):
            raise ValueError(f"--pareto-eps must be numbers > 0, got {list(self.pareto_eps)}")
        object.__setattr__(self, "pareto_eps", tuple(sorted(set(self.pareto_eps))))
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policy lists a policy twice: {','.join(self.policies)!r}")
        object.__setattr__(self, "candidates", num_candidates(self.topk, self.steps))
        object.__setattr__(self, "budgets", tuple(sorted({self.budget, *self.budgets})))
        for budget in self.budgets:  # the one check of every budget
            check_budget(budget, self.topk, self.steps)
        if self.plot and len(self.budgets) < 2:
            raise ValueError(
                "--plot draws experts against budget: give several, e.g. --budgets 1,2,4,8"
            )
        if self.paired and not (
            set(self.policies) & set(PAIRED_POLICIES) and max(self.budgets) >= 2
        ):
            raise ValueError(
                "--paired scores ecospec and adaptive runs against confidence at their budget "
                "b and below: list one of them (--policy) at a budget of 2 or more"
            )
        try:
            SelectionOptions(eps=self.eps)  # the one eps rule, the op's
        except (TypeError, ValueError):
            raise ValueError(f"--eps must be > 0, got {self.eps}") from None
        if self.min_score is None:  # ECOSPEC's floor; the peers run as published
            object.__setattr__(self, "min_score", SERVED_MIN_SCORE)
        elif self.min_score > 0 and not set(self.policies) & set(FLOORED_POLICIES):
            raise ValueError(
                f"--min-score floors {' and '.join(FLOORED_POLICIES)} only (the peers run as "
                "published): list one of them with --policy"
            )
        try:
            SelectionOptions(min_score=self.min_score)
        except (TypeError, ValueError):
            raise ValueError(
                f"--min-score must be a draft probability >= 0, got {self.min_score}"
            ) from None
        if self.save_predictor and self.predictor not in ONLINE_PREDICTORS:
            raise ValueError(
                "--save-predictor writes the online predictor's table; use --predictor "
                f"{', '.join(ONLINE_PREDICTORS)}"
            )
        _check_predictor(self.predictor, self.predictor_file)
        _check_models(self.target, self.draft)
        if len(set(self.datasets)) != len(self.datasets):
            raise ValueError(f"a dataset is listed twice: {list(self.datasets)}")
        get_model(self.profile), get_hardware(self.hardware)

    def to_dict(self) -> dict:
        """The ``config`` of the JSON report (before ``num_prompts`` becomes per dataset);
        the Pareto runs are described in the report's ``pareto``."""
        hidden = ("plot", "pareto", "pareto_eps")
        return {k: v for k, v in super().to_dict().items() if k not in hidden}

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        """From ``bench``'s parsed arguments; ValueError on anything invalid."""
        policies = [p.strip() for p in args.policy.split(",")]
        budgets = parse_positive_ints(args.budgets, "--budgets") if args.budgets else []
        datasets = [d.strip() for d in (args.dataset or "").split(",") if d.strip()]
        datasets += args.prompts or []
        return cls(
            datasets=tuple(datasets) or ("mt-bench",),
            **{k: getattr(args, k) for k in ("num_prompts", "seed", "max_new_tokens")},
            **{k: getattr(args, k) for k in ("batch_size", "topk", "steps", "budget")},
            budgets=tuple(budgets),
            policies=tuple(policies),
            **{k: getattr(args, k) for k in ("predictor", "predictor_file", "eps")},
            share_buffer=args.share_buffer,
            calibrated_acceptance=args.calibrated_acceptance,
            recall_weighted_cost=args.recall_weighted_cost,
            min_score=args.min_score,
            **_model_fields(args),
            profile=get_model(args.profile).name,
            hardware=get_hardware(args.hardware).name,
            check_lossless=args.check_lossless,
            save_predictor=args.save_predictor,
            pareto=bool(args.pareto),
            pareto_eps=_floats(args.pareto_eps, "--pareto-eps"),
            paired=args.paired,
            round_sync=args.round_sync,
            plot=bool(args.plot),
        )


@dataclasses.dataclass(frozen=True)
class SweepConfig(_Config):
    """``sgl-ecospec sweep``: every policy at every batch size, priced per profile and EP size.

    ``policies`` are kept in :data:`SWEEP_POLICIES` order (the report's order).
    """

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    policies: tuple[str, ...] = SWEEP_POLICIES
    ep_sizes: tuple[int, ...] = (1, 8)
    profiles: tuple[str, ...] = ("qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3")
    hardware: str = "h200"
    dataset: str = "mt-bench"
    num_prompts: int = 8
    seed: int = 0
    max_new_tokens: int = 64
    topk: int = 4
    steps: int = 3
    candidates: int = dataclasses.field(init=False)
    budget: int = 4
    share_buffer: bool = SERVED_SHARE_BUFFER
    predictor: str = "online"
    predictor_file: str | None = None
    paired: bool = False
    recall_weighted_cost: bool = False
    target: str | None = None
    draft: str | None = None
    small: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    check_lossless: bool = False

    def __post_init__(self):
        _check_at_least_one(self, ("num_prompts", "topk", "steps"))
        if self.max_new_tokens < 2:
            raise ValueError(
                f"--max-new-tokens must be >= 2 (the first token comes from the prefill, so "
                f"greedy decoding needs a second one to have a step), got {self.max_new_tokens}"
            )
        object.__setattr__(self, "candidates", num_candidates(self.topk, self.steps))
        unknown = [p for p in self.policies if p not in SWEEP_POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"unknown --policies {unknown}; valid: {', '.join(SWEEP_POLICIES)}")
        # Reported in a fixed order; no result depends on the order the policies run in.
        object.__setattr__(self, "policies", tuple(p for p in SWEEP_POLICIES if p in self.policies))
        if "cascade" in self.policies and "confidence" not in self.policies:
            raise ValueError(
                "cascade: the per-batch-size gate reads the speedup of confidence selection "
                "at the same batch size: add confidence to --policies"
            )
        if "ecospec-ep" in self.policies and max(self.ep_sizes) == 1:
            raise ValueError("ecospec-ep selects for expert parallelism: give --ep-sizes above 1")
        for name in self.profiles:
            experts = MODELS[name].num_experts
            bad = [r for r in self.ep_sizes if experts % r]
            if bad:
                raise ValueError(
                    f"--ep-sizes {bad}: {name} has {experts} experts per layer, which EP "
                    "ranks must split evenly"
                )
        if self.hardware not in HARDWARE:
            raise ValueError(
                f"--hardware is one device, got {self.hardware!r}: EP R is priced on R of them"
            )
        check_budget(self.budget, self.topk, self.steps)
        _check_predictor(self.predictor, self.predictor_file)
        _check_models(self.target, self.draft)

    @classmethod
    def from_args(cls, args) -> "SweepConfig":
        """From ``sweep``'s parsed arguments; ValueError on anything invalid."""
        batch_sizes = _sizes(args.batch_sizes, "--batch-sizes")
        ep_sizes = _sizes(args.ep_sizes, "--ep-sizes")
        policies = _names(args.policies, "--policies", SWEEP_POLICIES)
        return cls(
            batch_sizes=batch_sizes,
            policies=policies,
            ep_sizes=ep_sizes,
            profiles=_names(args.profiles, "--profiles", MODELS),
            hardware=get_hardware(args.hardware).name,
            dataset=args.dataset.strip(),
            **{k: getattr(args, k) for k in ("num_prompts", "seed", "max_new_tokens")},
            **{k: getattr(args, k) for k in ("topk", "steps", "budget", "share_buffer")},
            **{k: getattr(args, k) for k in ("predictor", "predictor_file", "paired")},
            recall_weighted_cost=args.recall_weighted_cost,
            **_model_fields(args),
            check_lossless=args.check_lossless,
        )


@dataclasses.dataclass(frozen=True)
class TrainHeadConfig(_Config):
    """``sgl-ecospec train-head``: record routing while decoding, train a head on it."""

    datasets: tuple[str, ...] = ("sharegpt",)
    num_prompts: int = 64
    seed: int = 0
    max_new_tokens: int = 64
    batch_size: int = 4
    topk: int = 4
    steps: int = 3
    budget: int = 4
    rank: int = 64
    token_buckets: int = 4096
    epochs: int = 10
    lr: float = 3e-3
    val_fraction: float = 0.1
    target: str | None = None
    draft: str | None = None
    small: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    out: str = "head.pt"
    save_table: str | None = None

    def __post_init__(self):
        _check_at_least_one(
            self, ("num_prompts", "max_new_tokens", "batch_size", "topk", "steps", "rank", "epochs")
        )
        if self.token_buckets < 0:
            raise ValueError(f"--token-buckets must be >= 0, got {self.token_buckets}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        check_budget(self.budget, self.topk, self.steps)
        _check_models(self.target, self.draft)
        if not self.datasets:
            raise ValueError("--dataset names no dataset")

    @classmethod
    def from_args(cls, args) -> "TrainHeadConfig":
        """From ``train-head``'s parsed arguments; ValueError on anything invalid."""
        models = _model_fields(args)
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in ("datasets", *models)]
        datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
        return cls(datasets=tuple(datasets), **{k: getattr(args, k) for k in fields}, **models)


# --- where the models are --------------------------------------------------------------------


def testbed_models(small: bool) -> tuple[str, str]:
    """The testbed's (target, draft) directories, built on first use: a build is announced
    on stderr before it starts (it takes minutes; later runs reuse it)."""
    variant = "small" if small else "full"
    recipe = RECIPES[variant]
    directory = build_dir(recipe)
    if not (directory / testbed_build.INFO_FILE).is_file():
        print(
            f"[testbed] building the {variant} testbed (2 cores: {_BUILD_TIME[variant]}) "
            f"into {directory}; later runs reuse it",
            file=sys.stderr,
            flush=True,
        )
    out = testbed_build.build(recipe)
    return str(out / "target"), str(out / "draft")


def with_models(config, *, build_testbed: bool):
    """``config`` (a copy) naming its target and draft directories.

    Given ``--target``/``--draft`` are kept. Without them the testbed is used, and built
    first if needed, but only where the command says so (``build_testbed``): otherwise a
    ValueError asks for the flags.
    """
    if config.target is not None:
        return config
    if not build_testbed:
        raise ValueError("give --target and --draft: this command does not build the testbed")
    target, draft = testbed_models(config.small)
    return dataclasses.replace(config, target=target, draft=draft)
