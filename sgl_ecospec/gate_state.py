"""A utility-gate bucket's decision and figures as host numbers (:mod:`sgl_ecospec.gate`):
what the gate logs and exports, and what a restarted server's gate starts from
(:meth:`sgl_ecospec.gate.UtilityGate.seed`)."""

import dataclasses

PLAIN = 0  # the level of plain decoding: no draft steps


@dataclasses.dataclass(frozen=True)
class LevelFigures:
    """One speculative level's measurements in a bucket (NaN until measured).

    Attributes:
        steps: the level (draft steps per decode step).
        time: seconds per step.
        tokens: tokens per request per step (accepted drafts + 1).
        utility: ``tokens * plain_time / time``.
    """

    steps: int
    time: float
    tokens: float
    utility: float


@dataclasses.dataclass
class BucketState:
    """One bucket's measurements and decision (host numbers, for logs and metrics).

    Attributes:
        level: the level the bucket runs outside probes (0: plain decoding).
        plain_time: seconds per plain step, NaN until measured.
        speculative: each speculative level's :class:`LevelFigures`, ascending.
        steps: steps this bucket has run; probes counted in ``probes``.
        switches: decisions that changed ``level``.
        settled: whether the bucket has decided (a fresh one measures every level first).
    """

    level: int
    plain_time: float
    speculative: tuple[LevelFigures, ...]
    steps: int = 0
    probes: int = 0
    switches: int = 0
    settled: bool = True

    @property
    def open(self) -> bool:
        """Whether the bucket speculates outside probes."""
        return self.level != PLAIN

    @property
    def best(self) -> LevelFigures:
        """The speculative level of highest measured utility (the top one while none is)."""
        measured = [f for f in self.speculative if f.utility == f.utility]
        if not measured:
            return self.speculative[-1]
        return max(measured, key=lambda f: f.utility)

    @property
    def utility(self) -> float:
        """The best speculative level's utility: speculation's tokens per second over plain
        decoding's (NaN until measured)."""
        return self.best.utility
