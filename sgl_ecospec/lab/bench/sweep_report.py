"""The sweep's report: its skeleton, the bars (``checks``), the tables and the plot
(``sgl-ecospec sweep``, docs/bench.md)."""

import math
import textwrap

from sgl_ecospec.costmodel.profiles import MODELS
from sgl_ecospec.lab.bench import metrics
from sgl_ecospec.lab.bench.sweep_plan import ep_hardware

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
        "eps (and adaptive's step_cost, candidate_cost and candidate_decay: a request's k-th "
        "candidate costs candidate_cost x decay^k beyond DeltaCost + eps) from "
        "costmodel.selection_cost of the primary profile "
        "at each batch size; adaptive and evict run once per EP size and select with that EP "
        "group's cost (selection_cost(ep_size=R) on R x the hardware, as the server's eps "
        "table under EP; evict's step seconds on that hardware), and each EP size is priced "
        "with its own run; ecospec selects at EP 1, ecospec-ep at the largest EP size; every "
        "testbed layer weighs moe_layers / L_t times the profile "
        "experts one testbed expert stands for at the roots' union (the slope ratio of the "
        "effective-token scaling, the pricing's own exchange rate there); with "
        "--recall-weighted-cost the expert-aware policies trust predictions by the "
        "slope of true on predicted new experts and price the rest by the new experts "
        "verified candidates really brought (LiveRecall; adaptive: by the untrusted share of "
        "its candidate costs)"
    ),
    "adaptive_gate": (
        "per (batch size, profile, EP size): speculate only where the adaptive run at that "
        "batch size is predicted faster than no speculation (its own utility, as the "
        "server's gate measures it); otherwise adaptive is the greedy run (speedup 1; "
        "rule_speedup: the run's own prediction when it closed the gate)"
    ),
    "evict": (
        "EVICT's rule: per step, confidence's choice cut to the prefix of its order that "
        "maximises (1 + sum of the prefix's draft probabilities) / predicted step seconds, the "
        "seconds of the primary profile at each batch size on each EP size's hardware with "
        "uniform-routing experts (they depend on the number of verified tokens only)"
    ),
    "cascade_gate": (
        "cascade is confidence selection behind adaptive's gate rule: per (batch size, "
        "profile, EP size) it speculates only where confidence, measured at that batch size, "
        "is predicted faster than no speculation (its run is then confidence's own); "
        "otherwise it is the greedy run (speedup 1)"
    ),
}
# The policies adaptive must match (the bar), besides no speculation.
PEERS = ("confidence", "evict", "cascade")
LINE_STATUS = {"yes": "lossless", "tie": "lossless up to near ties", "NO": "NOT LOSSLESS"}
# Batch sizes where EcoSpec is meant to keep its expert reduction (the bar).
SMALL_BATCHES = (1, 2, 4, 8)


def new_report(cfg, testbed: dict) -> dict:
    """The report before any run: configuration (``cfg``, a ``SweepConfig`` naming its
    models), testbed shape, profiles, hardware per EP size and method."""
    return {
        "note": NOTE,
        "config": cfg.to_dict(),
        "testbed": {"target": cfg.target, "draft": cfg.draft, **testbed},
        "profiles": {
            p: {
                f: getattr(MODELS[p], f)
                for f in ("moe_layers", "num_experts", "top_k", "bytes_per_expert")
            }
            for p in cfg.profiles
        },
        "hardware": {str(r): ep_hardware(cfg.hardware, r) for r in cfg.ep_sizes},
        "method": METHOD,
        "greedy": [],
        "runs": [],
        "rows": [],
    }


def checks(rep: dict) -> dict:
    """The issue's bars, evaluated on the report's rows.

    - ``adaptive_not_slower``: adaptive's speedup >= 1 at every (batch, profile, EP).
    - ``adaptive_within_noise_of_confidence``: adaptive's speedup >= confidence's minus
      twice the combined standard error (``ep_cost.predicted_speedup``).
    - ``adaptive_not_below_peers``: adaptive's speedup >= the best of no speculation (1)
      and the peers run (confidence, evict, cascade) minus one combined standard error.
    - ``ecospec_expert_reduction``: at batch sizes 1-8, ecospec's testbed experts per layer
      per step below confidence's.
    - ``ecospec_ep_lowers_busiest_rank``: at the largest EP size, ecospec-ep's busiest-rank
      experts below ecospec's, at every batch size (testbed, and scaled per profile).
    - ``ecospec_expert_reduction_paired`` and ``ecospec_ep_lowers_busiest_rank_paired``
      (``--paired`` runs only): the same two comparisons made on the same trees, each
      passed where the mean paired difference is below zero by more than twice its
      standard error.
    - ``adaptive_above_evict_paired`` (``--paired`` runs with adaptive and evict): at batch
      sizes 1-8, adaptive's verify sets against evict's cut of confidence's on the same
      trees, both priced with the acceptance they get from one pass over the whole tree
      (``ep_cost.paired_speedup``); passed where adaptive's speedup is above evict's by more
      than twice the paired standard error, or, where adaptive's gate closed, where evict
      too is predicted no faster than no speculation.

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
    peers = [p for p in PEERS if p in policies]
    if "adaptive" in policies:
        for b, p, r in keys:
            ours = rows[b, "adaptive", p, r]
            best = max(
                [("none", {"speedup": 1.0, "speedup_stderr": 0.0})]
                + [(q, rows[b, q, p, r]) for q in peers],
                key=lambda item: item[1]["speedup"],
            )
            noise = math.hypot(ours["speedup_stderr"], best[1]["speedup_stderr"])
            margin = ours["speedup"] - best[1]["speedup"]
            detail.append(
                {"batch_size": b, "profile": p, "ep_size": r, "best": best[0]}
                | {"difference": margin, "noise": noise, "passed": margin >= -noise}
            )
    verdict("adaptive_not_below_peers", {"adaptive"}, detail)

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

    detail = []
    if {"adaptive", "evict"} <= policies and cfg.get("paired"):
        for b, p, r in (k for k in keys if k[0] in SMALL_BATCHES):
            ours, evict = rows[b, "adaptive", p, r], rows[b, "evict", p, r]
            entry = {"batch_size": b, "profile": p, "ep_size": r}
            if ours["speculates"]:
                paired = ours["paired_speedup"]
                noise = 2 * paired["stderr"]
                entry |= {"difference": paired["difference"], "noise": noise}
                entry["passed"] = paired["difference"] > noise
            else:
                entry |= {"gate_closed": True, "evict_speedup": evict["speedup"]}
                entry["passed"] = evict["speedup"] <= 1.0
            detail.append(entry)
    verdict("adaptive_above_evict_paired", {"adaptive", "evict"}, detail)
    return result


# --- output -------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def run_label(entry: dict) -> str:
    """A run's policy, with the EP size it selected for where it ran once per EP size
    (``adaptive@EP8``)."""
    ep_size = entry.get("selection_ep_size")
    return entry["policy"] if ep_size is None else f"{entry['policy']}@EP{ep_size}"


def run_line(entry: dict) -> str:
    """The line printed after each run: the testbed metrics, lossless status, seconds."""
    busiest = ", ".join(
        f"EP{r} {v:.2f}" for r, v in entry["busiest_rank_experts"].items() if r != "1"
    )
    return (
        f"batch {entry['batch_size']:3d} {run_label(entry):<12} accept "
        f"{entry['accept_length']:.3f}, verified/request {entry['verified_per_request']:.2f}, "
        f"experts {entry['experts_per_layer_step']:.2f}"
        + (f", busiest {busiest}" if busiest else "")
        + _paired_cells(entry)
        + (f" ({entry['same_run_as']}'s run)" if "same_run_as" in entry else "")
        + f", {LINE_STATUS[metrics.lossless_status(entry)]}"
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
    head = "batch policy       accept verif/req experts " + " ".join(f"busy@EP{r}" for r in ranks)
    lines = ["# measured on the testbed", head + " recall lossless"]
    greedy = {g["batch_size"]: g for g in rep["greedy"]}
    runs = [("none", greedy[b]) for b in cfg["batch_sizes"]]
    runs = sorted(
        runs + [(run_label(e), e) for e in rep["runs"]],
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
            f"{policy:<12}",
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
            "batch policy       against    experts diff      +-  "
            + " ".join(f"busy@EP{r} diff     +-" for r in ranks)
            + "  draft score diff  accepted diff  differ",
        ]
        for e in paired:
            p = e["paired"]
            cells = [f"{e['batch_size']:5d} {run_label(e):<12} {p['against']:<10}"]
            for name in ["experts_per_layer_step"] + [f"busiest_rank_experts_ep{r}" for r in ranks]:
                cells.append(f"{p[name]['difference']:+12.3f} {p[name]['stderr']:6.3f}")
            accepted = p.get("accepted", {}).get("difference")
            cells.append(
                f"{p['draft_score']['difference']:+17.3f} {_fmt(accepted, '+14.3f')} "
                f"{p['steps_differ']:7.2f}"
            )
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
                    + _paired_speedup_cell(row)
                )
    lines += ["", "# bars"]
    for name, check in rep["checks"].items():
        verdict = {True: "met", False: "NOT met", None: "not evaluated"}[check["passed"]]
        lines.append(f"{name}: {verdict}")
        lines += [f"  {_detail(d)}" for d in check["detail"] if not d["passed"]]
    return "\n".join(lines)


def _paired_speedup_cell(row: dict) -> str:
    """``  paired vs <policy>: d +- se`` for a row priced on the same trees (empty else)."""
    paired = row.get("paired_speedup")
    if paired is None:
        return ""
    return f"  paired vs {paired['against']}: {paired['difference']:+.3f} +- {paired['stderr']:.3f}"


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
    width = 4.2 * len(profiles)
    fig = Figure(figsize=(width, 3.4 * len(ep_sizes)), layout="constrained")
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
    title = (
        f"testbed E={rep['testbed']['num_experts']}, K={rep['testbed']['top_k']}: "
        f"{cfg['dataset']}, topk {cfg['topk']}, {cfg['steps']} steps, budget {cfg['budget']}, "
        f"{cfg['max_new_tokens']} new tokens (MoESD model on a roofline prior)"
    )
    # Wrapped to the figure's width: one profile's panel is narrower than the line.
    fig.suptitle(textwrap.fill(title, width=int(11 * width)), fontsize=10)
    fig.savefig(path, dpi=110)
