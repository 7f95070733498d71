"""Issue 43 item 3: the per-step timer of the trainers' own work (trl_aspo.trainers.step_timing). The host clock is
a fake one; the CUDA path runs on stand-in event objects (no GPU here): what is tested is when pairs are read (only
once their end has completed, never with a synchronization) and how their milliseconds are summed, not CUDA's
timing itself."""

from __future__ import annotations

import time
import types
from collections import defaultdict

import pytest
from helpers import load_script

from trl_aspo.cli import plot
from trl_aspo.trainers import step_timing
from trl_aspo.trainers.step_timing import (
    ADVANTAGES,
    OFFPOLICY_CORRECTION,
    POLICY_LOSS,
    STEP,
    VALUE_PREPASS,
    StepTimer,
    StepTimingCallback,
    StepTimingMixin,
)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class StandInEvent:
    """A CUDA event's interface: `record()` stamps the stand-in GPU clock, `query()` says whether the GPU has reached
    it, `elapsed_time(end)` is in milliseconds and, as CUDA's, raises when either event has not completed."""

    def __init__(self, gpu):
        self.gpu, self.stamp = gpu, None

    def record(self):
        self.stamp = self.gpu["queued"]

    def query(self) -> bool:
        return self.stamp is not None and self.stamp <= self.gpu["done"]

    def elapsed_time(self, end) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("cudaErrorNotReady")
        return 1000.0 * (end.stamp - self.stamp)


def test_host_regions_sum_per_step_and_a_region_seen_once_is_logged_at_every_later_step():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    timer.start()
    for seconds in (0.25, 0.5):  # two micro-batches of one step
        with timer.region(POLICY_LOSS, "cpu"):
            clock.now += seconds
        clock.now += 1.0
    with timer.region(ADVANTAGES, "cpu"):
        clock.now += 0.125
    assert timer.end_step() == {POLICY_LOSS: 0.75, ADVANTAGES: 0.125, STEP: pytest.approx(2.875)}
    with timer.region(POLICY_LOSS, "cpu"):
        clock.now += 0.5
    # The advantages of a round are computed in its first step only: 0 in the others, so a window's mean is per step.
    assert timer.end_step() == {POLICY_LOSS: 0.5, ADVANTAGES: 0.0, STEP: 0.5}


def test_a_region_that_raises_is_still_counted_and_start_forgets_what_came_before():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    with pytest.raises(ValueError), timer.region(ADVANTAGES, "cpu"):
        clock.now += 2.0
        raise ValueError("a bad reward")
    assert timer.end_step()[ADVANTAGES] == 2.0
    # Before training starts (a pre-pass, an evaluation) nothing counts, and the first step is timed from the start.
    with timer.region(OFFPOLICY_CORRECTION, "cpu"):
        clock.now += 5.0
    timer.start()
    clock.now += 1.0
    assert timer.end_step() == {STEP: 1.0}


def test_the_step_is_timed_between_step_ends_and_a_measured_sleep_on_the_real_clock():
    timer = StepTimer()
    timer.start()
    with timer.region(ADVANTAGES, "cpu"):
        time.sleep(0.02)
    metrics = timer.end_step()
    assert 0.015 <= metrics[ADVANTAGES] <= metrics[STEP] < 5.0


def test_cuda_regions_are_read_at_the_step_end_only_once_their_end_event_has_completed():
    """A pair the GPU has not finished when the step ends stays pending (nothing synchronizes) and is counted at the
    next step's end; a host region and the step are still read from the host clock."""
    clock, gpu = FakeClock(), {"queued": 0.0, "done": 0.0}
    timer = StepTimer(clock=clock, new_event=lambda: StandInEvent(gpu))
    timer.start()
    with timer.region(POLICY_LOSS, "cuda"):
        gpu["queued"] += 0.25  # kernels enqueued: 0.25 s of GPU work
    with timer.region(POLICY_LOSS, "cuda:0"):
        gpu["queued"] += 0.5
    with timer.region(ADVANTAGES, "cpu"):
        clock.now += 0.125
    clock.now += 1.0
    gpu["done"] = 0.25  # the first pair has completed, the second is still running
    assert timer.end_step() == {POLICY_LOSS: 0.25, ADVANTAGES: 0.125, STEP: 1.125}
    gpu["done"] = 0.75
    clock.now += 2.0
    assert timer.end_step() == {POLICY_LOSS: 0.5, ADVANTAGES: 0.0, STEP: 2.0}
    assert timer.end_step() == {POLICY_LOSS: 0.0, ADVANTAGES: 0.0, STEP: 0.0}


def test_the_callback_starts_at_train_begin_and_appends_at_each_step_end():
    clock = FakeClock()
    timer, appended = StepTimer(clock=clock), []
    callback = StepTimingCallback(timer, appended.append)
    callback.on_train_begin(None, None, None)
    clock.now += 3.0
    callback.on_step_end(None, None, None)
    assert appended == [{STEP: 3.0}]


class TimedTrainer(StepTimingMixin):
    """The trainer surface the mixin reads: `args.log_timing`, `_metrics`, `add_callback`."""

    def __init__(self, log_timing: bool):
        self.args = types.SimpleNamespace(log_timing=log_timing)
        self._metrics = {"train": defaultdict(list)}
        self.callbacks = []

    def add_callback(self, callback):
        self.callbacks.append(callback)


def test_the_mixin_times_training_only_and_nothing_with_the_switch_off():
    trainer = TimedTrainer(log_timing=True)
    trainer._start_step_timing()
    (callback,) = trainer.callbacks
    callback.on_train_begin(None, None, None)
    with trainer._timed(ADVANTAGES, "cpu"):
        pass
    with trainer._timed(POLICY_LOSS, "cpu", training=False):  # an evaluation pass is not the training step's work
        pass
    with trainer._timed_prepass():
        pass
    callback.on_step_end(None, None, None)
    assert set(trainer._metrics["train"]) == {ADVANTAGES, STEP, VALUE_PREPASS}
    assert all(len(values) == 1 and values[0] >= 0.0 for values in trainer._metrics["train"].values())

    off = TimedTrainer(log_timing=False)
    off._start_step_timing()
    with off._timed(ADVANTAGES, "cpu"), off._timed_prepass():
        pass
    assert off.callbacks == [] and not off._metrics["train"]


def test_the_names_are_those_the_plot_reads_and_none_is_reduced_as_an_extremum_or_a_counter():
    """AsyncGRPOTrainer reduces a logging window by the name's words ('max', 'min', 'total'); these are means."""
    names = [ADVANTAGES, POLICY_LOSS, OFFPOLICY_CORRECTION, STEP, VALUE_PREPASS]
    assert all(name.startswith(plot.TIMING_PREFIX) and name.endswith("_s") for name in names)
    assert (plot.STEP_SECONDS, plot.VALUE_PREPASS_SECONDS) == (STEP, VALUE_PREPASS)
    assert not {word for name in names for word in name.split("/")[-1].split("_")} & {"max", "min", "total"}
    assert step_timing.__doc__.count("`timing/") >= len(names)


def test_the_benchmark_calls_the_timers_free_when_1_lies_within_the_rounds_spread():
    """scripts/bench_step.py: per round the ratio of the two rows' median steps; the verdict compares 1.0 with
    their range."""
    bench_step = load_script("bench_step")
    on_rounds, off_rounds = [[1.0, 1.2, 1.1], [2.0, 2.0]], [[1.0, 1.0, 1.2], [2.1, 2.1]]
    assert bench_step.round_ratios(on_rounds, off_rounds) == pytest.approx([1.1, 2.0 / 2.1])
    line = bench_step.timers_line("wall", on_rounds, off_rounds)
    # The median of the two rounds' ratios: (1.1 + 0.9524) / 2 = 1.026.
    assert line == (
        "timers on vs off, wall: median step 1200.0 ms vs 1200.0 ms; median of the per-round ratios 1.026x "
        "(0.952x to 1.100x over 2 rounds): no measurable cost"
    )
    costly = bench_step.timers_line("CPU", [[1.2], [1.3], [1.1]], [[1.0], [1.0], [1.0]])
    assert costly.endswith("ratios 1.200x (1.100x to 1.300x over 3 rounds): a cost beyond the spread")
