"""Where a run lies against "simply verifying fewer tokens", scored on its own steps.

``bench --paired``: every step of an ``ecospec`` or ``adaptive`` run at budget b also scores
confidence selection at b and at b - 1 on the same tree and predictions
(``OfflineEngine.generate_speculative(compare=...)``: one extra target pass over the whole
tree per step gives every set's accepted tokens and true expert union). The line through
confidence's two points (acceptance length, unique experts per layer per step) is what
verifying fewer tokens trades; a run on or below it (no more experts at its acceptance)
does not lose to it (issue 16's bar). Unpaired, the three points come from three decodes
whose steps drift apart, and on 198 steps a few flipped choices (one or two accepted
tokens) move a point by more than the policies differ (docs/RESULTS.md); paired, every
step contributes its own difference and the distance to the line has a standard error.

Shape legend: S = paired steps, L = MoE layers.
"""

import numpy as np

from sgl_ecospec.ops.bitmaps import bitmap_popcount

__all__ = ["AGAINST", "note", "paired_line"]

AGAINST = "confidence"


def paired_line(steps, budget: int) -> dict | None:
    """The run's distance above confidence's line, from steps paired with confidence at
    ``budget`` and ``budget - 1`` (in that order after the run's own set).

    With per-step acceptance a_j = batch + accepted_j and unique experts e_j (per layer,
    averaged over layers) of set j (0 = the run, 1 = confidence at b, 2 = at b - 1): each
    set's acceptance length A_j = sum a_j / sum batch and experts E_j = mean e_j; the line's
    slope m = (E_1 - E_2) / (A_1 - A_2) in experts per unit of acceptance length; the run is
    above = E_0 - E_1 - m (A_0 - A_1) experts above it (negative: below), the mean over
    steps of g = (e_0 - e_1) - m (a_0 - a_1) S / sum batch, whose standard error (m held
    fixed) is reported.

    Args:
        steps: the run's ``StepStats``, each with ``paired_bitmaps`` int64 ``[3, L, W]`` and
            ``paired_accepted`` (3 ints) as the engine records them.
        budget: b, the run's budget.

    Returns:
        ``{"against", "budgets", "steps", "accept_length", "experts_per_layer_step",
        "slope", "experts_above_line", "standard_error"}`` (the two middle ones keyed by
        "run", "confidence_b<b>", "confidence_b<b-1>"), or None without paired steps; the
        slope and distance are None when confidence's two points have the same acceptance
        (no line).
    """
    paired = [s for s in steps if s.paired_bitmaps is not None]
    if not paired:
        return None
    if any(s.paired_bitmaps.shape[0] != 3 or len(s.paired_accepted) != 3 for s in paired):
        raise ValueError("paired_line needs each step paired with exactly two sets")
    batch = np.asarray([s.batch_size for s in paired], dtype=np.float64)  # [S]
    accepted = np.asarray([s.paired_accepted for s in paired], dtype=np.float64)  # [S, 3]
    tokens = batch[:, None] + accepted
    experts = np.stack(
        [bitmap_popcount(s.paired_bitmaps).double().mean(-1).numpy() for s in paired]
    )  # [S, 3]
    length = tokens.sum(0) / batch.sum()
    mean_experts = experts.mean(0)
    names = ("run", f"confidence_b{budget}", f"confidence_b{budget - 1}")
    out = {
        "against": AGAINST,
        "budgets": [budget, budget - 1],
        "steps": len(paired),
        "accept_length": dict(zip(names, length.tolist(), strict=True)),
        "experts_per_layer_step": dict(zip(names, mean_experts.tolist(), strict=True)),
        "slope": None,
        "experts_above_line": None,
        "standard_error": None,
    }
    rise = length[1] - length[2]
    if rise == 0:
        return out
    slope = (mean_experts[1] - mean_experts[2]) / rise
    per_step = (experts[:, 0] - experts[:, 1]) - slope * (tokens[:, 0] - tokens[:, 1]) * len(
        paired
    ) / batch.sum()
    spread = per_step.std(ddof=1) if len(paired) > 1 else float("nan")
    out.update(
        slope=float(slope),
        experts_above_line=float(per_step.mean()),
        standard_error=float(spread / np.sqrt(len(paired))),
    )
    return out


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
    head = f"  paired on its {line['steps']} steps (acceptance / experts): {points}"
    if line["experts_above_line"] is None:
        return head + "; confidence's two points tie in acceptance: no line"
    return (
        f"{head}; {line['experts_above_line']:+.3f} experts above confidence's line "
        f"(standard error {line['standard_error']:.3f})"
    )
