"""``bench --paired``'s distance to confidence's line (``bench.paired_line``) on constructed
steps: it equals the unpaired reading of the three points, and its standard error is that of
the per-step differences."""

import numpy as np
import pytest
import torch

from sgl_ecospec.lab.bench.paired_line import note, paired_line
from sgl_ecospec.lab.engine.stats import StepStats

L = 3


def _step(batch, accepted, experts):
    """A step whose three sets accept ``accepted`` and load ``experts`` per layer."""
    step = StepStats(batch, batch * 4, [0] * batch, [0] * L)
    step.paired_bitmaps = torch.tensor([[[(1 << e) - 1]] * L for e in experts])
    step.paired_accepted = list(accepted)
    return step


def test_distance_is_the_unpaired_reading_with_the_per_step_spread():
    rng = np.random.default_rng(0)
    steps = [
        _step(int(b), rng.integers(0, 3 * b, 3), rng.integers(8, 30, 3))
        for b in rng.integers(1, 4, 40)
    ]
    line = paired_line(steps, 4)
    batch = np.array([s.batch_size for s in steps], float)
    tokens = batch[:, None] + np.array([s.paired_accepted for s in steps], float)
    experts = np.array(
        [[bin(int(s.paired_bitmaps[j, 0, 0])).count("1") for j in range(3)] for s in steps], float
    )
    length, mean = tokens.sum(0) / batch.sum(), experts.mean(0)
    slope = (mean[1] - mean[2]) / (length[1] - length[2])
    assert line["slope"] == pytest.approx(slope)
    unpaired = mean[0] - (mean[2] + (length[0] - length[2]) * slope)
    assert line["experts_above_line"] == pytest.approx(unpaired)
    per_step = (experts[:, 0] - experts[:, 1]) - slope * (
        tokens[:, 0] - tokens[:, 1]
    ) * 40 / batch.sum()
    assert line["standard_error"] == pytest.approx(per_step.std(ddof=1) / np.sqrt(40))
    assert line["accept_length"]["confidence_b3"] == pytest.approx(length[2])
    assert "experts above confidence's line" in note({"paired_line": line})


def test_no_line_without_paired_steps_or_when_confidence_ties():
    assert paired_line([StepStats(1, 5, [0], [0] * L)], 4) is None
    assert note({}) is None
    tied = paired_line([_step(1, (1, 1, 1), (9, 10, 8))], 4)
    assert tied["experts_above_line"] is None and tied["slope"] is None
    assert "no line" in note({"paired_line": tied})
    with pytest.raises(ValueError, match="exactly two sets"):
        step = _step(1, (1, 1), (9, 10))
        paired_line([step], 4)
