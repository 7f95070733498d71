"""Tests for the SPO / SPO++ value trackers, KL-adaptive forgetting and prompt keys (hand-computed numbers)."""

import json
import math
import random

import pytest
import torch

from trl_aspo.values import (
    EventValueTracker,
    VisitValueTracker,
    default_prior_strength,
    kl_adaptive_rho,
    logprob_drift,
)
from trl_aspo.values.prompt_ids import prompt_key, prompt_keys

# ----------------------------------------------------------------------------------------------------------- SPO


def test_visit_default_prior_is_jeffreys():
    v = VisitValueTracker()
    alpha, beta = v.pseudo_counts(["x"])
    assert alpha.tolist() == [0.5] and beta.tolist() == [0.5]
    assert v.value(["x", "y"]).tolist() == [0.5, 0.5]
    assert v.value(["x"]).dtype == torch.float64
    assert v.num_tracked == 0


def test_visit_update_hand_numbers():
    v = VisitValueTracker()
    v.observe(["a"], torch.tensor([1.0]), 0.875)
    # alpha = 0.875*0.5 + 1 = 1.4375, beta = 0.875*0.5 + 0 = 0.4375
    alpha, beta = v.pseudo_counts(["a"])
    assert alpha.item() == pytest.approx(1.4375, abs=1e-12)
    assert beta.item() == pytest.approx(0.4375, abs=1e-12)
    assert v.value(["a"]).item() == pytest.approx(1.4375 / 1.875, abs=1e-12)
    # fractional reward 0.25 with per-outcome rho tensor 0.9: alpha = 1.54375, beta = 1.14375
    v.observe(["a"], [0.25], torch.tensor([0.9], dtype=torch.float64))
    alpha, beta = v.pseudo_counts(["a"])
    assert alpha.item() == pytest.approx(1.54375, abs=1e-12)
    assert beta.item() == pytest.approx(1.14375, abs=1e-12)
    assert v.value(["a"]).item() == pytest.approx(0.5744186046511628, abs=1e-12)


def test_visit_duplicate_keys_applied_sequentially():
    v = VisitValueTracker()
    v.observe(["a", "b", "a"], torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.5, 0.875, 0.8], dtype=torch.float64))
    # a: (0.5*0.5+1, 0.5*0.5) = (1.25, 0.25) then (0.8*1.25, 0.8*0.25+1) = (1.0, 1.2)
    alpha, beta = v.pseudo_counts(["a", "b"])
    assert alpha.tolist() == pytest.approx([1.0, 0.4375], abs=1e-12)
    assert beta.tolist() == pytest.approx([1.2, 1.4375], abs=1e-12)
    assert v.num_tracked == 2


def test_jeffreys_init_from_counts_both_trackers():
    # s=3 of n0=4, N0=8: alpha = 8*3.5/5 = 5.6, beta = 8*1.5/5 = 2.4
    for tracker, args in ((VisitValueTracker(), ()), (EventValueTracker(), (0,))):
        tracker.init_from_counts(["p", "q"], [3, 0], [4, 1])
        alpha, beta = tracker.pseudo_counts(["p", "q"], *args)
        assert alpha.tolist() == pytest.approx([5.6, 8 * 0.5 / 2], abs=1e-12)
        assert beta.tolist() == pytest.approx([2.4, 8 * 1.5 / 2], abs=1e-12)
        assert tracker.value(["p"], *args).item() == pytest.approx(0.7, abs=1e-12)
    v = VisitValueTracker()
    v.init_from_counts(["p"], torch.tensor([1]), torch.tensor([3]), prior_strength=2.0)
    # alpha = 2*1.5/4 = 0.75, beta = 2*2.5/4 = 1.25
    alpha, beta = v.pseudo_counts(["p"])
    assert (alpha.item(), beta.item()) == pytest.approx((0.75, 1.25), abs=1e-12)


@pytest.mark.parametrize(
    ("successes", "trials", "match"),
    [([5], [4], "successes 5.0"), ([-1], [4], "successes -1.0"), ([0], [0], "trials 0.0")],
)
def test_init_from_counts_validation(successes, trials, match):
    with pytest.raises(ValueError, match=match):
        EventValueTracker().init_from_counts(["p"], successes, trials)
    with pytest.raises(ValueError, match=match):
        VisitValueTracker().init_from_counts(["p"], successes, trials)
    with pytest.raises(ValueError, match="prior_strength"):
        VisitValueTracker().init_from_counts(["p"], [1], [2], prior_strength=0.0)


# ---------------------------------------------------------------------------------------------------------- SPO++


def test_event_hand_numbers_and_visibility():
    t = EventValueTracker(rho=0.5)
    assert t.value(["a"], event=7).item() == 0.5
    t.enter(["a"], event=0)
    t.observe(["a", "a"], torch.tensor([0.0, 1.0]), torch.tensor([2, 1]))
    # At q=1 only the outcome from event 1 is visible: alpha = 0.5*0.5 + 1, beta = 0.5*0.5.
    alpha, beta = t.pseudo_counts(["a"], event=1)
    assert (alpha.item(), beta.item()) == pytest.approx((1.25, 0.25), abs=1e-12)
    assert t.value(["a"], event=1).item() == pytest.approx(1.25 / 1.5, abs=1e-12)
    # At q=3: alpha = 0.5^3*0.5 + 0.5^2*1 = 0.3125, beta = 0.5^3*0.5 + 0.5*1 = 0.5625.
    alpha, beta = t.pseudo_counts(["a"], event=3)
    assert (alpha.item(), beta.item()) == pytest.approx((0.3125, 0.5625), abs=1e-12)
    # The value only depends on which outcomes are visible, not on q itself.
    assert t.value(["a"], event=2).item() == pytest.approx(0.3125 / 0.875, abs=1e-12)
    assert t.value(["a"], event=1000).item() == pytest.approx(0.3125 / 0.875, abs=1e-12)
    # Evidence from event 2 has been folded: querying event 1 again cannot exclude it.
    with pytest.raises(ValueError, match="backwards"):
        t.value(["a"], event=1)


def test_event_prior_anchored_at_init_event():
    t = EventValueTracker()  # rho = 0.875
    t.init_from_counts(["p"], [3], [4], event=5)  # (5.6, 2.4) at event 5
    t.observe(["p"], [1.0], [7])
    # q=7: alpha = 0.875^2*5.6 + 1 = 5.2875, beta = 0.875^2*2.4 = 1.8375; q=8 multiplies both by 0.875.
    alpha, beta = t.pseudo_counts(["p"], event=7)
    assert (alpha.item(), beta.item()) == pytest.approx((5.2875, 1.8375), abs=1e-12)
    alpha, beta = t.pseudo_counts(["p"], event=8)
    assert (alpha.item(), beta.item()) == pytest.approx((4.6265625, 1.6078125), abs=1e-12)
    assert t.value(["p"], event=8).item() == pytest.approx(5.2875 / 7.125, abs=1e-12)


def test_event_prior_anchored_at_first_dispatch():
    """Issue 11 item 2: a prompt first drawn at round 40 starts from its full prior, not one aged by 0.875^40."""
    t = EventValueTracker()  # rho = 0.875
    t.value(["new"], event=40)
    t.enter(["new"], event=40)
    t.observe(["new"], [1.0], [40])
    # alpha_41 = 0.875*(0.5 + 1) = 1.3125, beta_41 = 0.875*0.5 = 0.4375: value 1.5 / 2 = 0.75 (the old code,
    # prior at event 0: (0.875^40*0.5 + 1) / (0.875^40 + 1) = 0.99774).
    alpha, beta = t.pseudo_counts(["new"], event=41)
    assert (alpha.item(), beta.item()) == pytest.approx((1.3125, 0.4375), abs=1e-12)
    assert t.value(["new"], event=41).item() == pytest.approx(0.75, abs=1e-12)
    # Its priority weight sqrt(v(1-v)) + 0.05 = sqrt(0.1875) + 0.05 = 0.48301, far from the floor 0.05 + 0.047.
    from trl_aspo.values.sampler import priority_weights

    assert priority_weights(t.value(["new"], event=41), 0.05).item() == pytest.approx(0.1875**0.5 + 0.05, abs=1e-9)
    # Entering again later leaves the anchored prior alone; an initialized prior keeps its own event.
    t.enter(["new"], event=45)
    assert t.value(["new"], event=45).item() == pytest.approx(0.75, abs=1e-12)
    t.init_from_counts(["file"], [1], [1], prior_strength=8.0, event=0)  # (6, 2) at the start of training
    t.enter(["file"], event=40)
    t.observe(["file"], [0.0], [40])
    # alpha_40 = 0.875^40 * 6 = 0.0288..., beta_40 = 0.875^40 * 2 + 1: the file's prior aged from the start.
    decay = 0.875**40
    assert t.value(["file"], event=40).item() == pytest.approx(6 * decay / (8 * decay + 1), abs=1e-12)
    # An unseen key's counts are the un-aged default prior at any event.
    alpha, beta = t.pseudo_counts(["unseen"], event=99)
    assert (alpha.item(), beta.item()) == (0.5, 0.5)


def test_default_prior_strength_follows_rho():
    assert default_prior_strength(0.875) == 8.0
    assert default_prior_strength(0.9) == pytest.approx(10.0, abs=1e-12)
    assert default_prior_strength(0.5) == 2.0
    with pytest.raises(ValueError, match="rho = 1"):
        default_prior_strength(1.0)


def _direct(outcomes, rho, q, prior=(0.5, 0.5)):
    """Independent evaluation of the SPO++ sums for one key (prior at event 0)."""
    alpha = rho**q * prior[0] + sum(rho ** (q - z) * r for z, r in outcomes if z <= q)
    beta = rho**q * prior[1] + sum(rho ** (q - z) * (1 - r) for z, r in outcomes if z <= q)
    return alpha, beta


def test_event_order_invariance_with_late_outcomes():
    rng = random.Random(0)
    keys = ["k0", "k1", "k2", "k3", "k4"]
    outcomes = [(rng.choice(keys), rng.randrange(50), rng.random()) for _ in range(300)]
    by_key = {k: [(z, r) for kk, z, r in outcomes if kk == k] for k in keys}

    for trial in range(5):
        order = outcomes[:] if trial == 0 else rng.sample(outcomes, len(outcomes))
        if trial == 0:
            order.sort(key=lambda o: o[1])  # synchronous arrival order
        t = EventValueTracker(rho=0.875)
        t.enter(keys, event=0)
        seen_max = last_q = 0
        i = 0
        while i < len(order):
            chunk = order[i : i + rng.randint(1, 20)]
            i += len(chunk)
            t.observe(
                [c[0] for c in chunk], torch.tensor([c[2] for c in chunk], dtype=torch.float64), [c[1] for c in chunk]
            )
            seen_max = max(seen_max, *(c[1] for c in chunk))
            # Interleaved (monotone) dispatches fold part of the evidence; late outcomes then arrive behind it.
            last_q = max(last_q, seen_max - rng.randrange(3))
            t.value(keys, event=last_q)
        for q in (49, 60):
            alpha, beta = t.pseudo_counts(keys, event=q)
            values = t.value(keys, event=q)
            for j, k in enumerate(keys):
                a_ref, b_ref = _direct(by_key[k], 0.875, q)
                assert alpha[j].item() == pytest.approx(a_ref, rel=1e-9, abs=1e-12)
                assert beta[j].item() == pytest.approx(b_ref, rel=1e-9, abs=1e-12)
                assert values[j].item() == pytest.approx(a_ref / (a_ref + b_ref), abs=1e-9)


def test_event_visibility_matches_truncated_sum():
    rng = random.Random(1)
    outcomes = [(rng.randrange(40), rng.random()) for _ in range(60)]
    t = EventValueTracker(rho=0.9)
    t.enter(["a"], event=0)
    shuffled = rng.sample(outcomes, len(outcomes))
    t.observe(["a"] * len(shuffled), [r for _, r in shuffled], [z for z, _ in shuffled])
    for q in (0, 10, 25, 39, 45):
        a_ref, b_ref = _direct(outcomes, 0.9, q)
        assert t.value(["a"], event=q).item() == pytest.approx(a_ref / (a_ref + b_ref), abs=1e-9)


def test_event_numerically_safe_over_1e5_events():
    t = EventValueTracker()
    n = 100_000
    t.init_from_counts(["init"], [1], [2])
    # One outcome per event for "a" (alternating rewards), delivered in chunks with dispatches in between.
    for start in range(0, n, 10_000):
        events = list(range(start, start + 10_000))
        t.observe(["a"] * len(events), [float(z % 2) for z in events], events)
        t.value(["a"], event=start + 10_000)
    t.observe(["late"], [1.0], [3])
    q = n + 5
    values = t.value(["a", "init", "late", "unseen"], event=q)
    assert torch.isfinite(values).all()
    # Geometric sums: last outcome (event n-1, odd -> R=1) has weight 1 at the reference event.
    assert values[0].item() == pytest.approx(1 / (1 + 0.875), abs=1e-9)
    assert values[1].item() == pytest.approx(1.5 / 3, abs=1e-12)  # prior ratio survives total underflow
    # "late" enters at its outcome's event 3: prior and outcome age together, (0.5 + 1) / (1 + 1).
    assert values[2].item() == pytest.approx(0.75, abs=1e-12)
    assert values[3].item() == 0.5
    alpha, beta = t.pseudo_counts(["a", "init"], event=q)
    assert torch.isfinite(alpha).all() and torch.isfinite(beta).all()
    assert alpha[1].item() == 0.0  # 0.875^(1e5) underflows to 0 instead of overflowing anywhere


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_observe_rejects_bad_rewards_naming_value_and_key(bad):
    for tracker, extra in ((EventValueTracker(), ([0, 0],)), (VisitValueTracker(), (0.875,))):
        with pytest.raises(ValueError, match=rf"{bad}.*'key-b'|filter") as info:
            tracker.observe(["key-a", "key-b"], torch.tensor([1.0, bad]), *extra)
        assert "key-b" in str(info.value)
        if math.isnan(bad):
            assert "filter" in str(info.value)
        assert tracker.num_tracked == 0  # validation happens before any update


def test_observe_rejects_none_and_length_mismatch():
    with pytest.raises(ValueError, match="None.*filter"):
        VisitValueTracker().observe(["a"], [None], 0.875)
    with pytest.raises(ValueError, match="rewards"):
        VisitValueTracker().observe(["a", "b"], torch.tensor([1.0]), 0.875)
    with pytest.raises(ValueError, match="events"):
        EventValueTracker().observe(["a", "b"], torch.tensor([1.0, 0.0]), [0])
    with pytest.raises(ValueError, match="events"):
        EventValueTracker().observe(["a"], torch.tensor([1.0]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="event"):
        EventValueTracker().observe(["a"], torch.tensor([1.0]), [-1])
    with pytest.raises(ValueError, match="rho"):
        VisitValueTracker().observe(["a"], torch.tensor([1.0]), 1.5)
    with pytest.raises(ValueError, match="rho"):
        EventValueTracker(rho=0.0)


def _populated():
    e = EventValueTracker(rho=0.9)
    e.init_from_counts(["p"], [2], [3], event=1)
    e.observe(["p", "q", "q"], [1.0, 0.3, 0.0], [2, 4, 1])
    e.value(["q"], event=2)  # folds q's event-1 outcome, leaves event 4 pending
    v = VisitValueTracker()
    v.observe(["p", "q"], [1.0, 0.25], torch.tensor([0.9, 0.95]))
    return e, v


def test_state_dict_round_trip_json_and_torch(tmp_path):
    e, v = _populated()
    keys = ["p", "q", "new"]
    for tracker, args, cls in ((e, (6,), EventValueTracker), (v, (), VisitValueTracker)):
        sd = tracker.state_dict()
        restored_json = cls()
        restored_json.load_state_dict(json.loads(json.dumps(sd)))
        torch.save(sd, tmp_path / "tracker.pt")
        restored_pt = cls()
        restored_pt.load_state_dict(torch.load(tmp_path / "tracker.pt"))
        for restored in (restored_json, restored_pt):
            assert restored.state_dict() == sd
            assert torch.equal(restored.value(keys, *args), tracker.value(keys, *args))
            assert restored.num_tracked == tracker.num_tracked
    assert EventValueTracker().state_dict()["rho"] == 0.875
    with pytest.raises(ValueError, match="EventValueTracker"):
        EventValueTracker().load_state_dict(v.state_dict())


# ------------------------------------------------------------------------------------------------ KL-adaptive rho


def test_logprob_drift_and_kl_adaptive_rho_hand_numbers():
    stored = torch.zeros(4, 2)
    now = torch.tensor(
        [
            [-0.004, -0.008],  # D = 0.006 -> 2^-0.1 = 0.93303...
            [0.003, -0.009],  # |.| mean = 0.006 as well
            [0.0, 0.0],  # D = 0 -> 1, clipped to rho_max
            [-0.06, float("nan")],  # second token masked out: D = 0.06 -> 0.5, clipped to rho_min
        ]
    )
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    drift = logprob_drift(stored, now, mask)
    assert drift.dtype == torch.float64 and drift.tolist() == pytest.approx([0.006, 0.006, 0.0, 0.06], abs=1e-7)
    rho = kl_adaptive_rho(drift)
    assert rho.shape == (4,)
    assert rho.tolist() == pytest.approx([0.9330329915368074, 0.9330329915368074, 0.96, 0.875], abs=1e-6)
    # No masked tokens: D = 0 -> rho_max; custom bounds and half-life.
    drift = logprob_drift(stored[:2], now[:2], torch.tensor([[0, 0], [1, 1]]))
    assert kl_adaptive_rho(drift, d_half=0.006, rho_min=0.1).tolist() == pytest.approx([0.96, 0.5], abs=1e-6)
    with pytest.raises(ValueError, match="shape"):
        logprob_drift(stored, now[:, :1], mask)
    with pytest.raises(ValueError, match="rho_min"):
        kl_adaptive_rho(drift, rho_min=0.99, rho_max=0.9)


# ---------------------------------------------------------------------------------------------------- prompt keys


def test_prompt_key_stable_and_canonical():
    chat = [{"role": "user", "content": "What is 2+2?"}]
    reordered = [{"content": "What is 2+2?", "role": "user"}]
    # Pinned values: keys must never change across versions, processes or restarts (saved trackers use them);
    # pytest runs with a random PYTHONHASHSEED, so a match also shows Python's salted hash() is not involved.
    assert prompt_key("What is 2+2?") == "336030409b1cf27b6a4bdd2e215ac32e"
    assert prompt_key(chat) == "25c44609a343cb4158af6e2e742ca22a"
    assert prompt_key(reordered) == prompt_key(chat)
    assert prompt_key("What is 2+2?") != prompt_key(["What is 2+2?"])
    with pytest.raises(ValueError, match="column"):
        prompt_key(object())


def test_prompt_keys_column_and_hash():
    rows = [{"prompt": "a", "id": 7}, {"prompt": [{"role": "user", "content": "b"}], "id": "x"}]
    assert prompt_keys(rows, column="id") == ["7", "x"]
    assert prompt_keys(rows) == [prompt_key("a"), prompt_key([{"role": "user", "content": "b"}])]
    with pytest.raises(ValueError, match="'uid'"):
        prompt_keys(rows, column="uid")
    with pytest.raises(ValueError, match="'prompt'"):
        prompt_keys([{"question": "a"}])
