"""The utility gate: per batch-size bucket, speculate only where it beats plain decoding.

Speculation pays when the tokens a speculative step yields per request, divided by its time,
exceed plain decoding's one token per (shorter) step. Its utility in a bucket is

    utility = tokens_per_spec_step * plain_step_time / spec_step_time

(Cascade's measure: token gain over verify cost). :class:`UtilityGate` keeps, per bucket, the
exponential moving averages of the three measured quantities and closes the bucket (plain
decoding: no draft, no verify tree) while the utility is below ``1 - margin``, opens it again
above ``1 + margin``. The mode that is not running is re-probed for ``probe_steps`` steps,
``probe_interval`` steps of the bucket after a decision, then at twice the distance after
each probe that confirms it (up to ``max_probe_interval``), so a change of traffic or
acceptance is seen again at a cost that falls while nothing changes. Probes never cost more
than ``probe_budget`` of a bucket's time: a probe step runs the losing mode, and the further
the measured utility is from 1 the more it loses, so the distance between probes is at
least ``probe_steps`` times a probe step's loss (in steps of the running mode) over the
budget, capped at ``max_probe_interval``. The first step after a
switch of mode is not measured: it carries the switch (and, re-entering speculation, a draft
state that the plain steps left stale).

The first bucket starts speculating (or in the state ``predicted`` gives it, when a
cost-model prediction of the utility exists), measures ``min_samples`` steps of its mode and
then of the other, and decides. A later bucket starts in the state of the nearest bucket
measured so far (utility changes slowly with the batch size) and is corrected by its own
probes; without a measured neighbour it starts as the first did.

Acceptance is measured only where the draft state is current: while a bucket decodes plainly
the server does not run the draft model, so the speculative steps of its probes draft from a
stale state and would understate it. They refresh the speculative step's time; the tokens
per step stay those measured while the bucket (or, for a bucket that started closed, its
neighbour) speculated.

Pure Python and host-side: the caller feeds it measured step times and accepted-token counts
(which a server has on the host anyway) and asks it which mode the next step runs.

Buckets: batch sizes 1, 2, 3-4, 5-8, ... (powers of two), as the cost model's eps table.
"""

import dataclasses
import math
import statistics
from collections.abc import Callable

SPECULATE, PLAIN = "speculate", "plain"


def bucket_of(batch_size: int) -> int:
    """The bucket of a batch size: the smallest power of two >= ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


def bucket_label(bucket: int) -> str:
    """``"1"``, ``"2"``, ``"3-4"``, ``"5-8"``, ...: the batch sizes of a bucket."""
    low = bucket // 2 + 1
    return str(bucket) if low >= bucket else f"{low}-{bucket}"


@dataclasses.dataclass(frozen=True)
class GateOptions:
    """How the gate measures and decides (validated here, the one place).

    Attributes:
        probe_interval: steps of a bucket from a decision to the first probe of the mode not
            running (>= 1); doubled after each probe that confirms the decision.
        max_probe_interval: the longest distance between two probes (>= probe_interval).
        probe_steps: steps per probe (>= 2: the first step after a switch is not measured).
        min_samples: measured steps of each mode before a fresh bucket's first decision.
        margin: hysteresis in [0, 0.5): close below 1 - margin, open above 1 + margin.
        probe_budget: the largest share of a settled bucket's time its probes may lose, in
            (0, 1] (module doc); 1 leaves the distances to ``probe_interval``'s doubling.
        smoothing: weight of a new sample in the moving averages, in (0, 1]; the averages
            start from the median of their first ``min_samples`` samples.
    """

    probe_interval: int = 128
    max_probe_interval: int = 2048
    probe_steps: int = 3
    min_samples: int = 4
    margin: float = 0.02
    probe_budget: float = 0.01
    smoothing: float = 0.2

    def __post_init__(self):
        lows = (
            ("probe_interval", 1),
            ("max_probe_interval", self.probe_interval),
            ("probe_steps", 2),
            ("min_samples", 1),
        )
        for name, low in lows:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"gate {name} must be an int >= {low}, got {value!r}")
        if not 0 <= self.margin < 0.5:
            raise ValueError(f"gate margin must lie in [0, 0.5), got {self.margin}")
        if not 0 < self.probe_budget <= 1:
            raise ValueError(f"gate probe_budget must lie in (0, 1], got {self.probe_budget}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"gate smoothing must lie in (0, 1], got {self.smoothing}")


class _Average:
    """Exponential moving average seeded with the median of the first ``seed`` samples, so
    that one outlier among them (a first call's lazy initialisation) does not linger."""

    def __init__(self, smoothing: float, seed: int):
        self.smoothing, self.seed = smoothing, seed
        self.value, self.count = math.nan, 0
        self._first: list[float] = []

    def add(self, sample: float) -> None:
        self.count += 1
        if self.count <= self.seed:
            self._first.append(sample)
            self.value = statistics.median(self._first)
        else:
            self.value += self.smoothing * (sample - self.value)

    def adopt(self, other: "_Average") -> None:
        """Starts from ``other``'s current value (a neighbouring bucket's), as if seeded."""
        if other.count:
            self.value, self.count = other.value, self.seed


@dataclasses.dataclass
class BucketState:
    """One bucket's measurements and decision (host numbers, for logs and metrics).

    Attributes:
        open: the bucket speculates outside probes.
        utility: the measured utility, NaN until both modes are measured.
        spec_time, plain_time: seconds per step, NaN until measured.
        spec_tokens: tokens per request per speculative step (accepted drafts + 1).
        steps: steps this bucket has run; probes counted in ``probes``.
        switches: decisions that changed ``open``.
    """

    open: bool
    utility: float = math.nan
    spec_time: float = math.nan
    plain_time: float = math.nan
    spec_tokens: float = math.nan
    steps: int = 0
    probes: int = 0
    switches: int = 0


class _Bucket:
    def __init__(self, options: GateOptions, open_: bool, inherited: bool):
        self.options = options
        self.open = open_
        self.spec_time = _Average(options.smoothing, options.min_samples)
        self.plain_time = _Average(options.smoothing, options.min_samples)
        self.spec_tokens = _Average(options.smoothing, options.min_samples)
        self.steps = self.probes = self.switches = 0
        # A fresh bucket measures both modes before deciding; an inherited one has a state.
        self.settled = inherited
        self.interval = options.probe_interval
        self.since_probe = 0
        self.probe_mode = SPECULATE
        self.probe_left = 0  # steps of the running probe still to go

    def measured(self) -> bool:
        counts = (self.spec_time.count, self.plain_time.count, self.spec_tokens.count)
        return min(counts) > 0

    def utility(self) -> float:
        if not self.measured():
            return math.nan
        return self.spec_tokens.value * self.plain_time.value / self.spec_time.value

    def budget_interval(self) -> int:
        """The fewest steps between probes that keeps their loss within ``probe_budget``
        (0 while the utility is unmeasured). A probe step of a closed bucket takes
        ``spec_time`` for tokens plain decoding makes in ``utility`` of that time; one of an
        open bucket makes one token in ``plain_time`` that speculation makes in
        ``1 / utility`` of it; each loss is counted in steps of the running mode."""
        utility = self.utility()
        if not (utility > 0):
            return 0
        if self.open:
            loss = max(1.0 - 1.0 / utility, 0.0) * self.plain_time.value / self.spec_time.value
        else:
            loss = max(1.0 - utility, 0.0) * self.spec_time.value / self.plain_time.value
        steps = self.options.probe_steps * loss / self.options.probe_budget
        return min(math.ceil(round(steps, 6)), self.options.max_probe_interval)

    def next_mode(self) -> str:
        usual = SPECULATE if self.open else PLAIN
        if self.probe_left == 0:
            if not self.settled:
                needed = self.options.min_samples
                usual_count = (self.spec_time if self.open else self.plain_time).count
                other_count = (self.plain_time if self.open else self.spec_time).count
                if usual_count >= needed:
                    # +1: the first step after the switch is not measured.
                    self.probe_left = max(needed - other_count, 0) + 1
            elif self.since_probe >= max(self.interval, self.budget_interval()):
                self.probe_left = self.options.probe_steps
                self.interval = min(2 * self.interval, self.options.max_probe_interval)
            if self.probe_left:
                self.probe_mode = PLAIN if self.open else SPECULATE
                self.probes += 1
                self.since_probe = 0
        if self.probe_left:
            self.probe_left -= 1
            return self.probe_mode
        self.since_probe += 1
        return usual


class UtilityGate:
    """Per batch-size bucket: speculate or decode plainly (module doc).

    Args:
        options: :class:`GateOptions`.
        predicted: optional ``batch_size -> utility`` from the cost model; a bucket's start
            state before anything is measured (open when >= 1). None: every bucket starts
            open.
        on_change: called with ``(bucket, BucketState)`` whenever a decision flips a bucket
            (logging, metrics).

    Usage per step: ``mode = gate.mode(batch_size)`` before the step, then
    ``gate.record(batch_size, mode, seconds, tokens_per_request)`` once it is measured.
    """

    def __init__(
        self,
        options: GateOptions | None = None,
        *,
        predicted: Callable[[int], float] | None = None,
        on_change: Callable[[int, BucketState], None] | None = None,
    ):
        self.options = options or GateOptions()
        self.predicted = predicted
        self.on_change = on_change
        self._buckets: dict[int, _Bucket] = {}
        self._last_mode: str | None = None  # of the last recorded step, any bucket

    def _bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        if key not in self._buckets:
            measured = [k for k, b in self._buckets.items() if b.measured()]
            if measured:
                nearest = self._buckets[min(measured, key=lambda k: (abs(math.log2(k / key)), k))]
                bucket = self._buckets[key] = _Bucket(self.options, nearest.open, True)
                bucket.spec_tokens.adopt(nearest.spec_tokens)
            else:
                start_open = True if self.predicted is None else self.predicted(key) >= 1.0
                self._buckets[key] = _Bucket(self.options, start_open, False)
        return self._buckets[key]

    def mode(self, batch_size: int) -> str:
        """:data:`SPECULATE` or :data:`PLAIN` for the next step of a batch of this size."""
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        return bucket.next_mode()

    def is_open(self, batch_size: int) -> bool:
        """Whether the bucket of this batch size speculates outside probes."""
        return self._bucket(batch_size).open

    def closed_everywhere(self) -> bool:
        """Whether every bucket seen so far has decided to decode plainly (False before the
        first decision): then nothing needs a current draft state outside probes."""
        buckets = self._buckets.values()
        return bool(buckets) and all(b.settled and not b.open for b in buckets)

    def record(self, batch_size: int, mode: str, seconds: float, tokens: float | None) -> None:
        """A measured step: its wall time and its tokens per request (speculative: accepted
        drafts + 1, averaged over the batch; plain: 1; None: the step's time only, for a
        speculative probe of a closed bucket, whose draft state the plain steps left stale).
        The first step after a switch of mode is dropped (module doc). Then re-decides the
        bucket."""
        if mode not in (SPECULATE, PLAIN):
            raise ValueError(f"mode must be {SPECULATE!r} or {PLAIN!r}, got {mode!r}")
        if not (math.isfinite(seconds) and seconds > 0):
            return
        switched = self._last_mode is not None and self._last_mode != mode
        self._last_mode = mode
        if switched:
            return
        bucket = self._bucket(batch_size)
        if mode == SPECULATE:
            bucket.spec_time.add(seconds)
            if tokens is not None:
                bucket.spec_tokens.add(tokens)
        else:
            bucket.plain_time.add(seconds)
        self._decide(bucket_of(batch_size), bucket)

    def _decide(self, key: int, bucket: _Bucket) -> None:
        if not bucket.settled:
            needed = self.options.min_samples
            if min(bucket.spec_time.count, bucket.plain_time.count) < needed:
                return
            bucket.settled = True
        elif not bucket.measured():
            return
        utility = bucket.utility()
        margin = self.options.margin
        if bucket.open and utility < 1 - margin:
            bucket.open = False
        elif not bucket.open and utility > 1 + margin:
            bucket.open = True
        else:
            return
        bucket.switches += 1
        bucket.since_probe = 0
        bucket.interval = self.options.probe_interval
        if self.on_change is not None:
            self.on_change(key, self.state(key))

    def state(self, bucket: int) -> BucketState:
        """The state of a bucket (a key of :meth:`buckets`)."""
        b = self._buckets[bucket]
        return BucketState(
            open=b.open,
            utility=b.utility(),
            spec_time=b.spec_time.value,
            plain_time=b.plain_time.value,
            spec_tokens=b.spec_tokens.value,
            steps=b.steps,
            probes=b.probes,
            switches=b.switches,
        )

    def buckets(self) -> list[int]:
        """The buckets seen so far, ascending."""
        return sorted(self._buckets)
