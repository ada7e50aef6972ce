"""``bench --pareto``: unique experts per layer per verify step against acceptance length.

Two reference lines and the bench's own runs on one plane (docs/bench.md, "Pareto plot"):

- confidence selection at budgets 1..7 (those the tree allows: at most candidates - 1);
- ecospec at ``--budget`` across ``--pareto-eps`` (and ``--eps`` where the main runs have
  ecospec at ``--budget``);
- every (budget, policy) run of the main table, and greedy decoding (acceptance 1).

Points the main table already has are reused; the others are extra runs, announced with
their count before they start. A policy is better than a line where its point lies above it
(longer acceptance) or left of it (fewer experts).

The report's ``pareto``: ``{"confidence": [...], "ecospec": [...], "runs": [...],
"greedy": {...}, "eps": [...], "budget": B}``, each point ``{"policy", "budget", "eps",
"accept_length", "experts_per_layer_step", "speedup", "lossless", "extra"}`` (``extra``:
run for the plot only; ``speedup`` predicted for the profile, as in the main table).
"""

from sgl_ecospec.lab.bench import metrics

DEFAULT_PARETO = "bench_pareto.png"
CONFIDENCE_BUDGETS = tuple(range(1, 8))
DEFAULT_PARETO_EPS = "0.01,0.03,0.3,1"


def add_arguments(group) -> None:
    """--pareto [FILE] and --pareto-eps on ``bench``'s output group."""
    group.add_argument(
        "--pareto",
        nargs="?",
        const=DEFAULT_PARETO,
        metavar="FILE",
        help="plot unique experts per step against acceptance length: confidence at budgets "
        "1..7 and ecospec across --pareto-eps (extra runs), and every policy's runs "
        f"(default file {DEFAULT_PARETO}; JSON key 'pareto')",
    )
    group.add_argument(
        "--pareto-eps",
        default=DEFAULT_PARETO_EPS,
        metavar="LIST",
        help=f"comma-separated eps of the ecospec line of --pareto (default {DEFAULT_PARETO_EPS})",
    )


def confidence_budgets(cfg) -> tuple[int, ...]:
    """The confidence line's budgets: 1..7, at most candidates - 1."""
    return tuple(b for b in CONFIDENCE_BUDGETS if b < cfg.candidates)


def ecospec_eps(cfg) -> tuple[float, ...]:
    """The ecospec line's eps: ``--pareto-eps``, and ``--eps`` when the main runs have
    ecospec at ``--budget``."""
    main = (cfg.eps,) if "ecospec" in cfg.policies else ()
    return tuple(sorted({*cfg.pareto_eps, *main}))


def extra_runs(cfg) -> list[tuple[int, str, float]]:
    """(budget, policy, eps) of the runs the plot needs beyond the main table's."""
    done = {(b, p) for b in cfg.budgets for p in cfg.policies}
    runs = [(b, "confidence", cfg.eps) for b in confidence_budgets(cfg)]
    runs = [r for r in runs if r[:2] not in done]
    main_ecospec = (cfg.budget, "ecospec") in done
    return runs + [
        (cfg.budget, "ecospec", eps)
        for eps in ecospec_eps(cfg)
        if not (main_ecospec and eps == cfg.eps)
    ]


def announce(cfg) -> str:
    """The progress line before the extra runs."""
    runs = extra_runs(cfg)
    budgets = [b for b, p, _ in runs if p == "confidence"]
    eps = [e for _, p, e in runs if p == "ecospec"]
    return (
        f"[bench] --pareto: {len(runs)} extra runs (confidence at budgets "
        f"{','.join(map(str, budgets)) or 'none'}; ecospec at budget {cfg.budget}, eps "
        f"{','.join(f'{e:g}' for e in eps) or 'none'})"
    )


def point(entry: dict, eps: float | None, extra: bool) -> dict:
    """A run (a priced bench entry) as a point of the plane."""
    return {
        "policy": entry["policy"],
        "budget": entry["budget"],
        "eps": eps,
        "accept_length": entry["accept_length"],
        "experts_per_layer_step": entry["experts_per_layer_step"],
        "speedup": entry["predicted"]["speedup"],
        "lossless": metrics.lossless_status(entry),
        "extra": extra,
    }


def collect(cfg, report: dict, extra: list[tuple[dict, float]]) -> dict:
    """The report's ``pareto`` from the main runs (``report["sweep"]``), the greedy run and
    the extra runs (``(entry, eps)`` pairs of ``extra_runs``)."""
    main = report["sweep"]
    confidence = [point(e, None, False) for e in main if e["policy"] == "confidence"]
    confidence += [point(e, None, True) for e, _ in extra if e["policy"] == "confidence"]
    ecospec = [
        point(e, cfg.eps, False)
        for e in main
        if e["policy"] == "ecospec" and e["budget"] == cfg.budget
    ]
    ecospec += [point(e, eps, True) for e, eps in extra if e["policy"] == "ecospec"]
    budgets = set(confidence_budgets(cfg))
    return {
        "budget": cfg.budget,
        "eps": list(ecospec_eps(cfg)),
        "confidence": sorted(
            (p for p in confidence if p["budget"] in budgets), key=lambda p: p["budget"]
        ),
        "ecospec": sorted(ecospec, key=lambda p: p["eps"]),
        "runs": [point(e, cfg.eps if e["policy"] == "ecospec" else None, False) for e in main],
        "greedy": {
            "accept_length": 1.0,
            "experts_per_layer_step": report["greedy"]["experts_per_layer_step"],
        },
    }


def format_line(p: dict) -> str:
    """One extra run as a progress line."""
    eps = "" if p["policy"] != "ecospec" else f" eps {p['eps']:g}"
    return (
        f"pareto {p['policy']} budget {p['budget']}{eps}: accept {p['accept_length']:.3f}, "
        f"experts {p['experts_per_layer_step']:.2f}, lossless {p['lossless']}"
    )


def write_plot(report: dict, path: str) -> None:
    """Writes a PNG: unique experts per layer per verify step (x) against acceptance length
    (y): the confidence line over budgets, the ecospec line over eps, every policy's runs
    and greedy decoding."""
    from matplotlib.figure import Figure

    pareto = report["pareto"]
    fig = Figure(figsize=(7.5, 5.5), layout="constrained")
    ax = fig.subplots()
    for name, label, style in (
        ("confidence", "confidence, budgets {}", "o-"),
        ("ecospec", "ecospec at budget {}, eps {}", "s-"),
    ):
        line = pareto[name]
        if not line:
            continue
        x = [p["experts_per_layer_step"] for p in line]
        y = [p["accept_length"] for p in line]
        if name == "confidence":
            text = label.format(f"{line[0]['budget']}..{line[-1]['budget']}")
            tags = [f"b{p['budget']}" for p in line]
        else:
            text = label.format(pareto["budget"], ",".join(f"{p['eps']:g}" for p in line))
            tags = [f"eps {p['eps']:g}" for p in line]
        ax.plot(x, y, style, alpha=0.6, label=text)
        for j, (xi, yi, tag) in enumerate(zip(x, y, tags, strict=True)):
            offset = (4, -10 - 8 * (j % 2))  # neighbours alternate: close points stay legible
            ax.annotate(tag, (xi, yi), textcoords="offset points", xytext=offset, fontsize=7)
    markers = "D^v<>Ph*X"
    policies = list(dict.fromkeys(p["policy"] for p in pareto["runs"]))
    for i, policy in enumerate(policies):
        runs = [p for p in pareto["runs"] if p["policy"] == policy]
        ax.scatter(
            [p["experts_per_layer_step"] for p in runs],
            [p["accept_length"] for p in runs],
            marker=markers[i % len(markers)],
            s=70,
            zorder=3,
            label=f"{policy} runs",
        )
        for p in runs:
            ax.annotate(
                f"{policy} b{p['budget']}",
                (p["experts_per_layer_step"], p["accept_length"]),
                textcoords="offset points",
                xytext=(5, 4 + 8 * i),  # stacked: policies often share a point (greedy)
                fontsize=7,
            )
    greedy = pareto["greedy"]
    ax.scatter(
        [greedy["experts_per_layer_step"]], [1.0], marker="x", color="black", label="no speculation"
    )
    tb, cfg = report["testbed"], report["config"]
    ax.set_xlabel(f"unique experts per layer per verify step (testbed, E={tb['num_experts']})")
    ax.set_ylabel("acceptance length (tokens per request per step)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"{', '.join(cfg['datasets'])}: batch {cfg['batch_size']}, topk {cfg['topk']}, "
        f"{cfg['steps']} steps, {cfg['predictor']} predictor (measured on the testbed)",
        fontsize=10,
    )
    fig.savefig(path, dpi=120)
