"""Tests for priority weights and the prioritized repeat sampler."""

import pytest
import torch
from trl.trainer.utils import RepeatSampler

from trl_aspo.values import EventValueTracker, VisitValueTracker
from trl_aspo.values.sampler import PrioritizedRepeatSampler, effective_num_prompts, priority_weights


def test_priority_weights_hand_numbers():
    w = priority_weights(torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64))
    assert w.tolist() == pytest.approx([0.05, 0.55, 0.35, 0.05], abs=1e-12)
    assert priority_weights(torch.tensor([0.5]), epsilon=0.0).tolist() == pytest.approx([0.5])
    with pytest.raises(ValueError, match="values"):
        priority_weights(torch.tensor([1.2]))


def test_effective_num_prompts():
    assert effective_num_prompts(torch.ones(10)).item() == pytest.approx(10.0)
    # (1 + 1 + 2)^2 / (1 + 1 + 4) = 16/6
    assert effective_num_prompts(torch.tensor([1.0, 1.0, 2.0])).item() == pytest.approx(16 / 6)
    assert effective_num_prompts(torch.tensor([5.0, 0.0, 0.0])).item() == pytest.approx(1.0)


def _structure(indices, block):
    """Replace each index by the order of its first appearance inside its block (the repeat pattern)."""
    pattern = []
    for start in range(0, len(indices), block):
        first = {}
        pattern.extend(first.setdefault(i, len(first)) for i in indices[start : start + block])
    return pattern


def test_layout_matches_trl_repeat_sampler():
    n, mini, batch, repeat = 7, 2, 3, 4
    ours = PrioritizedRepeatSampler(n, mini, batch, repeat, seed=0)
    trl = RepeatSampler(list(range(n)), mini_repeat_count=mini, batch_size=batch, repeat_count=repeat, seed=0)
    ours_list, trl_list = list(ours), list(trl)
    assert len(ours) == len(trl) == len(ours_list) == len(trl_list) == 2 * 3 * 2 * 4
    block = batch * mini * repeat
    assert _structure(ours_list, block) == _structure(trl_list, block)
    for start in range(0, len(ours_list), block):
        chunk = ours_list[start : start + batch * mini]
        assert len(set(chunk)) == batch  # no duplicates within a batch
        assert ours_list[start : start + block] == chunk * repeat


def test_ranks_with_same_seed_draw_identically():
    weights = torch.linspace(0.1, 1.0, 20)
    rank0 = PrioritizedRepeatSampler(20, 1, 4, seed=42, weights=weights)
    rank1 = PrioritizedRepeatSampler(20, 1, 4, seed=42, weights=weights.clone())
    draws0 = [list(rank0) for _ in range(3)]
    assert draws0 == [list(rank1) for _ in range(3)]
    assert draws0[0] != draws0[1]  # epochs continue the round sequence instead of repeating it
    assert list(PrioritizedRepeatSampler(20, 1, 4, seed=43, weights=weights)) != draws0[0]


def test_draw_frequencies_follow_weights():
    weights = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0])
    sampler = PrioritizedRepeatSampler(5, 1, 1, seed=0, weights=weights)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sampler.draw()[0]] += 1
    assert torch.allclose(counts / 4000, weights / weights.sum(), atol=0.025)
    # Without replacement: a dominant prompt is in nearly every batch, and never twice.
    sampler = PrioritizedRepeatSampler(4, 1, 2, seed=0, weights=torch.tensor([100.0, 1.0, 1.0, 1.0]))
    batches = [sampler.draw() for _ in range(500)]
    assert all(len(set(b)) == 2 for b in batches)
    assert sum(0 in b for b in batches) >= 480


def test_weights_read_at_draw_time_and_callable():
    sampler = PrioritizedRepeatSampler(6, 2, 1, seed=0)
    it = iter(sampler)
    first = next(it)
    assert next(it) == first  # mini repeats of the already drawn batch
    sampler.weights = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    assert list(it) == [3] * 10
    current = {"w": torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])}
    sampler.weights = lambda: current["w"]
    assert sampler.draw() == [1]
    current["w"] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    assert sampler.draw() == [5]
    sampler.set_values(torch.tensor([0.5, 0.0, 1.0, 0.5, 0.5, 0.5]))
    assert sampler.weights.tolist() == pytest.approx([0.55, 0.05, 0.05, 0.55, 0.55, 0.55])


def test_bad_weights_rejected():
    sampler = PrioritizedRepeatSampler(4, 1, 2)
    with pytest.raises(ValueError, match="shape"):
        sampler.weights = torch.ones(3)
    with pytest.raises(ValueError, match="non-negative"):
        sampler.weights = torch.tensor([1.0, -1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="batch_size=2"):
        sampler.weights = torch.tensor([1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="batch_size"):
        PrioritizedRepeatSampler(3, 1, 4)


def test_state_round_trip(tmp_path):
    sampler = PrioritizedRepeatSampler(10, 2, 3, 2, seed=7, weights=torch.arange(1.0, 11.0))
    list(sampler)
    torch.save(sampler.state_dict(), tmp_path / "sampler.pt")
    restored = PrioritizedRepeatSampler(10, 2, 3, 2, seed=0)
    restored.load_state_dict(torch.load(tmp_path / "sampler.pt"))
    assert restored.round == sampler.round == 3
    assert torch.equal(restored.weights, sampler.weights)
    assert list(restored) == list(sampler)


def test_deferred_sampler_yields_slots_and_draws_by_round():
    weights = torch.linspace(0.1, 1.0, 10)
    deferred = PrioritizedRepeatSampler(10, 2, 3, 2, seed=5, weights=weights, deferred=True)
    # Placeholder slots in TRL's layout: round positions 0..2, each twice, the round twice; 3 rounds per epoch.
    assert list(deferred) == [0, 0, 1, 1, 2, 2] * 2 * 3
    assert deferred.round == 0  # iterating draws nothing
    # A draw depends only on (seed, round, weights): the same round gives the same prompts in any order of calls.
    eager = PrioritizedRepeatSampler(10, 2, 3, 2, seed=5, weights=weights)
    eager_rounds = [eager.draw() for _ in range(4)]
    assert [deferred.draw(r) for r in (3, 1, 0, 2)] == [eager_rounds[r] for r in (3, 1, 0, 2)]
    assert deferred.round == 3
    with pytest.raises(ValueError, match="round_index"):
        deferred.draw(-1)


def test_update_values_changes_only_the_given_rows():
    sampler = PrioritizedRepeatSampler(4, 1, 2, weights=torch.ones(4))
    sampler.update_values([2, 0], torch.tensor([0.5, 1.0], dtype=torch.float64))
    assert sampler.weights.tolist() == pytest.approx([0.05, 1.0, 0.55, 1.0])
    with pytest.raises(ValueError, match="rows"):
        sampler.update_values([4], torch.tensor([0.5]))
    with pytest.raises(ValueError, match="match"):
        sampler.update_values([0, 1], torch.tensor([0.5]))


@pytest.mark.parametrize("tracker_type", [EventValueTracker, VisitValueTracker])
def test_incremental_weights_equal_full_recomputation(tracker_type):
    """Many random rounds of a real tracker; after each, only the observed prompts are refreshed."""
    generator = torch.Generator().manual_seed(0)
    keys = [f"prompt-{i % 40}" for i in range(50)]  # rows 40..49 repeat the keys of rows 0..9
    rows_of_key: dict[str, list[int]] = {}
    for row, key in enumerate(keys):
        rows_of_key.setdefault(key, []).append(row)
    tracker = tracker_type()
    tracker.init_from_counts(keys[:5], [1, 2, 0, 3, 4], [4, 4, 4, 4, 4])

    def values(subset, event):
        return tracker.value(subset, event) if tracker_type is EventValueTracker else tracker.value(subset)

    incremental = PrioritizedRepeatSampler(len(keys), 1, 8)
    incremental.set_values(values(keys, 0))
    for event in range(300):
        observed = sorted({keys[i] for i in torch.randint(len(keys), (8,), generator=generator).tolist()})
        rewards = torch.rand(len(observed), generator=generator, dtype=torch.float64)
        if tracker_type is EventValueTracker:
            tracker.observe(observed, rewards, event)
        else:
            tracker.observe(observed, rewards, 0.8 + 0.15 * torch.rand(len(observed), generator=generator))
        rows = [row for key in observed for row in rows_of_key[key]]
        incremental.update_values(rows, values([keys[row] for row in rows], event + 1))
    full = PrioritizedRepeatSampler(len(keys), 1, 8)
    full.set_values(values(keys, 300))
    torch.testing.assert_close(incremental.weights, full.weights, atol=1e-12, rtol=0)
    assert full.weights.std() > 0


def test_spo_plus_plus_values_of_unobserved_prompts_do_not_age():
    """Aging multiplies a prompt's prior and every outcome by rho^(q - e): its value is the same at every event."""
    tracker = EventValueTracker(rho=0.5)
    tracker.init_from_counts(["a"], [1.0], [4], prior_strength=8.0, event=2)
    tracker.observe(["a", "a", "b"], [1.0, 0.0, 1.0], [3, 5, 0])
    # By hand at event 5: prior (8 * 1.5/5, 8 * 3.5/5) = (2.4, 5.6) aged 0.5^3, outcome 1 at event 3 aged 0.5^2,
    # outcome 0 at event 5 unaged: alpha = 0.3 + 0.25 = 0.55, beta = 0.7 + 1 = 1.7.
    expected_a = 0.55 / (0.55 + 1.7)
    # b: prior (0.5, 0.5) and one success, all at event 0: (1.5, 0.5).
    for event in (5, 6, 20, 500):
        assert tracker.value(["a", "b"], event).tolist() == pytest.approx([expected_a, 0.75], abs=1e-12)
