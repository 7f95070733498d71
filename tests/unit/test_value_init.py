"""Value-tracker initialization: the pre-pass plan, value-init records with pseudo-counts, and what the values export
refuses."""

from __future__ import annotations

import pytest

from trl_aspo.values.value_init import prepass_plan


def test_values_export_refuses_a_group_checkpoint_and_a_missing_one(tmp_path):
    from trl_aspo.cli.values import load_value_state, value_records

    with pytest.raises(ValueError, match="no value tracker"):
        value_records({"value_event": 3, "aspo_kl_coef": 0.0})
    with pytest.raises(ValueError, match="not a checkpoint saved by ASPOTrainer"):
        load_value_state(str(tmp_path))


def test_value_init_jsonl_with_pseudo_counts(tmp_path):
    import json

    from trl_aspo.values.value_init import read_init_records

    path = tmp_path / "init.jsonl"
    lines = [
        {"prompt_id": "a", "alpha": 2.5, "beta": 0.5, "value": 0.83},
        {"prompt": "What is 1 + 1?", "successes": 1, "trials": 2},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    records = read_init_records(str(path), None)
    assert (records.pseudo_keys, records.alphas, records.betas) == (["a"], [2.5], [0.5])
    assert (records.successes, records.trials) == ([1.0], [2.0]) and len(records.count_keys) == 1
    path.write_text(json.dumps({"prompt_id": "a", "alpha": "2", "beta": 1}))
    with pytest.raises(ValueError, match="needs numeric 'alpha' and 'beta'"):
        read_init_records(str(path), None)
    from trl_aspo.values import EventValueTracker, VisitValueTracker

    for tracker in (EventValueTracker(), VisitValueTracker()):
        with pytest.raises(ValueError, match="'a'.*finite, >= 0 and not both 0"):
            tracker.set_pseudo_counts(["a"], [0.0], [0.0])


def test_prepass_plan_shards_whole_blocks_evenly():
    # 3 prompts x 3 samples in blocks of 2 (4 rows each, the 4th not counted), one batch = 2 ranks x 4 rows.
    plan = prepass_plan([5, 7, 9], samples=3, group=2, span=8)
    assert len(plan) == 16
    assert plan[:12] == [(row, sample < 3) for row in (5, 7, 9) for sample in range(4)]
    assert plan[12:] == [(5, False)] * 4
    assert all(plan[i][0] == plan[i + 1][0] for i in range(0, 16, 2))
    assert prepass_plan([1, 2], samples=2, group=1, span=4) == [
        (1, True),
        (1, True),
        (2, True),
        (2, True),
    ]
