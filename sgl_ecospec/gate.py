"""The utility gate: per batch-size bucket, the speculation level that decodes fastest.

A level is a number of draft steps per decode step: 0 is plain decoding (no draft, no verify
tree), and each other level a speculative step of that many draft steps (the server's
configured tree, or a narrower one such as a single drafted token). A level pays when the
tokens its step yields per request, divided by its time, exceed plain decoding's one token
per (shorter) step. Its utility in a bucket is

    utility = tokens_per_step * plain_step_time / step_time

(Cascade's measure: token gain over verify cost; plain decoding's is 1). :class:`UtilityGate`
keeps, per bucket and level, the exponential moving averages of the measured step time and
tokens per request, runs the level of highest utility, and moves to another only when that
one's utility is higher by more than ``margin`` (hysteresis). The levels not running are
re-probed, each on its own schedule, for ``probe_steps`` steps, ``probe_interval`` steps of the
bucket after a decision, then at twice the distance after each probe that confirms it (up to
``max_probe_interval``), so a change of traffic or acceptance is seen again at a cost that
falls while nothing changes. Probes never cost more than ``probe_budget`` of a bucket's time:
a probe step runs a slower level, and the slower it is the more it loses, so the distance
between probes is at least ``probe_steps`` times a probe step's loss (in steps of the running
level) over the budget, capped at ``max_probe_interval``. The first step after a switch of
level is not measured: it carries the switch (and, re-entering speculation, a draft state
that the plain steps left stale).

A settled bucket moves to a speculative level only right after measuring it, and a probe
measures its level anew (its step time restarts from the probe's samples). Step times grow
with the requests' contexts: the running level's average follows them, while another level's
stays at its last probe, so comparing the two favours the level measured longest ago (on a
CPU server at batch size 16 such stale figures reopened speculation three steps after it
closed, and the bucket went on switching). Where another speculative level's last figures
beat the running one's by more than the margin, its next probe comes ``probe_interval``
steps after its last. Plain decoding needs no such measurement: a bias towards it costs at
most what speculation would have gained, and a speculative level whose own current figures
fall below it (its acceptance drops, its steps slow down) closes at once.

The first bucket starts at the top level (or, when a cost-model prediction of the utility
exists, at plain decoding where ``predicted`` is below 1), measures it and then each other
level for enough steps that ``min_samples`` requests' tokens are counted at the bucket's
smallest batch size, and at least two (:func:`fresh_steps`: 4 steps at batch size 1, 2 from
batch size 2 on, where each step counts several requests), and decides. A later bucket
starts at the level of the nearest bucket measured so far (utility changes slowly with the
batch size) and is corrected by its own probes, the first of each other level after its
fresh steps (a phase of traffic may give a bucket fewer steps than ``probe_interval``);
without a measured neighbour it starts as the first did. A bucket seeded with an earlier
server's state (:meth:`UtilityGate.seed`: a restarted server's memory) starts settled, as if
it had measured that state's figures.

Acceptance is measured only where the draft state is current: while a bucket decodes plainly
the server does not run the draft model, so the speculative steps of its probes draft from a
stale state and would understate it. They refresh the step's time; its tokens per step stay
those measured while the bucket (or, for a bucket that started plain, its neighbour) ran a
speculative level.

Pure Python and host-side: the caller feeds it measured step times and accepted-token counts
(which a server has on the host anyway) and asks it which level the next step runs.

Buckets: batch sizes 1, 2, 3-4, 5-8, ... (powers of two), as the cost model's eps table.
"""

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from sgl_ecospec.gate_state import PLAIN, BucketState, LevelFigures


def bucket_of(batch_size: int) -> int:
    """The bucket of a batch size: the smallest power of two >= ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


def bucket_label(bucket: int) -> str:
    """``"1"``, ``"2"``, ``"3-4"``, ``"5-8"``, ...: the batch sizes of a bucket."""
    low = bucket // 2 + 1
    return str(bucket) if low >= bucket else f"{low}-{bucket}"


def check_levels(levels: Sequence[int]) -> tuple[int, ...]:
    """``levels`` as the gate holds them: ascending draft-step counts, plain decoding (0)
    first, and at least one speculative level; ValueError otherwise."""
    checked = tuple(levels)
    if (
        len(checked) < 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in checked)
        or checked[0] != PLAIN
        or any(b <= a for a, b in zip(checked, checked[1:], strict=False))
    ):
        raise ValueError(
            "gate levels must be ascending draft-step counts that start with 0 (plain "
            f"decoding) and hold a speculative one, got {list(levels)}"
        )
    return checked


@dataclasses.dataclass(frozen=True)
class GateOptions:
    """How the gate measures and decides (validated here, the one place).

    Attributes:
        probe_interval: steps of a bucket from a decision to the first probe of a level not
            running (>= 1); doubled after each probe that confirms the decision.
        max_probe_interval: the longest distance between two probes (>= probe_interval).
        probe_steps: steps per probe (>= 2: the first step after a switch is not measured).
        min_samples: requests' tokens measured of each level before a fresh bucket's first
            decision (:func:`fresh_steps` turns them into steps).
        margin: hysteresis in [0, 0.5): another level runs once its utility exceeds the
            running one's by more than this (with two levels: close below 1 - margin, open
            above 1 + margin).
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


def fresh_steps(min_samples: int, bucket: int) -> int:
    """Steps of each level a fresh bucket measures before its first decision: enough that
    ``min_samples`` requests are counted at the bucket's smallest batch size (a step of a
    batch of b measures b requests' accepted tokens), and at least two (or ``min_samples``,
    if smaller), so that one step's outlier is not a decision. A batch of 16 thus decides
    after two speculative steps, not four, in a server's first seconds."""
    smallest = bucket // 2 + 1
    return max(min(2, min_samples), math.ceil(min_samples / smallest))


class _Average:
    """Exponential moving average seeded with the median of the first ``seed`` samples, so
    that one outlier among them (a first call's lazy initialisation) does not linger."""

    def __init__(self, smoothing: float, seed: int):
        self.smoothing, self.seed = smoothing, seed
        self.value, self.count = math.nan, 0
        self._first: list[float] = []
        self._renew = False

    def renew(self) -> None:
        """The next sample starts the average anew (seeded again); until then it keeps its
        value. A probe's samples thus say what the level costs now, not a blend with what it
        cost at its last probe, at the requests' shorter contexts."""
        self._renew = True

    def add(self, sample: float) -> None:
        if self._renew:
            self.count, self._first, self._renew = 0, [], False
        self.count += 1
        if self.count <= self.seed:
            self._first.append(sample)
            self.value = statistics.median(self._first)
        else:
            self.value += self.smoothing * (sample - self.value)

    def adopt(self, other: "_Average") -> None:
        """Starts from ``other``'s current value (a neighbouring bucket's), as if seeded."""
        if other.count:
            self.start_at(other.value)

    def start_at(self, value: float) -> None:
        """Starts from ``value`` as if seeded with it (NaN: stays unmeasured)."""
        if value == value:
            self.value, self.count = value, self.seed


class _Bucket:
    def __init__(
        self, options: GateOptions, levels: tuple[int, ...], level: int, inherited: bool, key: int
    ):
        self.options = options
        self.levels = levels
        self.level = level
        self.needed = fresh_steps(options.min_samples, key)
        self.time = {v: _Average(options.smoothing, options.min_samples) for v in levels}
        self.tokens = {v: _Average(options.smoothing, options.min_samples) for v in levels[1:]}
        self.steps = self.probes = self.switches = 0
        # A fresh bucket measures every level before deciding; an inherited one has a state.
        self.settled = inherited
        self.probe_level = level
        self.probe_left = 0  # steps of the running probe still to go
        # Switched, and no step of the new level recorded yet (UtilityGate.record).
        self.awaiting = False
        self.restart_probes()

    def restart_probes(self) -> None:
        """At the start and after a decision: every other level probed ``probe_interval``
        steps from now (per level: the distance to its next probe, the steps since its last)."""
        self.interval = dict.fromkeys(self.levels, self.options.probe_interval)
        self.since_probe = dict.fromkeys(self.levels, 0)

    def probe_soon(self) -> None:
        """Every other level's first probe after ``needed`` steps, not ``probe_interval``: a
        bucket that inherited a neighbour's level decides on its own step times only once it
        probes, and a phase of traffic may give it fewer than ``probe_interval`` steps (log,
        "Run T": 31-124 a phase at batch sizes 4-16, none probed)."""
        for level in self.levels:
            self.since_probe[level] = max(self.options.probe_interval - self.needed, 0)

    def utility(self, level: int) -> float:
        """``level``'s measured utility (plain decoding's is 1), NaN until measured."""
        if level == PLAIN:
            return 1.0
        counts = (self.time[level].count, self.time[PLAIN].count, self.tokens[level].count)
        if min(counts) == 0:
            return math.nan
        return self.tokens[level].value * self.time[PLAIN].value / self.time[level].value

    def measured(self) -> bool:
        return any(self.utility(v) == self.utility(v) for v in self.levels[1:])

    def probe_loss(self, level: int) -> float:
        """What a probe step of ``level`` loses, in steps of the running level: it takes
        ``level``'s time for tokens the running level makes in ``u_probe / u_running`` of
        that time (0 while either utility is unmeasured)."""
        probe, running = self.utility(level), self.utility(self.level)
        if not (probe > 0 and running > 0):
            return 0.0
        ratio = self.time[level].value / self.time[self.level].value
        return max(1.0 - probe / running, 0.0) * ratio

    def budget_interval(self, level: int) -> int:
        """The fewest steps between probes of ``level`` that keeps their loss within its
        share of ``probe_budget`` (shared equally by the levels not running; 0 while
        unmeasured)."""
        budget = self.options.probe_budget / (len(self.levels) - 1)
        steps = self.options.probe_steps * self.probe_loss(level) / budget
        return min(math.ceil(round(steps, 6)), self.options.max_probe_interval)

    def promising(self, level: int) -> bool:
        """Whether speculative ``level``'s last measurement beats the running level's current
        one by more than the margin: the bucket does not move on it (the running level's
        average follows the requests' growing contexts, the other's stays where it was
        measured), but probes it again ``probe_interval`` steps after its last probe."""
        return self.utility(level) - self.utility(self.level) > self.options.margin

    def due_probe(self) -> int | None:
        """The level not running whose probe is due (the widest first), or None."""
        for level in reversed(self.levels):
            if level == self.level:
                continue
            if self.promising(level):
                distance = self.options.probe_interval
            else:
                distance = max(self.interval[level], self.budget_interval(level))
            if self.since_probe[level] >= distance:
                return level
        return None

    def next_level(self) -> int:
        if self.probe_left == 0:
            if not self.settled:
                needed = self.needed
                if self.time[self.level].count >= needed:
                    # Speculative levels first, widest first, plain decoding last: a
                    # speculative step after plain ones drafts from a stale state.
                    short = sorted(
                        (v for v in self.levels if self.time[v].count < needed),
                        key=lambda v: (v == PLAIN, -v),
                    )
                    if short:
                        self.probe_level = short[0]
                        # +1: the first step after the switch is not measured.
                        self.probe_left = needed - self.time[short[0]].count + 1
            else:
                target = self.due_probe()
                if target is not None:
                    self.time[target].renew()
                    self.probe_level = target
                    self.probe_left = self.options.probe_steps
                    self.interval[target] = min(
                        2 * self.interval[target], self.options.max_probe_interval
                    )
            if self.probe_left:
                self.probes += 1
                self.since_probe[self.probe_level] = 0
        if self.probe_left:
            self.probe_left -= 1
            return self.probe_level
        for level in self.levels:
            self.since_probe[level] += 1
        return self.level


class UtilityGate:
    """Per batch-size bucket: the speculation level that decodes fastest (module doc).

    Args:
        options: :class:`GateOptions`.
        levels: the levels the server can run, checked by :func:`check_levels`; default
            plain decoding and one speculative level.
        predicted: optional ``batch_size -> utility`` from the cost model (of the top level);
            a bucket's start state before anything is measured (the top level when >= 1,
            plain decoding otherwise). None: every bucket starts at the top level.
        on_change: called with ``(bucket, BucketState)`` at a bucket's first decision and
            whenever a decision changes its level (logging, metrics).

    Usage per step: ``level = gate.level(batch_size)`` before the step, then
    ``gate.record(batch_size, level, seconds, tokens_per_request)`` once it is measured.
    """

    def __init__(
        self,
        options: GateOptions | None = None,
        *,
        levels: Sequence[int] = (PLAIN, 1),
        predicted: Callable[[int], float] | None = None,
        on_change: Callable[[int, BucketState], None] | None = None,
    ):
        self.options = options or GateOptions()
        self.levels = check_levels(levels)
        self.predicted = predicted
        self.on_change = on_change
        self._buckets: dict[int, _Bucket] = {}
        self._last_level: int | None = None  # of the last recorded step, any bucket

    def _nearest_measured(self, key: int) -> _Bucket | None:
        """The measured bucket a new bucket ``key`` starts from (module doc), or None."""
        measured = [k for k, b in self._buckets.items() if b.measured()]
        if not measured:
            return None
        return self._buckets[min(measured, key=lambda k: (abs(math.log2(k / key)), k))]

    def _bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        if key not in self._buckets:
            nearest = self._nearest_measured(key)
            if nearest is not None:
                bucket = _Bucket(self.options, self.levels, nearest.level, True, key)
                for level, tokens in bucket.tokens.items():
                    tokens.adopt(nearest.tokens[level])
                bucket.probe_soon()
            else:
                top = self.levels[-1]
                if self.predicted is not None and not self.predicted(key) >= 1.0:
                    top = PLAIN
                bucket = _Bucket(self.options, self.levels, top, False, key)
            self._buckets[key] = bucket
        return self._buckets[key]

    def level(self, batch_size: int) -> int:
        """The level the next step of a batch of this size runs."""
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        return bucket.next_level()

    def running_level(self, batch_size: int) -> int:
        """The level the bucket of this batch size runs outside probes."""
        return self._bucket(batch_size).level

    def is_open(self, batch_size: int) -> bool:
        """Whether the bucket of this batch size speculates outside probes."""
        return self.running_level(batch_size) != PLAIN

    def speculates_at(self, batch_size: int) -> bool:
        """Whether steps of a batch of this size need a current draft state: its bucket
        speculates outside probes or is still measuring (a fresh bucket measures its
        speculative levels' acceptance). A bucket not seen yet is judged by the state it would
        start from, without creating it: a prefill asks this of the batch it is about to join,
        which may never decode at that size."""
        bucket = self._buckets.get(bucket_of(batch_size))
        if bucket is None:
            bucket = self._nearest_measured(bucket_of(batch_size))
            if bucket is None:
                return True
        return not bucket.settled or bucket.level != PLAIN

    def has_own_figures(self, bucket: int) -> bool:
        """Whether ``bucket`` (a key of :meth:`buckets`) has decided on figures it measured or
        was seeded with, not only on the state it inherited from a neighbour: what a memory of
        the gate may keep."""
        b = self._buckets[bucket]
        return b.settled and b.measured()

    def record(self, batch_size: int, level: int, seconds: float, tokens: float | None) -> None:
        """A measured step: its wall time and its tokens per request (speculative: accepted
        drafts + 1, averaged over the batch; plain: 1; None: the step's time only, for a
        speculative probe of a plainly decoding bucket, whose draft state the plain steps
        left stale). The first step after a switch of level is dropped (module doc). Then
        re-decides the bucket, unless it switched and no step of its new level has been
        recorded since: the steps recorded in between were chosen before the switch (SGLang's
        overlap scheduler hands a step's results over after launching the next step), and
        deciding on them reopened a level the moment it closed (log, "Run U": ten switches at
        batch size 2)."""
        if level not in self.levels:
            raise ValueError(f"level must be one of the gate's {list(self.levels)}, got {level!r}")
        if not (math.isfinite(seconds) and seconds > 0):
            return
        switched = self._last_level is not None and self._last_level != level
        self._last_level = level
        bucket = self._bucket(batch_size)
        if level == bucket.level:
            bucket.awaiting = False
        if switched:
            return
        bucket.time[level].add(seconds)
        if level != PLAIN and tokens is not None:
            bucket.tokens[level].add(tokens)
        if not bucket.awaiting:
            self._decide(bucket_of(batch_size), bucket, level)

    def _decide(self, key: int, bucket: _Bucket, measured: int) -> None:
        """Re-decides ``bucket`` after a step of level ``measured``. A settled bucket moves to
        a speculative level only when it has just measured it (a probe's step): another
        level's figures are as old as its last probe, and :meth:`_Bucket.promising` brings
        that probe forward. Plain decoding is always a candidate (module doc). A bucket's
        first decision is reported even when it keeps the level it started at."""
        settling = not bucket.settled
        if settling:
            if min(t.count for t in bucket.time.values()) < bucket.needed:
                return
            bucket.settled = True
        running = bucket.utility(bucket.level)
        if running != running:  # the running level's tokens unmeasured: nothing to compare
            return
        candidates = [
            v
            for v in bucket.levels
            if bucket.utility(v) == bucket.utility(v)
            and (settling or v in (measured, bucket.level, PLAIN))
        ]
        best = max(candidates, key=bucket.utility)
        switch = bucket.utility(best) - running > self.options.margin
        if switch:
            bucket.level = best
            bucket.switches += 1
            bucket.awaiting = True
            bucket.restart_probes()
        if (switch or settling) and self.on_change is not None:
            self.on_change(key, self.state(key))

    def state(self, bucket: int) -> BucketState:
        """The state of a bucket (a key of :meth:`buckets`)."""
        b = self._buckets[bucket]
        speculative = tuple(
            LevelFigures(v, b.time[v].value, b.tokens[v].value, b.utility(v)) for v in b.levels[1:]
        )
        return BucketState(
            level=b.level,
            plain_time=b.time[PLAIN].value,
            speculative=speculative,
            steps=b.steps,
            probes=b.probes,
            switches=b.switches,
            settled=b.settled,
        )

    def seed(self, bucket: int, state: BucketState) -> None:
        """Starts ``bucket`` (a key of :meth:`buckets`, not seen yet) settled at ``state``'s
        level and figures, as if it had measured them (a restarted server's memory of an
        earlier one's decisions): its probes come ``probe_interval`` steps after its first.

        Raises:
            ValueError: ``bucket`` is no bucket key, was seen already, or ``state``'s levels
                are not this gate's.
        """
        if bucket < 1 or bucket != bucket_of(bucket) or bucket in self._buckets:
            raise ValueError(f"cannot seed bucket {bucket}: no bucket key, or seen already")
        steps = tuple(f.steps for f in state.speculative)
        if state.level not in self.levels or steps != self.levels[1:]:
            raise ValueError(
                f"a state of levels {[PLAIN, *steps]} at level {state.level} cannot seed a gate "
                f"of levels {list(self.levels)}"
            )
        b = _Bucket(self.options, self.levels, state.level, True, bucket)
        b.time[PLAIN].start_at(state.plain_time)
        for figures in state.speculative:
            b.time[figures.steps].start_at(figures.time)
            b.tokens[figures.steps].start_at(figures.tokens)
        self._buckets[bucket] = b

    def buckets(self) -> list[int]:
        """The buckets seen so far, ascending."""
        return sorted(self._buckets)
