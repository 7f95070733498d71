"""Value-tracker inputs the trainer reads: value-init files (finite counts, records that must match training prompts)
and prompt id columns."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from helpers import digit_share_reward, tiny_run_fields

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import build_random_model
from trl_aspo.values.prompt_ids import prompt_key


def _trainer(tiny_tokenizer, dataset, tmp_path, **overrides) -> ASPOTrainer:
    defaults = dict(num_generations=1, advantage_estimator="spo++", max_completion_length=8, max_steps=1)
    fields = tiny_run_fields(tmp_path / "out", **{**defaults, **overrides})
    return ASPOTrainer(
        model=build_random_model(tiny_tokenizer, seed=0),
        reward_funcs=[digit_share_reward],
        args=ASPOConfig(**fields),
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
    )


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture
def chat_dataset(calculator_dataset):
    return calculator_dataset.select(range(8))


# ---------------------------------------------------------------- item 5: finite counts


@pytest.mark.parametrize(
    "record",
    [
        '{"prompt_id": "0", "successes": Infinity, "trials": Infinity}',
        '{"prompt_id": "0", "successes": 1, "trials": Infinity}',
        '{"prompt_id": "0", "successes": NaN, "trials": 2}',
    ],
)
def test_non_finite_counts_are_refused(tiny_tokenizer, chat_dataset, tmp_path, record):
    dataset = chat_dataset.add_column("pid", [f"{index}" for index in range(8)])
    path = _write(tmp_path / "init.json", f"[{record}]")
    with pytest.raises(ValueError, match=rf"value_init_file='{path}': record 0 needs finite 'successes' and 'trials'"):
        _trainer(tiny_tokenizer, dataset, tmp_path, value_init_file=path, prompt_id_column="pid")


# ---------------------------------------------------------------- item 6: prompt ids identify one prompt each


def test_dataset_with_missing_prompt_ids_is_refused(tiny_tokenizer, chat_dataset, tmp_path):
    dataset = chat_dataset.add_column("pid", [None, None, *range(2, 8)])
    path = _write(tmp_path / "init.json", json.dumps([{"prompt_id": 3, "successes": 1, "trials": 2}]))
    with pytest.raises(ValueError, match="prompt id column 'pid' holds None"):
        _trainer(tiny_tokenizer, dataset, tmp_path, value_init_file=path, prompt_id_column="pid")


@pytest.mark.slow
def test_training_with_missing_prompt_ids_is_refused(tiny_tokenizer, chat_dataset, tmp_path):
    dataset = chat_dataset.add_column("pid", [None, None, *range(2, 8)])
    # Refused when the trainer reads the dataset, naming the first row without an id.
    with pytest.raises(ValueError, match="dataset row 0: prompt id column 'pid' holds None"):
        _trainer(tiny_tokenizer, dataset, tmp_path, prompt_id_column="pid")


# ---------------------------------------------------------------- item 7: records must match training prompts


def _capture_warnings(monkeypatch) -> list[str]:
    import trl_aspo.values.single_stream as single_stream

    lines: list[str] = []
    monkeypatch.setattr(single_stream.logger, "warning", lines.append)
    return lines


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"prompt_id": "7", "successes": 1, "trials": 2}], "records name prompts by 'prompt'"),
        ([{"prompt": "What is 2 + 2?", "successes": 1, "trials": 2}], "chat messages for a chat dataset"),
        ([], "none of its 0 records matches"),
    ],
)
def test_a_file_matching_no_training_prompt_is_refused(tiny_tokenizer, chat_dataset, tmp_path, records, message):
    path = _write(tmp_path / "init.json", json.dumps(records))
    with pytest.raises(ValueError, match=rf"value_init_file='{path}': .*{message}"):
        _trainer(tiny_tokenizer, chat_dataset, tmp_path, value_init_file=path)


def test_partly_matching_file_reports_the_count(tiny_tokenizer, chat_dataset, tmp_path, monkeypatch):
    warnings = _capture_warnings(monkeypatch)
    records = [
        {"prompt": chat_dataset[0]["prompt"], "successes": 1, "trials": 2},
        {"prompt": "not a training prompt", "successes": 1, "trials": 2},
    ]
    path = _write(tmp_path / "init.json", json.dumps(records))
    trainer = _trainer(tiny_tokenizer, chat_dataset, tmp_path, value_init_file=path)
    assert any("1 of 2 records match a training prompt; the other 1 are ignored" in line for line in warnings)
    assert trainer._values.tracker.num_tracked == 2


def test_prompt_ids_in_the_file_match_numeric_columns(tiny_tokenizer, chat_dataset, tmp_path):
    dataset = chat_dataset.add_column("pid", list(range(100, 108)))
    path = _write(tmp_path / "init.json", json.dumps([{"prompt_id": 103, "successes": 3, "trials": 4}]))
    trainer = _trainer(tiny_tokenizer, dataset, tmp_path, value_init_file=path, prompt_id_column="pid")
    alpha, beta = trainer._values.tracker.pseudo_counts(["103"], 0)
    assert (alpha.item(), beta.item()) == pytest.approx((8 * 3.5 / 5, 8 * 1.5 / 5))


def test_records_match_prompts_to_which_datasets_added_none_fields(tiny_tokenizer, tmp_path):
    messages = [[{"role": "user", "content": f"What is {index} + 1?"}] for index in range(8)]
    messages[0] = [{"role": "system", "content": "Be brief.", "name": "setup"}, *messages[0]]
    dataset = Dataset.from_list([{"prompt": prompt} for prompt in messages])
    stored = dataset[1]["prompt"]
    assert stored == [{"role": "user", "content": "What is 1 + 1?", "name": None}]
    path = _write(tmp_path / "init.json", json.dumps([{"prompt": messages[1], "successes": 3, "trials": 4}]))
    trainer = _trainer(tiny_tokenizer, dataset, tmp_path, value_init_file=path)
    alpha, _ = trainer._values.tracker.pseudo_counts([prompt_key(stored)], 0)
    assert alpha.item() == pytest.approx(8 * 3.5 / 5)
