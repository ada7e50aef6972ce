"""Where a run lies against "simply verifying fewer tokens", scored on its own steps.

``bench --paired``: every step of an ``ecospec`` or ``adaptive`` run at budget b also scores
confidence selection at every budget b, b - 1, ..., 1 on the same tree and predictions
(``OfflineEngine.generate_speculative(compare=...)``: one extra target pass over the whole
tree per step gives every set's accepted tokens and true expert union; confidence at k is a
prefix of its choice at k + 1). Confidence's points (acceptance length, unique experts per
layer per step) trace what verifying fewer tokens trades. Two distances are reported, in
experts per layer per step (on or below, <= 0: the run does not lose):

- ``line``: above the line through confidence's points at b - 1 and b (issue 16's bar);
- ``curve``: above confidence's curve at the run's own acceptance, i.e. the segment between
  the two budgets whose acceptance brackets the run's (the end segment beyond them): the
  fair reading for a run that verifies fewer tokens, which the line's extension far below
  b - 1 overstates (the curve bends).

Unpaired, the points come from separate decodes whose steps drift apart, and on 198 steps a
few flipped choices (one accepted token is 0.15 experts against the line) move a point by
more than the policies differ (docs/RESULTS.md); paired, every step contributes its own
difference and each distance has a standard error.

Shape legend: S = paired steps, C = compared sets.
"""

import numpy as np

from sgl_ecospec.ops.bitmaps import bitmap_popcount

__all__ = ["AGAINST", "note", "paired_line"]

AGAINST = "confidence"


def paired_line(steps, budget: int) -> dict | None:
    """The run's distances above confidence's line and curve, from steps paired with
    confidence at ``budget``, ``budget - 1``, ..., 1 (in that order after the run's set).

    With per-step acceptance a_j = batch + accepted_j and unique experts e_j (per layer,
    averaged over layers) of set j, each set's acceptance length A_j = sum a_j / sum batch
    and experts E_j = mean e_j. Against the segment through confidence's points at budgets
    lo < hi, slope m = (E_hi - E_lo) / (A_hi - A_lo) experts per unit of acceptance length,
    the run (0) is E_0 - E_lo - m (A_0 - A_lo) experts above it: the mean over steps of
    g = (e_0 - e_k) - m (a_0 - a_k) S / sum batch for either k of lo, hi (the one whose
    acceptance is nearer the run's, whose g varies least), with its standard error (m held
    fixed).

    Args:
        steps: the run's ``StepStats``, each with ``paired_bitmaps`` int64 ``[1 + b, L, W]``
            and ``paired_accepted`` (1 + b ints) as the engine records them.
        budget: b >= 2, the run's budget.

    Returns:
        ``{"against", "steps", "accept_length", "experts_per_layer_step", "line", "curve"}``
        (the points keyed by "run" and "confidence_b<k>"; each distance ``{"budgets": [lo,
        hi], "slope", "experts_above", "standard_error"}``, the last three None where the two
        budgets tie in acceptance), or None without paired steps.
    """
    paired = [s for s in steps if s.paired_bitmaps is not None]
    if not paired:
        return None
    if any(s.paired_bitmaps.shape[0] != 1 + budget for s in paired):
        raise ValueError(f"paired_line needs each step paired with confidence at 1..{budget}")
    batch = np.asarray([s.batch_size for s in paired], dtype=np.float64)  # [S]
    tokens = batch[:, None] + np.asarray([s.paired_accepted for s in paired], dtype=np.float64)
    experts = np.stack(
        [bitmap_popcount(s.paired_bitmaps).double().mean(-1).numpy() for s in paired]
    )  # [S, C]
    # Column j of the arrays: the run (0), then confidence at budget - j + 1.
    column = {"run": 0, **{k: 1 + budget - k for k in range(1, budget + 1)}}
    length, mean = tokens.sum(0) / batch.sum(), experts.mean(0)

    def distance(lo: int, hi: int) -> dict:
        out = {"budgets": [lo, hi], "slope": None, "experts_above": None, "standard_error": None}
        rise = length[column[hi]] - length[column[lo]]
        if rise == 0:
            return out
        slope = (mean[column[hi]] - mean[column[lo]]) / rise
        # Either point anchors the same mean; the one nearer the run varies least per step.
        near_lo = abs(length[0] - length[column[lo]]) < abs(length[0] - length[column[hi]])
        at = column[lo if near_lo else hi]
        per_step = (experts[:, 0] - experts[:, at]) - slope * (tokens[:, 0] - tokens[:, at]) * len(
            paired
        ) / batch.sum()
        spread = per_step.std(ddof=1) if len(paired) > 1 else float("nan")
        return out | {
            "slope": float(slope),
            "experts_above": float(per_step.mean()),
            "standard_error": float(spread / np.sqrt(len(paired))),
        }

    # The curve's segment: the budgets bracketing the run's acceptance, else the end one.
    above = [k for k in range(2, budget + 1) if length[column[k]] >= length[0]]
    hi = min(above) if above else budget
    names = {"run": "run", **{k: f"confidence_b{k}" for k in range(1, budget + 1)}}
    return {
        "against": AGAINST,
        "steps": len(paired),
        "accept_length": {names[k]: float(length[c]) for k, c in column.items()},
        "experts_per_layer_step": {names[k]: float(mean[c]) for k, c in column.items()},
        "line": distance(budget - 1, budget),
        "curve": distance(hi - 1, hi),
    }


def note(entry: dict) -> str | None:
    """The table's note under a paired run (a bench entry with ``paired_line``), else None."""
    line = entry.get("paired_line")
    if line is None:
        return None
    length, experts = line["accept_length"], line["experts_per_layer_step"]
    points = ", ".join(
        f"{name.replace('confidence_', 'confidence ')} {length[name]:.3f} / {experts[name]:.2f}"
        for name in length
    )
    parts = [f"  paired on its {line['steps']} steps (acceptance / experts): {points}"]
    same = line["curve"]["budgets"] == line["line"]["budgets"]  # then the curve is the line
    for key in ("line",) if same else ("line", "curve"):
        d = line[key]
        label = "confidence's {} (b{}-b{})".format(key, *d["budgets"])
        if d["experts_above"] is None:
            parts.append(f"  {label}: its two points tie in acceptance, no distance")
        else:
            parts.append(
                f"  {d['experts_above']:+.3f} experts above {label} "
                f"(standard error {d['standard_error']:.3f})"
            )
    return "\n".join(parts)
