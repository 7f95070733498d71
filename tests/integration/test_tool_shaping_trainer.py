"""Tool-position shaping inside `ASPOTrainer`, on completions produced by TRL's own tool loop, and `trl-aspo evaluate`.

The pure functions (`shaping`, `tool_metrics`) have their own unit tests; here they run where they are used: detection
on real generation batches (checked against an independent decode), the grouping the trainer hands to the shaping
(prompt groups, the whole batch with one completion per prompt, groups across ranks), a shaped training run's
metrics, and the evaluation command.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import TOOL_USE_METRICS, recording_batches, tiny_run_fields

import trl_aspo.values.scoring as scoring
from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.algorithms.shaping import tool_position_bias
from trl_aspo.algorithms.tool_metrics import first_tool_call_positions, regex_tool_call_positions
from trl_aspo.builtin import TINY_CALCULATOR, build_random_model, load_builtin
from trl_aspo.builtin.model import CHECKPOINT_DIR
from trl_aspo.builtin.task import calculator, correctness_reward
from trl_aspo.cli.main import main as cli_main
from trl_aspo.values.scoring import AdvantageBatch

OPENER = "<tool_call>"
needs_checkpoint = pytest.mark.skipif(
    not (CHECKPOINT_DIR / "model.safetensors").is_file(),
    reason="the warm-started builtin:tiny-calculator checkpoint is not built yet (it calls the tool; random weights "
    "almost never do)",
)


def used_tool_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion calls a tool: every tool-using completion counts as "correct", so shaping acts in every
    batch whatever the model's accuracy."""
    return [float(any(message.get("tool_calls") for message in completion)) for completion in completions]


def independent_detection(batch: dict, tokenizer) -> list[tuple[int, int, int]]:
    """(position, length, calls) per completion from the decoded text of its action tokens, without the detector.

    Each action token is decoded on its own and the action tokens are split into turns at the tool responses
    (tool_mask 0); a turn followed by a tool response holds one call that ran (issue 45), which starts in the token
    whose text contains the first character of the turn's last opener.
    """
    rows = []
    real = batch["completion_mask"].bool().tolist()
    for ids, keep, tools in zip(batch["completion_ids"].tolist(), real, batch["tool_mask"].tolist(), strict=True):
        turns, current, action_index = [], [], 0  # per turn: [(action index, piece)], followed by a response
        for token, k, tool in zip(ids, keep, tools, strict=True):
            if k and tool:
                current.append((action_index, tokenizer.decode([token], skip_special_tokens=False)))
                action_index += 1
            elif k and current:
                turns.append((current, True))
                current = []
        turns.append((current, False))
        calls = []
        for pieces, answered in turns:
            text = "".join(piece for _, piece in pieces)
            if answered and OPENER in text:
                start, end = text.rfind(OPENER), 0
                for index, piece in pieces:
                    end += len(piece)
                    if end > start:
                        calls.append(index)
                        break
        rows.append((calls[0] if calls else -1, action_index, len(calls)))
    return rows


@pytest.fixture(scope="module")
def shaped_run(tmp_path_factory, calculator_dataset):
    """Two shaped steps of the warm model with the calculator through TRL's tool loop, every batch kept."""
    model, tokenizer = load_builtin(TINY_CALCULATOR)
    args = ASPOConfig(
        **tiny_run_fields(
            tmp_path_factory.mktemp("shaped"),
            per_device_train_batch_size=16,
            num_generations=8,
            max_completion_length=48,
            max_tool_calling_iterations=1,
            learning_rate=1e-4,
            tool_shaping=True,
            tool_shaping_correct_reward="used_tool_reward",
        )
    )
    trainer = ASPOTrainer(
        model,
        [correctness_reward, used_tool_reward],
        args,
        train_dataset=calculator_dataset,
        processing_class=tokenizer,
        tools=[calculator],
    )
    initial = [p.detach().clone() for p in trainer.model.parameters()]
    batches = recording_batches(trainer)
    trainer.train()
    return trainer, batches, initial


# ------------------------------------------------------------------------------------------ (a), (b) detection
@pytest.mark.slow
@needs_checkpoint
def test_detection_agrees_with_decoded_tool_loop_completions(shaped_run):
    trainer, batches, _ = shaped_run
    for batch in batches:
        positions, lengths, calls, _ = first_tool_call_positions(
            batch["completion_ids"], batch["tool_mask"], batch["completion_mask"], trainer._tool_calls.call_token_ids
        )
        expected = independent_detection(batch, trainer.processing_class)
        assert list(zip(positions.tolist(), lengths.tolist(), calls.tolist(), strict=True)) == expected
    batch = batches[0]
    positions = first_tool_call_positions(
        batch["completion_ids"], batch["tool_mask"], batch["completion_mask"], trainer._tool_calls.call_token_ids
    )[0]
    # The batch exercised TRL's loop: calls were made and their tool responses inserted (tool_mask 0) after the call.
    executed = (batch["tool_mask"] == 0) & batch["completion_mask"].bool()
    assert bool((positions >= 0).any()) and bool(executed.any())
    for row in executed.any(dim=1).nonzero().flatten().tolist():
        first_response = int(executed[row].nonzero()[0])
        assert 0 <= positions[row] < first_response
    # The logged metric is the mean over the completions with a call.
    logged = trainer.state.log_history[0]["tools/first_call_position"]
    called = positions[positions >= 0].double()
    assert logged == pytest.approx(called.mean().item())


@pytest.mark.slow
@needs_checkpoint
def test_regex_detection_matches_opener_detection_on_real_completions(shaped_run):
    trainer, batches, _ = shaped_run
    for batch in batches:
        by_opener = first_tool_call_positions(
            batch["completion_ids"], batch["tool_mask"], batch["completion_mask"], trainer._tool_calls.call_token_ids
        )
        by_regex = regex_tool_call_positions(
            None,
            batch["completion_ids"],
            trainer.processing_class,
            re.escape(OPENER),
            batch["tool_mask"],
            completion_mask=batch["completion_mask"],
        )
        for name, a, b in zip(("positions", "lengths", "calls"), by_opener[:3], by_regex[:3], strict=True):
            assert torch.equal(a, b), name


def _text_batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    """A right-padded batch shaped like TRL's: ids, completion_mask (0 on padding), tool_mask (padded with 1)."""
    rows = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        completion_mask[i, : len(row)] = 1
    return {"completion_ids": ids, "completion_mask": completion_mask, "tool_mask": torch.ones_like(completion_mask)}


FENCED = [
    "Let me compute.\n```python\nprint(12 * 34)\n```\nThe answer is 408.<|im_end|>",
    "The answer is 7.<|im_end|>",
    "```python\nprint(1 + 2)\n```<|im_end|>",
]


def _expected_fenced(tokenizer, texts: list[str]) -> list[tuple[int, int, int]]:
    expected = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        start = text.find("```python")
        # The first token whose decoded prefix reaches past the pattern's first character holds the call's start.
        position = next((i for i in range(len(ids)) if len(tokenizer.decode(ids[: i + 1])) > start), -1)
        expected.append((position if start >= 0 else -1, len(ids), text.count("```python")))
    return expected


def test_regex_pattern_on_text_embedded_calls(tiny_tokenizer):
    batch = _text_batch(tiny_tokenizer, FENCED)
    positions, lengths, calls, turns = regex_tool_call_positions(
        None, batch["completion_ids"], tiny_tokenizer, r"```python", completion_mask=batch["completion_mask"]
    )
    assert list(zip(positions.tolist(), lengths.tolist(), calls.tolist(), strict=True)) == _expected_fenced(
        tiny_tokenizer, FENCED
    )
    assert turns.tolist() == [1, 0, 0]  # only the first call follows model text


def test_trainer_regex_pattern_statistics(tiny_tokenizer, tiny_model, calculator_dataset, tiny_config):
    trainer = ASPOTrainer(
        tiny_model,
        [correctness_reward],
        tiny_config(tool_call_pattern=r"```python"),
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
    )
    batch = _text_batch(tiny_tokenizer, FENCED)
    stats = trainer._tool_statistics(batch)
    assert [tuple(row[:3]) for row in stats.tolist()] == _expected_fenced(tiny_tokenizer, FENCED)


# ------------------------------------------------------------------------------------------ (c), (d) grouping
@pytest.mark.parametrize(
    ("overrides", "groups"),
    [
        # One completion per prompt: the whole generation batch is one group.
        ({"advantage_estimator": "spo++", "num_generations": 1}, [0, 0, 0, 0, 0, 0, 0, 0]),
        # Prompt groups are read off the gathered index, so a group is compared whole even when its completions were
        # generated on different ranks.
        ({"num_generations": 4}, [0, 0, 0, 0, 1, 1, 1, 1]),
    ],
    ids=["single-stream", "prompt-groups"],
)
def test_shape_groups(overrides, groups, tiny_tokenizer, tiny_model, calculator_dataset, tiny_config):
    trainer = ASPOTrainer(
        tiny_model,
        [correctness_reward],
        tiny_config(tool_shaping=True, **overrides),
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
    )
    advantages = torch.tensor([1.0, 1.0, 1.0, -0.5, 1.0, 0.8, 1.0, -1.0])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    positions = torch.tensor([0, 2, 4, 9, 6, 1, -1, 3])
    lengths = torch.full((8,), 10)
    tool_stats = torch.stack([positions, lengths, (positions >= 0).long(), torch.zeros(8, dtype=torch.long)], dim=1)

    batch = AdvantageBatch(
        centered=advantages,
        scorable=torch.ones(len(advantages), dtype=torch.bool),
        token_counts=tool_stats[:, 1],
        group_ids=torch.arange(len(advantages)) // trainer.num_generations,
        rewards=rewards,
        tool_stats=tool_stats,
    )
    shaped, shaping_metrics = trainer._pipeline.shape(advantages, batch)

    eligible = (rewards > 0.5) & (positions >= 0)
    expected = advantages + tool_position_bias(advantages, positions, lengths, eligible, torch.tensor(groups))
    torch.testing.assert_close(shaped, expected)
    per_completion = advantages + tool_position_bias(advantages, positions, lengths, eligible, torch.arange(8))
    assert not torch.allclose(shaped, per_completion)  # the comparison really spans several completions
    assert torch.equal(shaped[~eligible], advantages[~eligible])
    assert shaping_metrics["shaping/eligible_frac"] == pytest.approx(5 / 8)


def test_tool_statistics_reduce_over_ranks(tiny_tokenizer, tiny_model, calculator_dataset, tiny_config, monkeypatch):
    """Statistics are gathered before the metrics: emulate a second rank whose completions all call at position 4."""
    trainer = ASPOTrainer(
        tiny_model,
        [correctness_reward],
        tiny_config(tool_shaping=True),
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
        tools=[calculator],
    )
    batch = _text_batch(tiny_tokenizer, ["The answer is 7.<|im_end|>", "Hmm.<|im_end|>"])
    other_rank = torch.tensor([[4, 9, 1, 1], [4, 12, 1, 1]])
    monkeypatch.setattr(trainer.accelerator, "gather", lambda local: torch.cat([local, other_rank.to(local)]))

    stats = trainer._tool_statistics(batch)

    assert stats.shape == (4, 4) and stats[:2, 0].tolist() == [-1, -1]
    metrics = trainer._metrics["train"]
    assert metrics["tools/tool_call_frac"] == [0.5]
    assert metrics["tools/first_call_position"] == [4.0]


@pytest.mark.slow
@needs_checkpoint
def test_single_stream_run_shapes_across_the_whole_batch(calculator_dataset, tiny_config, monkeypatch):
    """spo++ with one completion per prompt, end to end: one group per generation batch, advantages moved by it."""
    calls = []

    def spy(advantages, positions, lengths, eligible, groups, **kwargs):
        bias = tool_position_bias(advantages, positions, lengths, eligible, groups, **kwargs)
        calls.append((advantages.clone(), positions, lengths, eligible, groups, bias))
        return bias

    monkeypatch.setattr(scoring, "tool_position_bias", spy)
    model, tokenizer = load_builtin(TINY_CALCULATOR)
    args = tiny_config(
        advantage_estimator="spo++",
        num_generations=1,
        per_device_train_batch_size=16,
        max_completion_length=48,
        max_tool_calling_iterations=1,
        max_steps=1,
        tool_shaping=True,
    )
    trainer = ASPOTrainer(
        model, [used_tool_reward], args, calculator_dataset, processing_class=tokenizer, tools=[calculator]
    )
    batches = recording_batches(trainer)
    trainer.train()

    (advantages, positions, lengths, eligible, groups, bias), batch = calls[0], batches[0]
    assert len(groups) == 16 and bool((groups == groups[0]).all())
    assert bool(eligible.any()) and bool(bias.abs().gt(0).any()), "no shaping happened: the check would be vacuous"
    expected = tool_position_bias(advantages, positions, lengths, eligible, torch.zeros_like(groups))
    torch.testing.assert_close(bias, expected)
    torch.testing.assert_close(batch["advantages"], advantages + bias)


# ------------------------------------------------------------------------------------------ (e) a shaped run
@pytest.mark.slow
@needs_checkpoint
def test_shaped_training_run_logs_tool_and_shaping_metrics(shaped_run):
    trainer, _, initial = shaped_run
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2
    expected = {
        "shaping/eligible_frac",
        "shaping/bias_mean",
        "shaping/bias_abs_mean",
        "shaping/bias_abs_max",
        "tools/tool_call_frac",
        "tools/calls_per_completion",
        "tools/first_call_position",
        "tools/first_call_rel_position",
        "tools/interactive_turns",
    }
    assert all(expected <= set(row) for row in rows)
    assert any(row["shaping/eligible_frac"] > 0 for row in rows)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(initial, trainer.model.parameters(), strict=True))


# ------------------------------------------------------------------------------------------ (f) trl-aspo evaluate


def test_evaluate_command_writes_json(tmp_path, capsys):
    output = tmp_path / "eval.json"
    code = cli_main(
        ["evaluate", "--model", "builtin:tiny-random", "--limit", "4", "--max_completion_length", "12"]
        + ["--num_samples", "2", "--output", str(output)]
    )
    assert code == 0
    report = json.loads(output.read_text())
    assert set(report) == {"model", "dataset", "split", "settings", "metrics"}
    assert (report["model"], report["dataset"], report["split"]) == (
        "builtin:tiny-random",
        "builtin:calculator",
        "test",
    )
    assert set(report["metrics"]) == TOOL_USE_METRICS
    assert report["metrics"]["num_problems"] == 4 and report["metrics"]["num_samples"] == 2
    assert report["settings"]["temperature"] == 1.0 and report["settings"]["max_completion_length"] == 12
    assert report["settings"]["tools"] == ["calculator"]
    printed = capsys.readouterr().out
    assert "pass@2" in printed and "tool-call rate" in printed


def test_evaluate_command_with_training_yaml_and_local_model(tmp_path, tiny_tokenizer):
    model_dir = tmp_path / "trained"
    build_random_model(tiny_tokenizer, seed=1).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    config = tmp_path / "run.yaml"
    config.write_text(
        "model_name_or_path: builtin:tiny-random\ndataset_name: builtin:calculator\nbuiltin_test_size: 3\n"
        "reward_funcs: [builtin:correctness]\ntools: [builtin:calculator]\nmax_completion_length: 10\n"
        "max_tool_calling_iterations: 1\noutput_dir: out\nbf16: true\n"
    )
    assert cli_main(["evaluate", "--model", str(model_dir), "--config", str(config), "--records"]) == 0
    report = json.loads((model_dir / "evaluation.json").read_text())  # default output: next to the model
    assert report["metrics"]["num_problems"] == 3 and len(report["records"]) == 3
    assert report["settings"]["max_tool_calling_iterations"] == 1
    assert all(record["action_tokens"] <= 10 for record in report["records"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/no/such/model_dir"], "no such directory"),
        (["--model", "builtin:tiny-nothing"], "Unknown built-in model"),
        (["--num_samples", "0"], "--num_samples must be >= 1"),
        (["--limit", "-1"], "--limit must be >= 1"),
        (["--split", "validation"], "the built-in task has the splits"),
        (
            ["--max_completion_lenght", "8"],
            "--max_completion_lenght (command line): unknown flag; did you mean --max_completion_length?",
        ),
    ],
)
def test_evaluate_command_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["evaluate", "--model", "builtin:tiny-random", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_evaluate_command_directory_without_a_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["evaluate", "--model", str(tmp_path)])
    assert "could not load a causal LM" in capsys.readouterr().err


def _turns_batch(tokenizer, rows: list[list[tuple[str, bool]]]) -> dict[str, torch.Tensor]:
    """TRL's right-padded batch of completions given as (text, written by the model) segments: tool_mask 0 on the
    tool responses, padded with 1; completion_mask 0 on padding."""
    encoded = []
    for segments in rows:
        ids, tools = [], []
        for text, by_model in segments:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids, tools = ids + piece, tools + [int(by_model)] * len(piece)
        encoded.append((ids, tools))
    width = max(len(ids) for ids, _ in encoded)
    batch = {
        "completion_ids": torch.full((len(rows), width), tokenizer.pad_token_id),
        "completion_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "tool_mask": torch.ones((len(rows), width), dtype=torch.long),
    }
    for row, (ids, tools) in enumerate(encoded):
        batch["completion_ids"][row, : len(ids)] = torch.tensor(ids)
        batch["completion_mask"][row, : len(ids)] = 1
        batch["tool_mask"][row, : len(ids)] = torch.tensor(tools)
    return batch


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call><|im_end|>'
RESPONSE = "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_trainer_counts_only_calls_whose_tool_ran(tiny_tokenizer, tiny_model, calculator_dataset, tiny_config):
    """Issue 45 item 5, in the synchronous trainer's tools/* and shaping statistics: a bare opener before the answer
    is not a call; a call followed by its tool response is, at its own position."""
    trainer = ASPOTrainer(
        tiny_model,
        [correctness_reward],
        tiny_config(tool_shaping=True),
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
        tools=[calculator],
    )
    rows = [
        [("<tool_call>The answer is 6.<|im_end|>", True)],
        [("I will use the calculator.", True), (CALL, True), (RESPONSE, False), ("The answer is 6.<|im_end|>", True)],
    ]
    stats = trainer._tool_statistics(_turns_batch(tiny_tokenizer, rows))
    prefix = len(tiny_tokenizer.encode("I will use the calculator.", add_special_tokens=False))
    assert stats[:, 0].tolist() == [-1, prefix]
    assert stats[:, 2].tolist() == [0, 1]
    assert trainer._metrics["train"]["tools/calls_per_completion"] == [0.5]
    assert trainer._metrics["train"]["tools/first_call_position"] == [float(prefix)]
