"""A registry name is held by one definition: running that definition again (a notebook cell run twice, a module
reloaded) replaces its registration, and another function under the name is refused, naming both."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from trl_aspo.algorithms import register_advantage_estimator, register_policy_loss
from trl_aspo.algorithms.advantage_estimators import get_advantage_estimator, unregister_advantage_estimator
from trl_aspo.algorithms.policy_losses import get_policy_loss, unregister_policy_loss
from trl_aspo.algorithms.registration import is_redefinition

USER_MODULE = """
import torch
from trl_aspo.algorithms import register_advantage_estimator, register_policy_loss


@register_policy_loss("reloaded_loss")
def reloaded_loss(inputs):
    return -inputs.advantages[:, None] * inputs.log_probs * {scale}


@register_advantage_estimator("reloaded_estimator")
def reloaded_estimator(rewards, group_ids, scorable):
    return rewards * {scale}
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "my_methods.py"
    path.write_text(USER_MODULE.format(scale=1.0))
    yield path
    sys.modules.pop("my_methods", None)
    unregister_policy_loss("reloaded_loss")
    unregister_advantage_estimator("reloaded_estimator")


def test_a_reloaded_module_replaces_its_own_registrations(user_module):
    module = importlib.import_module("my_methods")
    user_module.write_text(USER_MODULE.format(scale=2.0))
    reloaded = importlib.reload(module)

    assert get_policy_loss("reloaded_loss").fn is reloaded.reloaded_loss
    assert get_advantage_estimator("reloaded_estimator").estimate is reloaded.reloaded_estimator
    rewards = torch.tensor([1.0, 3.0])
    estimated = get_advantage_estimator("reloaded_estimator")(
        rewards, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool)
    )
    assert estimated.tolist() == [2.0, 6.0]


def test_another_function_under_a_registered_name_is_refused_naming_both(user_module):
    importlib.import_module("my_methods")

    def another(inputs):
        return inputs.log_probs

    with pytest.raises(
        ValueError,
        match=r"register_policy_loss\('reloaded_loss'\): a policy loss of that name is already registered "
        r"\(my_methods\.reloaded_loss\); register .*test_registration\..*another under another name",
    ):
        register_policy_loss("reloaded_loss")(another)
    with pytest.raises(
        ValueError, match=r"register_advantage_estimator\('reloaded_estimator'\): .* already registered"
    ):
        register_advantage_estimator("reloaded_estimator")(lambda rewards, group_ids, scorable: rewards)
    assert get_policy_loss("reloaded_loss").fn.__module__ == "my_methods"


def test_a_built_in_name_is_not_taken_by_a_look_alike():
    def aspo(inputs):
        return inputs.log_probs

    with pytest.raises(ValueError, match=r"register_policy_loss\('aspo'\): a policy loss of that name is already"):
        register_policy_loss("aspo")(aspo)


def test_only_callables_are_registered():
    with pytest.raises(ValueError, match=r"register_policy_loss\('not_a_function'\) decorates a function, got 3"):
        register_policy_loss("not_a_function")(3)
    assert get_policy_loss("not_a_function") is None


def test_is_redefinition():
    def first():
        pass

    def second():
        pass

    assert is_redefinition(first, first)
    assert not is_redefinition(None, first)
    assert not is_redefinition(first, second)
    assert not is_redefinition(first, lambda: None)


def test_a_loss_cut_off_from_the_log_probs_is_refused_when_it_runs():
    from trl_aspo.algorithms import PolicyLossInputs

    register_policy_loss("detached_loss")(lambda inputs: -inputs.advantages[:, None] * inputs.log_probs.detach())
    try:
        log_probs = torch.zeros(2, 3, requires_grad=True)
        inputs = PolicyLossInputs(log_probs, log_probs.detach(), torch.ones(2), torch.ones(2, 3), None)
        with pytest.raises(
            ValueError, match=r"policy loss 'detached_loss' returned a per-token loss with no gradient"
        ):
            get_policy_loss("detached_loss")(inputs)
        with torch.no_grad():  # evaluation-time calls have nothing to differentiate
            loss, _ = get_policy_loss("detached_loss")(
                PolicyLossInputs(log_probs.detach(), log_probs.detach(), torch.ones(2), torch.ones(2, 3), None)
            )
        assert loss.tolist() == [[-0.0] * 3] * 2
    finally:
        unregister_policy_loss("detached_loss")


def _bad_complex_loss(inputs):
    return (-inputs.advantages[:, None] * inputs.log_probs).to(torch.complex64)


def _bad_meta_loss(inputs):
    return torch.zeros(inputs.log_probs.shape, device="meta")


def _bad_list_stats(inputs):
    return -inputs.advantages[:, None] * inputs.log_probs, [inputs.log_probs.detach()]


def _bad_three_items(inputs):
    return -inputs.advantages[:, None] * inputs.log_probs, {}, "extra"


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            _bad_complex_loss,
            r"must return a real floating per-token loss on the log-probs' device cpu; got dtype "
            r"torch.complex64 on cpu \(registered from test_registration._bad_complex_loss\)",
        ),
        (
            _bad_meta_loss,
            r"must return .* got dtype torch.float32 on meta \(registered from test_registration._bad_meta_loss\)",
        ),
        (
            _bad_list_stats,
            r"must return its stats as a dict \{name: per-token tensor\}; got list \(registered from "
            r"test_registration._bad_list_stats\)",
        ),
        (_bad_three_items, r"must return a per-token loss or \(per-token loss, stats\); got 3 items"),
    ],
    ids=["complex", "meta", "stats-list", "three-items"],
)
def test_a_loss_plugins_bad_output_is_refused_naming_it(fn, message):
    """Issue 45 item 7: a complex or meta-device loss, or stats as a list, ended in raw errors naming no plugin."""
    from trl_aspo.algorithms import PolicyLossInputs

    register_policy_loss("bad_output_loss")(fn)
    try:
        log_probs = torch.zeros(2, 3, requires_grad=True)
        inputs = PolicyLossInputs(log_probs, log_probs.detach(), torch.ones(2), torch.ones(2, 3), None)
        with pytest.raises(ValueError, match=r"policy loss 'bad_output_loss' " + message):
            get_policy_loss("bad_output_loss")(inputs)
    finally:
        unregister_policy_loss("bad_output_loss")


def _complex_estimator(rewards, group_ids, scorable):
    return (rewards - rewards.mean()).to(torch.complex128) * 1j


def _huge_estimator(rewards, group_ids, scorable):
    return torch.full_like(rewards, 1e39)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            _complex_estimator,
            r"must return a real floating tensor on the rewards' device cpu; got dtype "
            r"torch.complex128 on cpu \(registered from test_registration._complex_estimator\)",
        ),
        # 1e39 is finite in float64 (the rewards' dtype here) and inf in float32, the loss's precision.
        (
            _huge_estimator,
            r"returned advantages that are not finite in float32, the loss's precision: 2 of 2, e.g. "
            r"1e\+39 for reward 1.0 \(sample 0\) \(registered from test_registration._huge_estimator\)",
        ),
    ],
    ids=["complex", "1e39"],
)
def test_an_estimator_plugins_bad_output_is_refused_naming_it(fn, message):
    register_advantage_estimator("bad_output_estimator")(fn)
    try:
        rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
        with pytest.raises(ValueError, match=r"advantage estimator 'bad_output_estimator' " + message):
            get_advantage_estimator("bad_output_estimator")(
                rewards, torch.zeros(2, dtype=torch.long), torch.ones(2).bool()
            )
    finally:
        unregister_advantage_estimator("bad_output_estimator")


def test_an_estimators_arithmetic_is_kept_in_the_rewards_dtype():
    """The float32 check does not round: a float64 advantage comes back exactly."""
    register_advantage_estimator("exact_estimator")(lambda rewards, group_ids, scorable: rewards * (1 + 2**-40))
    try:
        rewards = torch.tensor([1.0, 0.5], dtype=torch.float64)
        advantages = get_advantage_estimator("exact_estimator")(rewards, torch.zeros(2).long(), torch.ones(2).bool())
        assert advantages.dtype == torch.float64 and advantages.tolist() == [1 + 2**-40, 0.5 * (1 + 2**-40)]
    finally:
        unregister_advantage_estimator("exact_estimator")
