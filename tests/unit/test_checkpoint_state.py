"""Checkpoint state: a format that cannot run code (JSON and tensors), and validation on load with the file, field and
key named (the trainers' resumes: tests/integration/test_checkpoint_state_trainer.py)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from trl_aspo.trainers.checkpoint_state import (
    STATE_JSON,
    STATE_TENSORS,
    checkpoint_state_file,
    load_checkpoint_state,
    save_checkpoint_state,
)
from trl_aspo.values import EventValueTracker, VisitValueTracker
from trl_aspo.values.event_values import AsyncEventValues

# ---------------------------------------------------------------- format


def test_any_nested_state_round_trips(tmp_path):
    state = {
        "value_event": 3,
        "aspo_kl_coef": 0.5,
        "extra": {  # not a part a resume restores, so only the format applies (a tracker is checked by its kind)
            "type": "Notes",
            "flag": True,
            "nothing": None,
            "state": {"key": [0.25, 1.5, 2]},
            "completions": [torch.tensor([1, 2, 3]), {"logps": torch.tensor([[-0.5, -1.25]], dtype=torch.float64)}],
        },
    }
    save_checkpoint_state(str(tmp_path), state)
    assert sorted(os.listdir(tmp_path)) == [STATE_JSON, STATE_TENSORS]
    loaded = load_checkpoint_state(str(tmp_path))
    tensors = loaded["extra"].pop("completions")
    expected = state["extra"].pop("completions")
    assert loaded == state
    assert torch.equal(tensors[0], expected[0]) and tensors[0].dtype == torch.int64
    assert torch.equal(tensors[1]["logps"], expected[1]["logps"]) and tensors[1]["logps"].dtype == torch.float64


def test_state_without_tensors_writes_only_json(tmp_path):
    save_checkpoint_state(str(tmp_path), {"value_event": 0, "aspo_kl_coef": 0.0})
    assert os.listdir(tmp_path) == [STATE_JSON]


def test_unstorable_values_are_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match="tracker/x holds a set"):
        save_checkpoint_state(str(tmp_path), {"tracker": {"x": {1, 2}}})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- item 14: validated on load, the file named


def test_truncated_and_corrupt_files_are_refused_naming_the_file(tmp_path):
    save_checkpoint_state(str(tmp_path), {"value_event": 1, "aspo_kl_coef": 0.0, "tracker": {"t": torch.ones(4)}})
    tensors = tmp_path / STATE_TENSORS
    tensors.write_bytes(tensors.read_bytes()[:-5])
    with pytest.raises(ValueError, match=rf"checkpoint state {tensors} cannot be read \(truncated or corrupt\?\)"):
        load_checkpoint_state(str(tmp_path))
    document = tmp_path / STATE_JSON
    document.write_text(document.read_text()[:-7])
    with pytest.raises(
        ValueError, match=rf"checkpoint state: {document} is not valid JSON \(truncated or corrupt\?\)"
    ):
        load_checkpoint_state(str(tmp_path))
    document.unlink()
    document.symlink_to("/dev/zero")  # read without a bound, it would fill the memory
    with pytest.raises(ValueError, match=rf"checkpoint state: {document} is a character device, not a regular file"):
        load_checkpoint_state(str(tmp_path))
    document.unlink()
    document.write_text("[]")
    with pytest.raises(ValueError, match=rf"checkpoint state {document} is not a trl-aspo state"):
        load_checkpoint_state(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="holds no trl-aspo state"):
        load_checkpoint_state(str(tmp_path / "elsewhere"))


def test_an_aspo_state_pt_alone_is_no_state(tmp_path):
    """The pickle of unreleased builds is never opened: a folder holding only it has no state, like an empty one."""
    (tmp_path / "aspo_state.pt").write_bytes(b"\x80\x02truncated")
    assert checkpoint_state_file(str(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path} holds no trl-aspo state \(aspo_state\.json\)\.$"):
        load_checkpoint_state(str(tmp_path))


# ---------------------------------------------------------------- issue 17 item 11: every tracker checked on load


def _tracker_state(kind: str) -> dict:
    """A small saved state of each tracker kind, with an entry for every field its check reads."""
    if kind == "spo++":
        tracker = EventValueTracker(0.875)
        tracker.enter(["a", "b"], 0)
        tracker.observe(["a", "b"], [1.0, 0.0], [0, 1])  # b's outcome stays pending (event 1 > its event 0)
    elif kind == "spo":
        tracker = VisitValueTracker()
        tracker.observe(["a", "b"], [1.0, 0.25], 0.9)
    else:
        tracker = AsyncEventValues(0.875)
        tracker.enter(["a", "b"], [0, 1])
        tracker.observe(["a", "b"], [1.0, 0.5], [0, 2])
        tracker.advance(1)  # a's outcome at version 0 is folded, b's at 2 stays in the window
    return {"value_event": 3, "aspo_kl_coef": 0.0, "tracker": tracker.state_dict()}


def _saved_tracker(tmp_path, kind: str, change) -> str:
    """Save a `kind` state through `save_checkpoint_state`, apply `change` to the JSON tracker, return the file."""
    save_checkpoint_state(str(tmp_path), _tracker_state(kind))
    path = tmp_path / STATE_JSON
    document = json.loads(path.read_text())
    change(document["state"]["tracker"])
    path.write_text(json.dumps(document))  # NaN and inf are written as JSON's NaN / Infinity
    return str(path)


def _put(*path_and_value):
    *where, value = path_and_value

    def change(tracker):
        target = tracker
        for step in where[:-1]:
            target = target[step]
        target[where[-1]] = value

    return change


TRACKER_CASES = {
    # SPO++ (EventValueTracker): [alpha, beta, event] per key, pending [event, reward], visits.
    "spo++ negative alpha": ("spo++", _put("state", "a", 0, -1.0), r"tracker.state of prompt key 'a': pseudo-counts "),
    "spo++ zero counts": ("spo++", _put("state", "a", [0.0, 0.0, 0]), r"alpha=0\.0, beta=0\.0 must be finite"),
    "spo++ nan beta": ("spo++", _put("state", "a", 1, math.nan), "non-finite number nan"),
    "spo++ inf alpha": ("spo++", _put("state", "a", 0, math.inf), "non-finite number inf"),
    "spo++ string alpha": ("spo++", _put("state", "a", 0, "0.5"), r"alpha='0\.5', beta=.* must be finite numbers"),
    "spo++ short entry": ("spo++", _put("state", "a", [0.5, 0.5]), r"must be \[alpha, beta, event\], got \[0\.5"),
    "spo++ float event": ("spo++", _put("state", "a", 2, 1.5), r"'a': event must be an integer in \[0, 3\], got 1\.5"),
    "spo++ event past the counter": (
        "spo++",
        _put("state", "a", 2, 4),
        r"event must be an integer in \[0, 3\], got 4",
    ),
    "spo++ pending reward 1.5": ("spo++", _put("pending", "b", 0, 1, 1.5), r"pending of prompt key 'b': reward 1\.5"),
    "spo++ pending reward -0.5": ("spo++", _put("pending", "b", 0, 1, -0.5), r"'b': reward -0\.5 must be"),
    "spo++ pending not later": ("spo++", _put("pending", "b", 0, 0, 0), r"outcome event 0 must be later than"),
    "spo++ visits 1e30": ("spo++", _put("visits", "a", 1e30), r"visits of prompt key 'a' must be an integer .*1e\+30"),
    "spo++ visits 10**30": ("spo++", _put("visits", "a", 10**30), r"visits of prompt key 'a' must be an integer"),
    "spo++ negative visits": ("spo++", _put("visits", "a", -1), r"visits of prompt key 'a' must be an integer"),
    "spo++ rho 0": ("spo++", _put("rho", 0.0), r"tracker.rho must be a number in \(0, 1\], got 0\.0"),
    "spo++ state not a mapping": ("spo++", _put("state", [1, 2]), r"tracker.state must map prompt keys"),
    "unknown tracker type": ("spo++", _put("type", "Other"), r"tracker.type must be one of .*got 'Other'"),
    # SPO (VisitValueTracker): [alpha, beta] per key, visits.
    "spo negative beta": ("spo", _put("state", "b", 1, -0.5), r"tracker.state of prompt key 'b': pseudo-counts"),
    "spo zero counts": ("spo", _put("state", "b", [0.0, 0.0]), r"alpha=0\.0, beta=0\.0"),
    "spo nan alpha": ("spo", _put("state", "a", 0, math.nan), "non-finite number nan"),
    "spo visits 1e30": ("spo", _put("visits", "b", 1e30), r"visits of prompt key 'b' must be an integer"),
    "spo visits as text": ("spo", _put("visits", "b", "1"), r"visits of prompt key 'b' must be an integer .*'1'"),
    # Async SPO++ (AsyncEventValues): prior, folded aggregate, window, horizon, visits.
    "async negative prior": ("async", _put("prior", "a", 0, -2.0), r"tracker.prior of prompt key 'a': pseudo-counts"),
    "async zero prior": ("async", _put("prior", "b", [0.0, 0.0, 1]), r"tracker.prior of prompt key 'b'.*alpha=0\.0"),
    "async inf folded": ("async", _put("folded", "a", 0, math.inf), "non-finite number inf"),
    "async folded negative": ("async", _put("folded", "a", 1, -1.0), r"tracker.folded of prompt key 'a'"),
    "async folded not older": ("async", _put("folded", "a", 2, 1), r"version 1 must be older than the horizon 1"),
    "async window reward 1.5": ("async", _put("window", "b", 0, 1, 1.5), r"window of prompt key 'b': reward 1\.5"),
    "async window too old": ("async", _put("window", "b", 0, 0, 0), r"version 0 is older than the horizon 1"),
    "async float version": ("async", _put("window", "b", 0, 0, 2.5), r"version must be an integer .*got 2\.5"),
    "async negative horizon": ("async", _put("horizon", -1), r"tracker.horizon must be an integer .*got -1"),
    "async visits 1e30": ("async", _put("visits", "a", 1e30), r"visits of prompt key 'a' must be an integer"),
    "async no visits": ("async", lambda tracker: tracker.pop("visits"), r"tracker.visits is missing"),
    "async orphan window": ("async", _put("window", "c", [[2, 1.0]]), r"'c': the key has no entry in tracker.prior"),
}


@pytest.mark.parametrize("case", list(TRACKER_CASES))
def test_bad_tracker_state_is_refused_on_load_naming_file_field_and_key(tmp_path, case):
    """Issue 17 item 11: these restored silently (negative counts gave values of 2.0 or 5.0, zero counts 0/0 at the
    first read, rewards outside [0, 1] and 1e30 visits were kept); now the load refuses them, naming the file."""
    kind, change, message = TRACKER_CASES[case]
    path = _saved_tracker(tmp_path, kind, change)
    with pytest.raises(ValueError, match=rf"checkpoint state {path}: .*{message}"):
        load_checkpoint_state(str(tmp_path))


@pytest.mark.parametrize("kind", ["spo++", "spo", "async"])
def test_valid_tracker_states_load_and_restore_exactly(tmp_path, kind):
    save_checkpoint_state(str(tmp_path), _tracker_state(kind))
    state = load_checkpoint_state(str(tmp_path))
    restored = {"spo++": EventValueTracker, "spo": VisitValueTracker, "async": AsyncEventValues}[kind]()
    restored.load_state_dict(state["tracker"])
    assert restored.state_dict() == _tracker_state(kind)["tracker"]


def test_underflowed_single_count_is_accepted(tmp_path):
    """A prompt whose successes stopped long ago can hold alpha = 0.0 (rho^k underflows): a valid state."""
    tracker = EventValueTracker(0.875)
    tracker.enter(["a"], 0)
    tracker.observe(["a"], [0.0], [6000])
    assert tracker.value(["a"], 6000).item() == 0.0 and tracker.state_dict()["state"]["a"][0] == 0.0
    save_checkpoint_state(str(tmp_path), {"value_event": 6000, "aspo_kl_coef": 0.0, "tracker": tracker.state_dict()})
    assert load_checkpoint_state(str(tmp_path))["tracker"]["state"]["a"][0] == 0.0


def test_load_state_dict_applies_the_same_checks():
    state = _tracker_state("spo")["tracker"]
    state["state"]["a"] = [-1.0, 2.0]
    with pytest.raises(ValueError, match=r"tracker.state of prompt key 'a': pseudo-counts alpha=-1\.0"):
        VisitValueTracker().load_state_dict(state)


def _visit(**overrides) -> dict:
    visit = {
        "prompt_ids": torch.tensor([5, 6], dtype=torch.int32),
        "completion_ids": torch.tensor([7, 8, 9], dtype=torch.int32),
        "action_mask": torch.ones(3, dtype=torch.bool),
        "logps": torch.tensor([-0.5, -1.0, -0.25]),
    }
    visit.update(overrides)
    return visit


@pytest.mark.parametrize(
    ("visit", "message"),
    [
        (_visit(logps=torch.tensor([-0.5, math.nan, -0.25])), "logps must be finite"),
        (_visit(logps=torch.tensor([-0.5, -math.inf, -0.25])), "logps must be finite"),
        (_visit(logps=torch.tensor([-0.5])), r"logps must be a float tensor of shape \(3,\)"),
        (_visit(completion_ids=torch.tensor([7.0, 8.0, 9.0])), "completion_ids must hold token ids"),
        (_visit(prompt_ids=torch.tensor([-1, 6])), "prompt_ids must hold token ids"),
        (_visit(action_mask=torch.ones(2, dtype=torch.bool)), "action_mask has 2 entries for 3 tokens"),
        ({"completion_ids": [7, 8]}, "prompt_ids must be a 1-D tensor"),
    ],
)
def test_bad_stored_visit_is_refused_on_load(tmp_path, visit, message):
    state = _tracker_state("spo")
    save_checkpoint_state(str(tmp_path), {**state, "visit_store": {"a": _visit(), "b": visit}})
    with pytest.raises(ValueError, match=rf"checkpoint state {tmp_path / STATE_JSON}: visit_store of prompt key 'b'"):
        load_checkpoint_state(str(tmp_path))
    with pytest.raises(ValueError, match=message):
        load_checkpoint_state(str(tmp_path))


@pytest.mark.parametrize(("field", "value"), [("round", 1.5), ("round", -1), ("seed", "0"), ("seed", True)])
def test_bad_sampler_counter_is_refused_on_load(tmp_path, field, value):
    sampler = {"round": 2, "seed": 0, "weights": None, field: value}
    save_checkpoint_state(str(tmp_path), {**_tracker_state("spo"), "sampler": sampler})
    with pytest.raises(ValueError, match=rf"checkpoint state {tmp_path / STATE_JSON}: sampler.{field} must be"):
        load_checkpoint_state(str(tmp_path))


def test_values_command_names_the_file_of_a_bad_tracker(tmp_path, capsys):
    from trl_aspo.cli.values import main

    path = _saved_tracker(tmp_path, "spo++", _put("state", "a", 0, -1.0))
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--output", str(tmp_path / "values.jsonl")])
    assert f"checkpoint state {path}: tracker.state of prompt key 'a'" in capsys.readouterr().err
