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
