"""The utility gate: buckets, the start-up measurements, decisions with hysteresis, re-probing,
the first step after a switch left unmeasured, and the options' validation."""

import math

import pytest

from sgl_ecospec.gate import (
    PLAIN,
    GateOptions,
    UtilityGate,
    bucket_label,
    bucket_of,
    check_levels,
    fresh_steps,
)

SPECULATE = 1  # the speculative level of a two-level gate (its default levels)


def drive(gate, steps, batch_size, spec_time, plain_time, tokens):
    """Runs ``steps`` steps of a simulated server whose speculative steps take ``spec_time``
    and yield ``tokens`` per request and whose plain steps take ``plain_time``; returns the
    levels run."""
    levels = []
    for _ in range(steps):
        level = gate.level(batch_size)
        levels.append(level)
        if level == SPECULATE:
            gate.record(batch_size, level, spec_time, tokens)
        else:
            gate.record(batch_size, level, plain_time, 1.0)
    return levels


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]
    assert [bucket_label(b) for b in (1, 2, 4, 8)] == ["1", "2", "3-4", "5-8"]
    with pytest.raises(ValueError, match="batch_size"):
        bucket_of(0)


def test_closes_where_speculation_loses_and_stays_closed_between_probes():
    options = GateOptions(probe_interval=50, max_probe_interval=50, probe_steps=3, min_samples=4)
    gate = UtilityGate(options)
    # Speculation: 1.5 tokens per step at twice plain decoding's time -> utility 0.75.
    levels = drive(gate, 400, 1, spec_time=0.2, plain_time=0.1, tokens=1.5)
    assert levels[:4] == [SPECULATE] * 4  # measures speculation first (starts open)
    assert levels[4:9] == [PLAIN] * 5  # then plain decoding (+1: the switch step)
    state = gate.state(1)
    assert not state.open and state.switches == 1
    assert state.utility == pytest.approx(0.75)
    # After the decision only probes speculate: probe_steps every probe_interval steps.
    late = levels[100:]
    assert late.count(SPECULATE) <= math.ceil(len(late) / options.probe_interval) * 3
    assert late.count(SPECULATE) >= 3
    assert state.plain_time == pytest.approx(0.1) and state.best.time == pytest.approx(0.2)


def test_a_fresh_bucket_of_large_batches_decides_after_two_steps_of_each_level():
    # Each step of a batch of 9-16 counts at least 9 requests' tokens: min_samples=4 requests
    # need one step, but two are measured so one outlier cannot decide.
    assert [fresh_steps(4, b) for b in (1, 2, 4, 8, 16, 64)] == [4, 2, 2, 2, 2, 2]
    assert [fresh_steps(8, b) for b in (1, 2, 4, 8, 16)] == [8, 4, 3, 2, 2]
    assert fresh_steps(1, 1) == 1 and fresh_steps(1, 16) == 1
    gate = UtilityGate(GateOptions(probe_interval=50, max_probe_interval=50, min_samples=4))
    levels = drive(gate, 20, 16, spec_time=1.6, plain_time=0.8, tokens=1.6)
    assert levels[:2] == [SPECULATE] * 2
    assert levels[2:] == [PLAIN] * 18  # +1 unmeasured switch step, 2 measured, then decided
    state = gate.state(16)
    assert not state.open and state.switches == 1 and state.utility == pytest.approx(0.8)


def test_a_settled_bucket_moves_only_to_a_level_it_has_just_measured():
    # Both levels slow down as the requests' contexts grow (utility 0.9 throughout); the
    # running plain steps' average follows, speculation's stays where it was measured.
    options = GateOptions(probe_interval=20, max_probe_interval=80, probe_steps=3, min_samples=2)
    gate = UtilityGate(options)
    levels = []
    for step in range(200):
        level = gate.level(1)
        growth = 1.0 + step / 50  # step times double every 50 steps
        gate.record(1, level, (0.2 if level == SPECULATE else 0.1) * growth, 1.8)
        levels.append(level)
        if step == 22:  # before the first probe: the stale figure says speculation pays
            assert gate.state(1).utility > 1.2 and not gate.is_open(1)
    assert levels[:2] == [SPECULATE] * 2 and not gate.is_open(1)
    assert gate.state(1).switches == 1  # closed once, never reopened on stale figures
    # Each probe measures speculation anew (its time where the contexts are now).
    probes = [i for i in range(3, 200) if levels[i] == SPECULATE and levels[i - 1] == PLAIN]
    assert len(probes) >= 3
    assert gate.state(1).best.time == pytest.approx(0.2 * (1 + probes[-1] / 50), rel=0.05)


def test_an_open_bucket_closes_as_soon_as_its_own_figures_fall_below_plain():
    options = GateOptions(probe_interval=500, max_probe_interval=500, min_samples=2)
    seen = []
    gate = UtilityGate(options, on_change=lambda b, s: seen.append(s.open))
    drive(gate, 20, 8, spec_time=0.15, plain_time=0.1, tokens=2.0)  # utility 1.33
    assert gate.is_open(8) and seen == [True]  # the first decision, reported though kept
    # The acceptance falls to 1.2 tokens (utility 0.8): closed without waiting for a probe of
    # plain decoding, 500 steps away.
    levels = drive(gate, 20, 8, spec_time=0.15, plain_time=0.1, tokens=1.2)
    assert not gate.is_open(8) and seen == [True, False]
    assert levels.index(PLAIN) < 10


def test_stays_open_where_speculation_pays_and_probes_plain_decoding():
    options = GateOptions(probe_interval=40, max_probe_interval=40, probe_steps=2, min_samples=3)
    gate = UtilityGate(options)
    levels = drive(gate, 300, 4, spec_time=0.15, plain_time=0.1, tokens=2.4)  # utility 1.6
    state = gate.state(4)
    assert state.open and state.switches == 0
    assert state.utility == pytest.approx(1.6)
    assert levels[-100:].count(PLAIN) >= 2  # re-probed
    assert levels[-100:].count(SPECULATE) >= 90


def test_reopens_when_acceptance_rises_and_keeps_buckets_apart():
    options = GateOptions(probe_interval=20, max_probe_interval=40, probe_steps=4, min_samples=3)
    gate = UtilityGate(options)
    drive(gate, 100, 1, spec_time=0.2, plain_time=0.1, tokens=1.2)
    assert not gate.state(1).open
    # Another bucket starts in its neighbour's state, and its own probes correct it.
    assert gate.level(16) == PLAIN
    drive(gate, 200, 16, spec_time=0.12, plain_time=0.1, tokens=2.0)
    assert gate.state(16).open and not gate.state(1).open
    # Acceptance in bucket 1 rises: the probes see it and the gate opens again.
    drive(gate, 200, 1, spec_time=0.2, plain_time=0.1, tokens=3.0)
    assert gate.state(1).open and gate.state(1).switches == 2
    assert gate.buckets() == [1, 16]


def test_probes_back_off_while_the_decision_holds():
    options = GateOptions(
        probe_interval=10, max_probe_interval=80, probe_steps=3, min_samples=2, probe_budget=1.0
    )
    gate = UtilityGate(options)
    levels = drive(gate, 1000, 1, spec_time=0.3, plain_time=0.1, tokens=1.5)
    starts = [i for i in range(1, len(levels)) if levels[i] == SPECULATE != levels[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # 10, 20, 40, 80, 80, ... plain steps between probes (plus the probe's own 3 steps).
    assert gaps[:4] == [23, 43, 83, 83]
    assert gate.state(1).switches == 1


def test_probes_of_a_losing_level_stay_within_the_budget():
    options = GateOptions(
        probe_interval=10, max_probe_interval=1000, probe_steps=3, min_samples=2, probe_budget=0.01
    )
    gate = UtilityGate(options)
    # Utility 0.5 at twice plain decoding's time: each probe step loses (1 - 0.5) * 2 = 1
    # plain step, a probe 3; at 1% the probes are at least 300 steps apart.
    levels = drive(gate, 2000, 1, spec_time=0.2, plain_time=0.1, tokens=1.0)
    assert gate.state(1).switches == 1 and not gate.state(1).open
    starts = [i for i in range(1, len(levels)) if levels[i] == SPECULATE != levels[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps and min(gaps) >= 300
    late = levels[starts[0] :]
    lost = late.count(SPECULATE) * (1 - 0.5) * 2  # plain steps lost to the probes
    assert lost / len(late) <= 0.01 + 3 / len(late)  # the last probe may end the window
    # Where the levels almost tie a probe loses little, and probes come far more often:
    # 3 * (1 - 0.95) * 2 / 0.01 = 30 steps apart.
    near = UtilityGate(options)
    levels = drive(near, 400, 1, spec_time=0.2, plain_time=0.1, tokens=1.9)
    assert not near.state(1).open and near.state(1).utility == pytest.approx(0.95)
    starts = [i for i in range(1, len(levels)) if levels[i] == SPECULATE != levels[i - 1]]
    assert starts[1] - starts[0] == 30 + 3


def test_speculates_at_follows_the_bucket_of_a_batch_size_without_creating_it():
    options = GateOptions(probe_interval=10, max_probe_interval=10, probe_steps=3, min_samples=2)
    gate = UtilityGate(options)
    assert gate.speculates_at(16)  # nothing measured: a fresh bucket measures speculation
    drive(gate, 3, 1, spec_time=0.3, plain_time=0.1, tokens=1.2)
    assert gate.speculates_at(1)  # still measuring
    drive(gate, 20, 1, spec_time=0.3, plain_time=0.1, tokens=1.2)
    assert not gate.speculates_at(1)
    assert not gate.speculates_at(2) and gate.buckets() == [1]  # would inherit closed
    drive(gate, 200, 8, spec_time=0.12, plain_time=0.1, tokens=2.0)  # a fresh bucket: pays
    assert gate.is_open(8) and gate.speculates_at(8) and not gate.speculates_at(1)
    # A new bucket starts from its nearest measured neighbour's state.
    assert gate.speculates_at(16) and not gate.speculates_at(2)


def test_only_buckets_decided_on_their_own_figures_count_as_own():
    options = GateOptions(probe_interval=50, max_probe_interval=50, probe_steps=3, min_samples=2)
    gate = UtilityGate(options)
    drive(gate, 3, 16, spec_time=2.0, plain_time=1.1, tokens=1.6)
    assert not gate.has_own_figures(16)  # still measuring
    drive(gate, 10, 16, spec_time=2.0, plain_time=1.1, tokens=1.6)
    assert gate.has_own_figures(16)
    # Batch size 1 inherits 16's state and runs it until its first probe (after 2 steps,
    # fresh_steps at batch size 1): no figures of its own before it, its own after it.
    drive(gate, 2, 1, spec_time=0.5, plain_time=0.3, tokens=1.6)
    assert gate.state(1).settled and not gate.has_own_figures(1)
    drive(gate, 3, 1, spec_time=0.5, plain_time=0.3, tokens=1.6)
    assert gate.has_own_figures(1)
    restarted = UtilityGate(options)
    restarted.seed(16, gate.state(16))
    assert restarted.has_own_figures(16)


def test_a_fresh_bucket_without_measured_neighbours_measures_both_levels():
    gate = UtilityGate(GateOptions(min_samples=2))
    assert [gate.level(8) for _ in range(2)] == [SPECULATE, SPECULATE]
    assert gate.level(2) == SPECULATE  # nothing measured yet: starts fresh as well
    assert not gate._buckets[2].settled


def test_hysteresis_keeps_a_utility_near_one_from_flapping():
    gate = UtilityGate(GateOptions(probe_interval=10, probe_steps=3, min_samples=2, margin=0.05))
    drive(gate, 300, 2, spec_time=0.1, plain_time=0.1, tokens=1.02)  # utility 1.02
    assert gate.state(2).open and gate.state(2).switches == 0


def test_first_step_after_a_switch_is_not_measured():
    gate = UtilityGate(GateOptions(min_samples=2, probe_steps=2))
    gate.record(1, SPECULATE, 0.2, 2.0)
    gate.record(1, PLAIN, 99.0, 1.0)  # the switch step: dropped
    gate.record(1, PLAIN, 0.1, 1.0)
    assert gate.state(1).plain_time == pytest.approx(0.1)
    # The switch is the gate's, not a bucket's: a step of another bucket counts too.
    gate.record(8, SPECULATE, 5.0, 2.0)  # after a plain step: dropped
    gate.record(8, SPECULATE, 0.3, 2.0)
    assert gate.state(8).best.time == pytest.approx(0.3)


def test_a_slow_first_step_does_not_linger():
    gate = UtilityGate(GateOptions(min_samples=3, smoothing=0.2))
    for seconds in (1.0, 0.1, 0.1):  # the first speculative step pays a lazy initialisation
        gate.record(1, SPECULATE, seconds, 2.0)
    assert gate.state(1).best.time == pytest.approx(0.1)


def test_probes_of_a_closed_bucket_refresh_time_not_acceptance():
    options = GateOptions(probe_interval=10, max_probe_interval=10, probe_steps=3, min_samples=2)
    gate = UtilityGate(options)
    drive(gate, 30, 1, spec_time=0.3, plain_time=0.1, tokens=1.5)
    assert not gate.is_open(1)
    for _ in range(60):  # the probes draft from a stale state: tokens not measured
        level = gate.level(1)
        tokens = None if level == SPECULATE and not gate.is_open(1) else 1.0
        gate.record(1, level, 0.2 if level == SPECULATE else 0.1, tokens)
    state = gate.state(1)
    assert state.best.tokens == pytest.approx(1.5) and state.best.time < 0.3
    # A bucket that starts closed takes its neighbour's acceptance and can decide.
    assert gate.level(2) == PLAIN and gate.state(2).best.tokens == pytest.approx(1.5)


def test_prediction_sets_the_start_state_until_measured():
    gate = UtilityGate(GateOptions(min_samples=2), predicted=lambda b: 0.5 if b <= 2 else 1.5)
    assert gate.level(1) == PLAIN and gate.level(8) == SPECULATE
    assert not gate.state(1).open and gate.state(8).open


def test_on_change_reports_each_flip():
    seen = []
    gate = UtilityGate(
        GateOptions(min_samples=2, probe_interval=30, max_probe_interval=30),
        on_change=lambda b, s: seen.append((b, s)),
    )
    drive(gate, 60, 1, spec_time=0.3, plain_time=0.1, tokens=1.5)
    assert len(seen) == 1 and seen[0][0] == 1 and not seen[0][1].open


def test_bad_samples_are_ignored_and_bad_levels_refused():
    gate = UtilityGate()
    assert gate.level(1) == SPECULATE
    gate.record(1, SPECULATE, float("nan"), 2.0)
    gate.record(1, SPECULATE, 0.0, 2.0)
    assert math.isnan(gate.state(1).best.time)
    with pytest.raises(ValueError, match="level must be one of"):
        gate.record(1, 3, 0.1, 1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"probe_interval": 0}, "probe_interval"),
        ({"probe_interval": 8, "max_probe_interval": 4}, "max_probe_interval must be an int >= 8"),
        ({"probe_steps": 1}, "probe_steps"),
        ({"min_samples": 0}, "min_samples"),
        ({"margin": 0.5}, "margin"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"probe_steps": True}, "probe_steps"),
    ],
)
def test_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GateOptions(**kwargs)


def drive_levels(gate, steps, batch_size, figures):
    """Like :func:`drive` for any levels: ``figures`` maps a level to its (seconds, tokens)."""
    levels = []
    for _ in range(steps):
        level = gate.level(batch_size)
        levels.append(level)
        gate.record(batch_size, level, *figures[level])
    return levels


def test_three_levels_run_the_one_of_highest_utility():
    options = GateOptions(probe_interval=30, max_probe_interval=30, probe_steps=3, min_samples=3)
    gate = UtilityGate(options, levels=(PLAIN, 1, 3))
    # The full tree: 1.8 tokens in 3 plain steps' time (utility 0.6); one drafted token: 1.3
    # tokens in 1.1 plain steps' time (utility 1.18).
    figures = {PLAIN: (0.1, 1.0), 1: (0.11, 1.3), 3: (0.3, 1.8)}
    levels = drive_levels(gate, 300, 16, figures)
    # Starts at the top level, then measures the narrower one, plain decoding last, two steps
    # each at batch size 16 (+1 each: the switch step).
    assert levels[:8] == [3] * 2 + [1] * 3 + [PLAIN] * 3
    state = gate.state(16)
    assert state.level == 1 and state.open and state.switches == 1
    assert [f.steps for f in state.speculative] == [1, 3]
    assert state.best.steps == 1 and state.utility == pytest.approx(1.3 / 1.1)
    assert state.speculative[1].utility == pytest.approx(0.6)
    late = levels[100:]
    assert late.count(1) >= 0.8 * len(late)
    assert late.count(PLAIN) >= 3 and late.count(3) >= 3  # both re-probed, in turn


def test_a_level_change_moves_between_speculative_levels():
    options = GateOptions(
        probe_interval=10, max_probe_interval=20, probe_steps=3, min_samples=2, probe_budget=1.0
    )
    gate = UtilityGate(options, levels=(PLAIN, 1, 3))
    drive_levels(gate, 200, 1, {PLAIN: (0.1, 1.0), 1: (0.11, 1.3), 3: (0.3, 1.8)})
    assert gate.running_level(1) == 1
    # Acceptance rises: the full tree now yields 4 tokens (utility 1.33 against 1.18).
    drive_levels(gate, 200, 1, {PLAIN: (0.1, 1.0), 1: (0.11, 1.3), 3: (0.3, 4.0)})
    assert gate.running_level(1) == 3 and gate.state(1).switches == 2
    # Speculation stops paying at every level: plain decoding.
    drive_levels(gate, 300, 1, {PLAIN: (0.1, 1.0), 1: (0.2, 1.3), 3: (0.3, 1.5)})
    assert gate.running_level(1) == PLAIN and not gate.is_open(1)


def test_probes_of_a_far_slower_level_come_more_rarely():
    options = GateOptions(probe_interval=10, max_probe_interval=1000, probe_steps=3, min_samples=2)
    gate = UtilityGate(options, levels=(PLAIN, 1, 3))
    # Running level 1 (utility 1.25); plain loses 0.2 of a level-1 step per probe step, the
    # full tree (utility 0.5 at 3 plain steps) 1.6 level-1 steps.
    figures = {PLAIN: (0.1, 1.0), 1: (0.12, 1.5), 3: (0.3, 1.5)}
    levels = drive_levels(gate, 3000, 1, figures)
    assert gate.running_level(1) == 1
    late = levels[200:]
    probe_steps = {v: sum(1 for i in range(1, len(late)) if late[i] == v) for v in (PLAIN, 3)}
    assert probe_steps[3] < probe_steps[PLAIN]
    lost = probe_steps[PLAIN] * 0.2 + probe_steps[3] * 1.6  # in level-1 steps
    assert lost / len(late) <= 0.01 + 2 * 3 * 1.6 / len(late)  # a probe may straddle the end


@pytest.mark.parametrize("levels", [(PLAIN,), (1, 3), (PLAIN, 3, 1), (PLAIN, 1, 1), (PLAIN, True)])
def test_levels_are_validated(levels):
    with pytest.raises(ValueError, match="gate levels"):
        UtilityGate(levels=levels)
    assert check_levels([PLAIN, 2, 5]) == (PLAIN, 2, 5)


def test_a_seeded_bucket_starts_settled_at_its_level_and_neighbours_inherit_it():
    options = GateOptions(probe_interval=50, max_probe_interval=50, probe_steps=3, min_samples=4)
    first = UtilityGate(options)
    drive(first, 40, 16, spec_time=2.0, plain_time=1.1, tokens=1.6)
    saved = first.state(16)
    assert saved.settled and not saved.open
    restarted = UtilityGate(options)
    restarted.seed(16, saved)
    state = restarted.state(16)
    assert state.settled and state.level == PLAIN and state.switches == 0
    assert state.utility == pytest.approx(saved.utility)
    # No start-up measurement: plain decoding until the first probe, probe_interval away.
    levels = drive(restarted, 60, 16, spec_time=2.0, plain_time=1.1, tokens=1.6)
    assert levels[:50] == [PLAIN] * 50 and SPECULATE in levels[50:]
    # A fresh bucket starts from the seeded one's level, as from a measured neighbour's, and
    # probes the other level after fresh_steps (2 at batch size 8), not probe_interval.
    levels = drive(restarted, 5, 8, spec_time=1.0, plain_time=0.6, tokens=1.6)
    assert levels == [PLAIN, PLAIN, SPECULATE, SPECULATE, SPECULATE]
    assert not restarted.speculates_at(16) and not restarted.speculates_at(8)


def test_a_seeded_open_bucket_closes_on_its_own_figures():
    gate = UtilityGate(GateOptions(min_samples=2, smoothing=0.5))
    seeded = UtilityGate(GateOptions(min_samples=2))
    drive(seeded, 20, 4, spec_time=0.2, plain_time=0.15, tokens=1.8)
    assert seeded.state(4).open
    gate.seed(4, seeded.state(4))
    # The traffic changed: acceptance fell. The seeded figures blend into the new samples.
    levels = drive(gate, 10, 4, spec_time=0.2, plain_time=0.15, tokens=1.1)
    assert levels[0] == SPECULATE and gate.state(4).level == PLAIN


def test_seed_refuses_what_does_not_fit():
    gate = UtilityGate(levels=(0, 1, 3))
    other = UtilityGate()
    drive(other, 20, 1, spec_time=0.2, plain_time=0.1, tokens=1.5)
    with pytest.raises(ValueError, match="levels"):
        gate.seed(1, other.state(1))
    two = UtilityGate()
    with pytest.raises(ValueError, match="no bucket key"):
        two.seed(3, other.state(1))
    two.seed(1, other.state(1))
    with pytest.raises(ValueError, match="seen already"):
        two.seed(1, other.state(1))


def test_an_inherited_bucket_probes_within_its_first_steps_and_moves_on_its_own_figures():
    """Log, "Run T": batch 2 measured plain decoding fastest, batch 16 inherited it and, with
    fewer steps a phase than probe_interval, never measured that speculation pays there."""
    options = GateOptions(probe_interval=128, probe_steps=3, min_samples=2)
    gate = UtilityGate(options)
    drive(gate, 20, 2, spec_time=0.5, plain_time=0.33, tokens=1.4)  # utility 0.92
    assert not gate.speculates_at(2)
    # At batch 16 a speculative step costs little more than a plain one (utility 1.3).
    levels = drive(gate, 30, 16, spec_time=1.08, plain_time=1.0, tokens=1.4)
    assert levels[:2] == [PLAIN, PLAIN] and levels[2:5] == [SPECULATE] * 3
    assert gate.speculates_at(16) and gate.has_own_figures(16)
    assert not gate.speculates_at(2)


def test_a_step_chosen_before_a_switch_does_not_undo_it():
    """A server hands a step's results over after the next step has started (log, "Run U"):
    the step after a close was chosen while the bucket was open, and its figures alone must
    not reopen it."""
    options = GateOptions(probe_interval=500, max_probe_interval=500, min_samples=2)
    gate = UtilityGate(options)
    levels, pending = [], None
    for step in range(60):
        level = gate.level(8)
        levels.append(level)
        if pending is not None:
            gate.record(8, *pending)
        # Utility 1.33 for 20 steps, then 0.8; a speculative step recorded once the bucket
        # is closed yields 3 tokens (utility 2): a lagged step's noise that reopened it.
        tokens = 2.0 if step < 20 else (1.2 if gate.is_open(8) else 3.0)
        pending = (level, 0.15, tokens) if level == SPECULATE else (level, 0.1, 1.0)
    state = gate.state(8)
    assert not state.open and state.switches == 1
    closed_at = levels.index(PLAIN, 20)
    assert levels[closed_at:] == [PLAIN] * (60 - closed_at)
