"""SPO++ event-time values for asynchronous samples: hand-computed cases, the synchronous limit, order invariance."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from trl_aspo.values import EventValueTracker
from trl_aspo.values.event_values import AsyncEventValues


def reference_value(outcomes, version, rho, prior=(0.5, 0.5, 0)):
    """The defining sum of v(x, z), written out directly."""
    alpha_0, beta_0, z0 = prior
    visible = [(z, r) for z, r in outcomes if z < version]
    alpha = rho ** (version - z0) * alpha_0 + math.fsum(rho ** (version - z) * r for z, r in visible)
    beta = rho ** (version - z0) * beta_0 + math.fsum(rho ** (version - z) * (1 - r) for z, r in visible)
    return alpha / (alpha + beta)


def test_out_of_order_and_stale_arrivals_by_hand():
    values = AsyncEventValues(rho=0.5)
    values.enter(["x"], 0)
    # Arrival order 2, 0, 1: the version-2 outcome arrives before the older ones.
    values.observe(["x"], [0.0], [2])
    values.observe(["x"], [1.0], [0])
    values.observe(["x"], [1.0], [1])
    # z=2: alpha = .25*.5 + .25*1 + .5*1 = .875, beta = .25*.5 = .125 (its own version's outcome is not visible)
    # z=3: alpha = .125*.5 + .125 + .25 = .4375, beta = .0625 + .5 = .5625
    # z=1 (a stale sample): alpha = .5*.5 + .5 = .75, beta = .25;  z=0: the prior alone
    got = values.value(["x", "x", "x", "x"], [2, 3, 1, 0])
    torch.testing.assert_close(got, torch.tensor([0.875, 0.4375, 0.75, 0.5], dtype=torch.float64), rtol=0, atol=1e-15)
    assert values.visits(["x", "y"]).tolist() == [3, 0]
    assert values.value(["never-seen"], 7).item() == 0.5


def test_prior_anchored_at_entry_version():
    values = AsyncEventValues(rho=0.5)
    values.enter(["late"], 40)
    values.observe(["late"], [1.0], [40])
    # alpha = .5*.5 + .5*1 = .75, beta = .25: the prior aged one version from its entry at 40, not 41 versions
    assert values.value(["late"], 41).item() == pytest.approx(0.75, abs=1e-15)
    values.enter(["late"], 38)  # an older sample of the prompt arrives: the entry moves to the earliest version
    assert values.value(["late"], 41).item() == pytest.approx(reference_value([(40, 1.0)], 41, 0.5, (0.5, 0.5, 38)))
    with pytest.raises(ValueError, match="entered at version 38, later than the queried version 37"):
        values.value(["late"], 37)


def test_folding_old_outcomes_keeps_values_and_bounds_memory():
    rng = random.Random(0)
    outcomes = [(rng.randrange(0, 30), rng.random()) for _ in range(200)]
    windowed, kept = AsyncEventValues(rho=0.8), AsyncEventValues(rho=0.8)
    for tracker in (windowed, kept):
        tracker.enter(["x"], 0)
        tracker.observe(["x"] * len(outcomes), [r for _, r in outcomes], [z for z, _ in outcomes])
    windowed.advance(25)
    assert all(z >= 25 for z, _ in windowed.state_dict()["window"]["x"])
    for version in (25, 28, 31, 60):
        expected = reference_value(outcomes, version, 0.8)
        assert windowed.value(["x"], version).item() == pytest.approx(expected, abs=1e-12)
        assert kept.value(["x"], version).item() == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="older than the staleness horizon 25"):
        windowed.value(["x"], 24)
    windowed.observe(["x"], [1.0], [3])  # a late outcome older than the horizon is folded in directly
    assert windowed.value(["x"], 30).item() == pytest.approx(
        reference_value([*outcomes, (3, 1.0)], 30, 0.8), abs=1e-12
    )


def test_no_blow_up_after_long_gaps():
    values = AsyncEventValues(rho=0.875)
    values.enter(["x"], 0)
    values.observe(["x", "x"], [1.0, 0.0], [0, 1])
    values.advance(100_000)
    far = values.value(["x"], 200_000).item()
    assert math.isfinite(far)
    # The ratio is independent of the common aging factor: the same as right after the last outcome.
    assert far == pytest.approx(reference_value([(0, 1.0), (1, 0.0)], 2, 0.875), abs=1e-12)


def test_synchronous_limit_equals_event_value_tracker():
    rng = random.Random(1)
    keys = [f"p{i}" for i in range(6)]
    sync, async_values = EventValueTracker(rho=0.875), AsyncEventValues(rho=0.875)
    for tracker in (sync, async_values):
        tracker.init_from_counts(["p0"], [2], [4], prior_strength=8.0, event=0)
        tracker.set_pseudo_counts(["p1"], [3.0], [1.5], event=0)
    for round_ in range(40):
        batch = [rng.choice(keys) for _ in range(5)]
        rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in batch]
        sync.enter(batch, round_)
        async_values.enter(batch, [round_] * len(batch))
        expected = sync.value(batch, round_)
        torch.testing.assert_close(async_values.value(batch, round_), expected, rtol=0, atol=1e-12)
        sync.observe(batch, rewards, round_)
        async_values.observe(batch, rewards, round_)
        async_values.advance(max(0, round_ - 2))


def test_values_depend_on_the_set_not_the_arrival_order():
    rng = random.Random(2)
    samples = [(rng.choice("abc"), rng.randrange(0, 8), rng.random()) for _ in range(60)]
    results = []
    for seed in range(3):
        shuffled = samples[:]
        random.Random(seed).shuffle(shuffled)
        values = AsyncEventValues(rho=0.875)
        for key, version, reward in shuffled:
            values.observe([key], [reward], [version])
        results.append(values.value(["a", "b", "c"], [8, 8, 8]))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(results[2], results[0], rtol=0, atol=1e-12)


def test_outcomes_of_the_dispatch_version_do_not_count():
    """The decision of docs/async.md ("Same-event outcomes do not count"): with one request in flight per prompt and
    the drain at publish, a prompt's first trajectory of version 3 is scored before its second one of version 3 is
    dispatched, yet the second's value ignores it (SPO++'s eq. 3 would count it with weight 1); it counts from
    version 4 on, with weight rho."""
    values = AsyncEventValues(rho=0.5)
    values.enter(["x"], 3)
    values.observe(["x"], [1.0], [3])  # the first trajectory of version 3, scored
    assert values.value(["x"], 3).item() == 0.5  # the second of version 3: the prior alone
    # Version 4: alpha = .5*.5 + .5*1 = .75, beta = .5*.5 = .25.
    assert values.value(["x"], 4).item() == pytest.approx(0.75, abs=1e-15)
    values.observe(["x"], [0.0], [3])  # the second trajectory: the value at version 3 still does not move
    assert values.value(["x"], 3).item() == 0.5


def test_state_round_trips_through_json():
    values = AsyncEventValues(rho=0.9)
    values.enter(["x", "y"], [1, 2])
    values.observe(["x", "y", "x"], [1.0, 0.25, 0.0], [1, 2, 4])
    values.advance(3)
    restored = AsyncEventValues()
    restored.load_state_dict(json.loads(json.dumps(values.state_dict())))
    assert restored.state_dict() == values.state_dict()
    torch.testing.assert_close(restored.value(["x", "y"], [5, 5]), values.value(["x", "y"], [5, 5]))
    with pytest.raises(ValueError, match="not an AsyncEventValues state"):
        restored.load_state_dict(EventValueTracker().state_dict())


def test_bad_input_leaves_state_intact():
    values = AsyncEventValues()
    with pytest.raises(ValueError, match=r"reward 1.5 for prompt key 'x' is outside \[0, 1\]"):
        values.observe(["x"], [1.5], [0])
    with pytest.raises(ValueError, match="`versions` must be a non-negative integer model version, got -1"):
        values.observe(["x"], [1.0], [-1])
    with pytest.raises(ValueError, match="`versions` must hold integers"):
        values.observe(["x"], [1.0], torch.tensor([0.5]))
    with pytest.raises(ValueError, match="`versions` has 2 entries but `keys` has 1"):
        values.value(["x"], [1, 2])
    with pytest.raises(ValueError, match=r"`rho` must lie in \(0, 1\]"):
        AsyncEventValues(rho=0.0)
    assert values.num_tracked == 0 and values.visits(["x"]).tolist() == [0]
