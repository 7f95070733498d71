"""SPO++'s runtime without a trainer: `DispatchControl` (in flight per prompt, hold and drain), the prioritized draw
among eligible rows, and the config's and trainer's refusals by name."""

from __future__ import annotations

import pytest
import torch

from trl_aspo.infra.dispatch_control import DispatchControl
from trl_aspo.infra.prompt_stream import PromptPriorities


def test_a_prompt_in_flight_is_not_eligible_until_scored():
    control = DispatchControl(["a", "b", "a"], limit=1)  # rows 0 and 2 share a prompt
    assert control.try_dispatch(0, 1)
    assert control.eligible_rows().tolist() == [False, True, False]
    assert control.try_dispatch(1, 1) and not control.may_dispatch()
    control.finished()  # generation done, not yet scored: still in flight
    assert not control.may_dispatch()
    control.scored(0, 1)
    assert control.eligible_rows().tolist() == [True, False, True] and control.may_dispatch()
    assert [control.row_eligible(row) for row in range(3)] == [True, False, True]


def test_unlimited_counts_only_what_is_generating():
    control = DispatchControl(["a", "b"])
    assert control.try_dispatch(0, 4) and control.eligible_rows().all()
    assert control.active == 4


def test_a_held_dispatch_backs_off_and_the_drain_waits_for_the_announced():
    control = DispatchControl(["a", "b"], limit=1)
    assert control.try_dispatch(0, 1)
    control.hold()
    assert not control.try_dispatch(1, 1)  # backs off: nothing recorded
    assert control.active == 1 and control.eligible_rows().tolist() == [False, True] and not control.may_dispatch()
    with pytest.raises(RuntimeError, match="drain_on_publish=True: 1 conversation"):
        control.drain(timeout_s=0.02)
    control.finished()
    control.drain(timeout_s=0.02)  # returns at once
    control.release()
    assert control.may_dispatch()


def test_bad_limits_are_refused():
    for limit in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="`limit` must be an integer >= 1 or None"):
            DispatchControl(["a"], limit=limit)


def test_the_prioritized_draw_is_conditioned_on_eligibility():
    priorities = PromptPriorities(torch.tensor([0.5, 0.5, 0.5]), seed=3)
    eligible = torch.tensor([True, False, True])
    draws = [priorities.draw(g, eligible) for g in range(300)]
    assert 1 not in draws and {0, 2} <= set(draws)
    only = torch.tensor([False, True, False])
    assert {priorities.draw(g, only) for g in range(20)} == {1}
    # Without a mask, the draw of a group is what it always was.
    assert [priorities.draw(g) for g in range(20)] == [priorities.draw(g, None) for g in range(20)]


def runtime_config(tmp_path, **fields):
    from trl_aspo import AsyncASPOConfig

    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=1,
        use_cpu=True,
        report_to="none",
        advantage_estimator="spo++",
        token_budget=0,
    )
    return AsyncASPOConfig(**{**base, **fields})


def test_one_in_flight_needs_one_completion_per_prompt(tmp_path):
    with pytest.raises(ValueError, match=r"max_inflight_per_prompt=1 is invalid.*num_generations=1 \(got num_gen"):
        runtime_config(tmp_path, max_inflight_per_prompt=1, num_generations=2, advantage_estimator="group")
    with pytest.raises(ValueError, match=r"max_inflight_per_prompt=0 is invalid: must lie in \[1"):
        runtime_config(tmp_path, max_inflight_per_prompt=0)


def test_the_runtime_is_refused_with_a_worker_that_has_no_loop_by_name():
    """A worker exposing neither TRL's loop nor the local one cannot hold or count dispatches: refused naming both
    fields and the worker's class."""
    from trl_aspo.infra.prompt_stream import attach_dispatch_control
    from trl_aspo.infra.replay import ReplayRolloutWorker

    with pytest.raises(TypeError, match=r"max_inflight_per_prompt and drain_on_publish .* got a ReplayRolloutWorker"):
        attach_dispatch_control(ReplayRolloutWorker([]), DispatchControl(["a", "b"], 1))
