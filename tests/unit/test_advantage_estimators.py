"""The advantage-estimator registry (trl_aspo.algorithms.advantage_estimators): `group` against a hand computation,
the tracker estimators' entries, registration and lookup refusals, bad inputs, and the config rules that ask the
registry instead of naming an estimator."""

from __future__ import annotations

import re

import pytest
import torch

from trl_aspo.algorithms import get_advantage_estimator, register_advantage_estimator, registered_advantage_estimators
from trl_aspo.algorithms.advantage_estimators import register_tracker_estimator, unregister_advantage_estimator
from trl_aspo.algorithms.papers import SPO_PAPER, SPO_PLUS_PLUS_PAPER
from trl_aspo.config.aspo_config import ASPOConfig
from trl_aspo.values import AsyncEventValues, EventValueTracker, VisitValueTracker

NAN = float("nan")


def group(rewards, group_ids, scorable=None):
    rewards = torch.tensor(rewards, dtype=torch.float64)
    scorable = ~torch.isnan(rewards) if scorable is None else torch.tensor(scorable)
    return get_advantage_estimator("group")(rewards, torch.tensor(group_ids, dtype=torch.long), scorable)


def test_group_is_the_reward_minus_the_mean_of_the_scorable_members_of_its_group():
    # Group 7: 1, 0, 0.5 -> mean 0.5. Group 3: 1, (unscored), 0.2 -> mean 0.6 over the two scored members.
    advantages = group([1.0, 0.0, 0.5, 1.0, NAN, 0.2], [7, 7, 7, 3, 3, 3])
    assert advantages.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.4, 0.0, -0.4], abs=1e-15)


def test_group_members_need_not_be_consecutive_and_a_group_without_a_scored_member_is_zero():
    # Group 1 = rows 0 and 2 (mean 2), group 2 = rows 1 and 3 (no scored member).
    assert group([3.0, NAN, 1.0, NAN], [1, 2, 1, 2]).tolist() == [1.0, 0.0, -1.0, 0.0]
    assert group([], []).tolist() == []


def test_built_in_entries():
    assert registered_advantage_estimators()[:3] == ("group", "spo", "spo++")
    grouped, spo, spo_plus_plus = (get_advantage_estimator(name) for name in ("group", "spo", "spo++"))
    assert grouped.computed_by_trl and not grouped.tracks_values and not grouped.allows_single_completion
    assert grouped.default_normalization == "group" and grouped.papers == ()
    assert spo.tracks_values and spo.allows_single_completion and spo.per_visit_forgetting
    assert (spo.default_normalization, spo.papers) == ("batch", (SPO_PAPER,))
    assert spo_plus_plus.tracks_values and not spo_plus_plus.per_visit_forgetting
    assert (spo_plus_plus.default_normalization, spo_plus_plus.papers) == ("token", (SPO_PLUS_PLUS_PAPER, SPO_PAPER))
    args = ASPOConfig("out", use_cpu=True, advantage_estimator="spo++", num_generations=1, value_rho=0.5)
    assert isinstance(spo.make_tracker(args, False), VisitValueTracker)
    assert isinstance(spo.make_tracker(args, True), VisitValueTracker)
    synchronous, asynchronous = spo_plus_plus.make_tracker(args, False), spo_plus_plus.make_tracker(args, True)
    assert isinstance(synchronous, EventValueTracker) and isinstance(asynchronous, AsyncEventValues)
    assert synchronous.rho == asynchronous.rho == 0.5
    with pytest.raises(ValueError, match="advantage estimator 'spo' is a value tracker's"):
        spo(torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))


@pytest.fixture
def leave_one_out():
    """`rloo` for the test: A_i = R_i - mean of the other scored members of i's group (0 alone)."""

    @register_advantage_estimator("rloo_test")
    def rloo(rewards, group_ids, scorable):
        same = (group_ids[:, None] == group_ids[None, :]) & scorable[None, :]
        same.fill_diagonal_(False)
        others = torch.where(same, rewards[None, :], torch.zeros_like(rewards)[None, :]).sum(1)
        count = same.sum(1)
        return torch.where(count > 0, rewards - others / count.clamp_min(1), torch.zeros_like(rewards))

    yield rloo
    unregister_advantage_estimator("rloo_test")


def test_a_registered_estimator_is_looked_up_and_its_unscored_rows_are_zero(leave_one_out):
    entry = get_advantage_estimator("rloo_test")
    assert entry.estimate is leave_one_out and entry.default_normalization == "batch"
    rewards = torch.tensor([1.0, 0.0, 0.5, NAN])
    scorable = ~torch.isnan(rewards)
    # Others' means: (0 + .5) / 2, (1 + .5) / 2, (1 + 0) / 2; the unscored row (whose "others" give 0.5) gets 0.
    expected = [1 - 0.25, 0 - 0.75, 0.5 - 0.5, 0.0]
    assert entry(rewards, torch.zeros(4, dtype=torch.long), scorable).tolist() == pytest.approx(expected)
    assert "rloo_test" in registered_advantage_estimators()


def test_a_name_already_registered_is_refused_naming_it(leave_one_out):
    for name in ("group", "spo++", "rloo_test"):
        with pytest.raises(
            ValueError, match=rf"register_advantage_estimator\('{re.escape(name)}'\): .* already registered"
        ):
            register_advantage_estimator(name)(lambda rewards, group_ids, scorable: rewards)
    with pytest.raises(ValueError, match=r"register_advantage_estimator\('spo'\): .* already registered"):
        register_tracker_estimator("spo", lambda args, asynchronous: None, default_normalization="batch")
    assert get_advantage_estimator("rloo_test").estimate is leave_one_out  # the first registration stands


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("", {}, "the name must be a non-empty string without spaces, got ''"),
        ("two words", {}, "the name must be a non-empty string without spaces"),
        (
            "mine",
            {"default_normalization": "group"},
            r"default_normalization='group' must be one of \('batch', 'token'\)",
        ),
    ],
)
def test_bad_registrations_are_refused(name, options, message):
    with pytest.raises(ValueError, match=message):
        register_advantage_estimator(name, **options)(lambda rewards, group_ids, scorable: rewards)
    assert name not in registered_advantage_estimators()


def test_an_unknown_name_is_refused_with_the_registered_names():
    with pytest.raises(ValueError, match=r"advantage_estimator='rloo' is not registered; registered: \('group', "):
        get_advantage_estimator("rloo")


GOOD = {"rewards": torch.zeros(2), "group_ids": torch.zeros(2, dtype=torch.long), "scorable": torch.ones(2).bool()}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"rewards": torch.zeros(2, 1)}, r"`rewards` must be a 1-D tensor \(N,\), got \(2, 1\)"),
        ({"rewards": [0.0, 1.0]}, r"`rewards` must be a 1-D tensor \(N,\), got list"),
        ({"group_ids": torch.zeros(3, dtype=torch.long)}, "must have one length, got 2, 3 and 2"),
        ({"rewards": torch.zeros(2, dtype=torch.long)}, "`rewards` must be a floating tensor, got torch.int64"),
        ({"group_ids": torch.zeros(2)}, "`group_ids` must be an integer tensor, got torch.float32"),
        ({"scorable": torch.ones(2, dtype=torch.long)}, "`scorable` must be a bool tensor, got torch.int64"),
        ({"rewards": torch.tensor([NAN, 0.0])}, "`rewards` must be finite wherever `scorable` is True"),
    ],
)
def test_bad_inputs_are_refused(bad, message):
    inputs = {**GOOD, **bad}
    with pytest.raises(ValueError, match=message):
        get_advantage_estimator("group")(inputs["rewards"], inputs["group_ids"], inputs["scorable"])


def test_an_estimator_returning_the_wrong_shape_is_named():
    register_advantage_estimator("broken_test")(lambda rewards, group_ids, scorable: rewards[:1])
    try:
        with pytest.raises(
            ValueError, match=r"advantage estimator 'broken_test' must return one advantage per reward"
        ):
            get_advantage_estimator("broken_test")(
                torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2).bool()
            )
    finally:
        unregister_advantage_estimator("broken_test")


# ------------------------------------------------------------------------------------- the config asks the entry
def config(**fields):
    return ASPOConfig("out", use_cpu=True, **fields)


def test_a_registered_estimator_is_a_valid_choice_with_its_default_normalization(leave_one_out):
    from trl_aspo.config.async_config import AsyncASPOConfig

    assert config(advantage_estimator="rloo_test").advantage_normalization == "batch"
    asynchronous = AsyncASPOConfig("out", use_cpu=True, token_budget=0, advantage_estimator="rloo_test")
    assert asynchronous.advantage_normalization == "batch" and asynchronous.scores_on_trainer
    assert config(advantage_estimator="rloo_test", filter_zero_variance_groups=True).filter_zero_variance_groups


def test_what_a_registered_group_estimator_cannot_do_is_refused_naming_the_field(leave_one_out):
    with pytest.raises(ValueError, match=r"advantage_normalization='group' is invalid: 'group' is TRL's own scaling"):
        config(advantage_estimator="rloo_test", advantage_normalization="group")
    with pytest.raises(ValueError, match=r"num_generations=1 is invalid: advantage_estimator='rloo_test' needs at"):
        config(advantage_estimator="rloo_test", num_generations=1, per_device_train_batch_size=8)
    with pytest.raises(ValueError, match=r"value_rho_mode='kl'"):
        config(advantage_estimator="rloo_test", value_rho_mode="kl")
    with pytest.raises(ValueError, match=r"advantage_estimator='rloo' is invalid: must be one of \('group', 'spo'"):
        config(advantage_estimator="rloo")


def test_the_tracker_rules_follow_the_entries():
    assert config(advantage_estimator="spo", num_generations=1, per_device_train_batch_size=8).num_generations == 1
    assert config(advantage_estimator="spo", value_rho_mode="kl").value_rho_mode == "kl"
    with pytest.raises(ValueError, match="value_rho_mode"):
        config(advantage_estimator="spo++", value_rho_mode="kl")
    with pytest.raises(ValueError, match="filter_zero_variance_groups"):
        config(advantage_estimator="spo", filter_zero_variance_groups=True)
