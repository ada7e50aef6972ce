"""The prefill line: its fit on relative residuals with both terms >= 0, its prediction and its
JSON form, checked against the points it was fitted to."""

import numpy as np
import pytest

from sgl_ecospec.costmodel.prefill import PrefillLine


def test_fit_recovers_an_exact_line():
    tokens = (32, 128, 256)
    line = PrefillLine.fit(tokens, [0.9 + 0.008 * t for t in tokens])
    assert line.base == pytest.approx(0.9) and line.per_token == pytest.approx(0.008)
    assert line.predict(105) == pytest.approx(0.9 + 0.008 * 105)
    assert np.abs(line.residuals()).max() < 1e-9


def test_fit_of_noisy_points_minimises_relative_residuals():
    rng = np.random.default_rng(0)
    tokens = np.array([16, 32, 64, 128, 256, 512])
    seconds = (1.0 + 0.01 * tokens) * (1 + rng.normal(0, 0.02, tokens.size))
    line = PrefillLine.fit(tokens.tolist(), seconds.tolist())
    assert line.base == pytest.approx(1.0, rel=0.1) and line.per_token == pytest.approx(
        0.01, rel=0.1
    )
    best = np.sum(line.residuals() ** 2)
    for base, per_token in [(line.base * 1.01, line.per_token), (line.base, line.per_token * 0.99)]:
        other = (base + per_token * tokens) / seconds - 1
        assert np.sum(other**2) > best


def test_fit_keeps_both_terms_non_negative():
    # Time falling with length: a flat line at the relative-least-squares level.
    flat = PrefillLine.fit([10, 100], [2.0, 1.0])
    assert flat.per_token == 0.0 and 1.0 < flat.base < 2.0
    # A line whose free fit crosses below the origin: through the origin instead.
    steep = PrefillLine.fit([100, 200], [1.0, 3.0])
    assert steep.base == 0.0 and steep.per_token > 0
    # One length (or one repeated): through the origin and that point.
    one = PrefillLine.fit([64], [0.5])
    assert one.base == 0.0 and one.predict(64) == pytest.approx(0.5)
    twice = PrefillLine.fit([64, 64], [0.5, 0.5])
    assert twice.predict(64) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "tokens, seconds, message",
    [
        ([], [], "need as many prefill times"),
        ([8, 16], [0.1], "need as many prefill times"),
        ([0, 16], [0.1, 0.2], "tokens >= 1 and seconds > 0"),
        ([8, 16], [0.1, 0.0], "tokens >= 1 and seconds > 0"),
        ([8, 16], [0.1, float("nan")], "tokens >= 1 and seconds > 0"),
    ],
)
def test_fit_rejects_bad_points(tokens, seconds, message):
    with pytest.raises(ValueError, match=message):
        PrefillLine.fit(tokens, seconds)


def test_predict_needs_a_token():
    line = PrefillLine.fit([8, 16], [0.1, 0.2])
    with pytest.raises(ValueError, match="at least 1 token"):
        line.predict(0)


def test_json_round_trip_checks_the_stored_fit():
    line = PrefillLine.fit([32, 128, 256], [1.2, 1.7, 2.7])
    data = line.to_json()
    assert data["residuals"] == pytest.approx(list(line.residuals()))
    assert PrefillLine.from_json(data) == line
    with pytest.raises(ValueError, match="are not the fit of its points"):
        PrefillLine.from_json({**data, "per_token": line.per_token * 2})
