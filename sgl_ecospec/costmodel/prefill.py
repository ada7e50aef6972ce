"""A request's prompt prefill, measured: seconds = base + per_token x prompt tokens.

The MoESD model (:mod:`sgl_ecospec.costmodel.performance`) is fitted on decode and verify
forwards of up to B x gamma tokens of the calibration grid (64 on the CPU grid). A prompt's
prefill is a forward of 100-1000 tokens: the model's compute term G, exponential up to its
knee and then linear with the slope fitted on the grid, prices it by extrapolation, and on
the bandwidth testbed it priced a 105-token prefill at 2.24 s where the forward took about
1.5 s (docs/results/log.md, "Concurrency 1-8 at the new defaults"). The serving benchmark's
TPOT prediction holds the prefills that run between decode steps
(:mod:`sgl_ecospec.lab.serving.predicted`), so ``sgl-ecospec calibrate`` times prefills of a
few prompt lengths too and fits this line.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PrefillLine:
    """One request's prefill time against its prompt tokens: measured points and the fit.

    Attributes:
        tokens: prompt tokens of each timed prefill.
        seconds: the median seconds of each.
        base: fitted seconds at 0 tokens (the weights' read, every expert), >= 0.
        per_token: fitted seconds per prompt token, >= 0.
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    base: float
    per_token: float

    @classmethod
    def fit(cls, tokens: Sequence[int], seconds: Sequence[float]) -> "PrefillLine":
        """Least squares on relative residuals over the points, both terms >= 0: a line
        through the origin where the free fit's base would be negative, a flat line where its
        slope would be.

        Raises:
            ValueError: no point, lengths differ, or a token count < 1 or a time <= 0.
        """
        t = np.asarray(tokens, dtype=np.float64)
        s = np.asarray(seconds, dtype=np.float64)
        if t.size == 0 or t.shape != s.shape:
            raise ValueError(f"need as many prefill times as token counts, got {t.size}, {s.size}")
        if (t < 1).any() or not (s > 0).all() or not np.isfinite(s).all():
            raise ValueError(
                f"prefill points need tokens >= 1 and seconds > 0: {tokens}, {seconds}"
            )
        # Relative residuals: each row (1, t) divided by its measured time, fitted to 1.
        rows = np.stack([np.ones_like(t), t], 1) / s[:, None]
        base = per_token = -1.0
        if np.unique(t).size > 1:
            base, per_token = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)[0]
        if base < 0:  # also a single length: through the origin
            base, per_token = 0.0, _one_term(rows[:, 1])
        elif per_token < 0:
            base, per_token = _one_term(rows[:, 0]), 0.0
        points = tuple(int(v) for v in t), tuple(float(v) for v in s)
        return cls(*points, float(base), float(per_token))

    def predict(self, tokens: float) -> float:
        """Seconds of one request's prefill of ``tokens`` prompt tokens (>= 1)."""
        if not tokens >= 1:
            raise ValueError(f"a prefill has at least 1 token, got {tokens!r}")
        return self.base + self.per_token * float(tokens)

    def residuals(self) -> np.ndarray:
        """float64 ``[P]``: (fitted - measured) / measured per timed prefill."""
        fitted = np.array([self.predict(t) for t in self.tokens])
        return fitted / np.asarray(self.seconds) - 1.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"residuals": [float(r) for r in self.residuals()]}

    @classmethod
    def from_json(cls, data: dict) -> "PrefillLine":
        """The fit of the stored points (the stored base and slope must be what they give).

        Raises:
            ValueError: points that no line fits, or stored terms that are not their fit.
        """
        line = cls.fit(data["tokens"], data["seconds"])
        stored = (float(data["base"]), float(data["per_token"]))
        if not np.allclose(stored, (line.base, line.per_token), rtol=1e-6, atol=1e-12):
            raise ValueError(
                f"prefill base/per_token {stored} are not the fit of its points "
                f"({line.base}, {line.per_token})"
            )
        return line


def _one_term(column: np.ndarray) -> float:
    """Least squares of ``column x c = 1`` for c."""
    return float(column.sum() / (column**2).sum())
