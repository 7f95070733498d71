"""Issue 17: AsyncASPOTrainer logs the synchronous trainer's tools/* metrics of its samples."""

from __future__ import annotations

import math

import pytest

from trl_aspo.algorithms.tool_metrics import resolve_call_token_ids, resolve_whitespace_token_ids


def _independent_tool_metrics(samples, opener: list[int], whitespace: set[int]) -> dict[str, float]:
    """tools/* of a step's `RolloutSample`s by a plain loop over each completion's tokens (from its first completion
    token; mask 0 = tool output): the opener's first match among consecutive action tokens of one turn."""
    positions, lengths, calls, turns = [], [], [], []
    for sample in samples:
        mask = [int(m) for m in sample.completion_mask]
        start = mask.index(1)
        ids, mask = [int(i) for i in sample.input_ids[start:]], mask[start:]
        action = [i for i, m in enumerate(mask) if m]
        first, count, interactive, text_in_turn, called_in_turn = -1, 0, 0, False, False
        for t in range(len(ids)):
            if t > 0 and mask[t] and not mask[t - 1]:
                text_in_turn, called_in_turn = False, False  # a new assistant turn after a tool response
            if not mask[t]:
                continue
            if ids[t : t + len(opener)] == opener and all(mask[t : t + len(opener)]):
                first = action.index(t) if first < 0 else first
                count += 1
                interactive += int(text_in_turn and not called_in_turn)
                called_in_turn = True
            elif ids[t] not in whitespace and not called_in_turn:
                text_in_turn = True
        positions.append(first), lengths.append(len(action)), calls.append(count), turns.append(interactive)
    with_call = [(p, n) for p, n in zip(positions, lengths, strict=True) if p >= 0]
    return {
        "tool_call_frac": len(with_call) / len(samples),
        "calls_per_completion": sum(calls) / len(samples),
        "first_call_position": sum(p for p, _ in with_call) / len(with_call) if with_call else math.nan,
        "first_call_rel_position": sum(p / max(n, 1) for p, n in with_call) / len(with_call)
        if with_call
        else math.nan,
        "interactive_turns": sum(turns) / len(samples),
    }


@pytest.mark.slow
def test_async_trainer_logs_the_tool_metrics_of_its_samples(tmp_path):
    """Issue 17: AsyncASPOTrainer logs the synchronous trainer's tools/* metrics, per optimizer step of samples."""
    from helpers import async_fields, calculator_tokenizer, trainer_with_local_worker

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset

    tokenizer = calculator_tokenizer()
    fields = async_fields(tmp_path, per_device_train_batch_size=8, num_generations=2, max_steps=3, max_staleness=100)
    args = AsyncASPOConfig(**fields, max_inflight_tasks=1)
    trainer = trainer_with_local_worker(
        AsyncASPOTrainer, args, tokenizer, make_dataset("train", 32, seed=0), [correctness_reward]
    )
    taken, get = [], trainer.rollout_queue.get

    def recording_get(*args, **kwargs):
        taken.append(get(*args, **kwargs))
        return taken[-1]

    trainer.rollout_queue.get = recording_get
    trainer.train()

    logged = [row for row in trainer.state.log_history if "tools/tool_call_frac" in row]
    assert len(logged) == 3
    opener = resolve_call_token_ids(tokenizer, "<tool_call>")
    whitespace = resolve_whitespace_token_ids(tokenizer)
    # Logged step k holds the metrics of the k-th group of 8 samples taken (the loader runs ahead, the rest wait).
    per_step = [_independent_tool_metrics(taken[k : k + 8], opener, whitespace) for k in range(0, len(taken), 8)]
    # The data loader fetches one step ahead: the first window holds the first two steps' samples, window k the
    # samples of step k + 1 (as for value/* and shaping/*); a NaN (no call in a step) is left out of a window's mean.
    windows = [per_step[:2], *([step] for step in per_step[2:])]
    for index, (row, steps) in enumerate(zip(logged, windows, strict=False)):
        for name in steps[0]:
            values = [step[name] for step in steps if not math.isnan(step[name])]
            expected = sum(values) / len(values) if values else None
            assert row[f"tools/{name}"] == (None if expected is None else pytest.approx(expected)), (index, name)
    assert any(row["tools/tool_call_frac"] > 0 for row in logged), "the checkpoint never called its tool"
