"""``bench --paired``'s distances to confidence's line and curve (``bench.paired_line``) on
constructed steps: each equals the unpaired reading of the points, and its standard error is
that of the per-step differences."""

import numpy as np
import pytest
import torch

from sgl_ecospec.lab.bench.paired_line import note, paired_line
from sgl_ecospec.lab.engine.stats import StepStats

L = 3


def _step(batch, accepted, experts):
    """A step whose sets (the run, then confidence at b, ..., 1) accept ``accepted`` and load
    ``experts`` per layer."""
    step = StepStats(batch, batch * 4, [0] * batch, [0] * L)
    step.paired_bitmaps = torch.tensor([[[(1 << e) - 1]] * L for e in experts])
    step.paired_accepted = list(accepted)
    return step


def _unpaired(length, mean, run, lo, hi):
    slope = (mean[hi] - mean[lo]) / (length[hi] - length[lo])
    return slope, mean[run] - (mean[lo] + (length[run] - length[lo]) * slope)


def test_distances_are_the_unpaired_readings_with_the_per_step_spread():
    rng = np.random.default_rng(0)
    steps = []
    for b in rng.integers(1, 4, 40):
        # confidence at 3, 2, 1: each a prefix of the next, accepting and loading no more
        conf = np.sort(rng.integers(0, 3 * b, 3))[::-1]
        experts = np.sort(rng.integers(8, 30, 3))[::-1]
        steps.append(
            _step(int(b), [rng.integers(0, 3 * b), *conf], [rng.integers(8, 30), *experts])
        )
    line = paired_line(steps, 3)
    batch = np.array([s.batch_size for s in steps], float)
    tokens = batch[:, None] + np.array([s.paired_accepted for s in steps], float)
    experts = np.array(
        [[bin(int(s.paired_bitmaps[j, 0, 0])).count("1") for j in range(4)] for s in steps],
        float,
    )
    length, mean = tokens.sum(0) / batch.sum(), experts.mean(0)
    # columns: 0 the run, 1 confidence at 3, 2 at 2, 3 at 1
    slope, above = _unpaired(length, mean, 0, 2, 1)
    assert line["line"]["budgets"] == [2, 3]
    assert line["line"]["slope"] == pytest.approx(slope)
    assert line["line"]["experts_above"] == pytest.approx(above)
    k = 2 if abs(length[0] - length[2]) < abs(length[0] - length[1]) else 1  # the nearer
    g = (experts[:, 0] - experts[:, k]) - slope * (tokens[:, 0] - tokens[:, k]) * 40 / batch.sum()
    assert line["line"]["standard_error"] == pytest.approx(g.std(ddof=1) / np.sqrt(40))
    assert line["accept_length"]["confidence_b1"] == pytest.approx(length[3])
    # the curve's segment brackets the run's acceptance (or is the end one)
    lo, hi = line["curve"]["budgets"]
    col = {1: 3, 2: 2, 3: 1}
    assert length[col[hi]] >= length[0] or hi == 3
    assert hi == 2 or length[col[lo]] < length[0]
    assert line["curve"]["experts_above"] == pytest.approx(
        _unpaired(length, mean, 0, col[lo], col[hi])[1]
    )
    assert "experts above confidence's line (b2-b3)" in note({"paired_line": line})


def test_curve_reads_the_segment_below_b_minus_1_for_a_run_that_verifies_less():
    # The run accepts like confidence at 1 with 3 experts fewer; the line (b2-b3) extended
    # to it lies lower than the curve (b1-b2) there.
    steps = [_step(1, (0, 2, 1, 0), (10, 24, 16, 13)), _step(1, (1, 2, 1, 1), (11, 24, 16, 14))]
    line = paired_line(steps, 3)
    assert line["curve"]["budgets"] == [1, 2]
    assert line["curve"]["experts_above"] == pytest.approx(-3.0)
    assert line["line"]["experts_above"] > line["curve"]["experts_above"]
    text = note({"paired_line": line})
    assert "-3.000 experts above confidence's curve (b1-b2)" in text and "line (b2-b3)" in text


def test_no_line_without_paired_steps_or_when_confidence_ties():
    assert paired_line([StepStats(1, 5, [0], [0] * L)], 2) is None
    assert note({}) is None
    tied = paired_line([_step(1, (1, 1, 1), (9, 10, 8))], 2)
    assert tied["line"]["experts_above"] is None and tied["line"]["budgets"] == [1, 2]
    assert "tie in acceptance" in note({"paired_line": tied})
    with pytest.raises(ValueError, match="confidence at 1..3"):
        paired_line([_step(1, (1, 1, 1), (9, 10, 8))], 3)
