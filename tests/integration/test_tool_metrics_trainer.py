"""Issue 17: AsyncASPOTrainer logs the synchronous trainer's tools/* metrics of its samples."""

from __future__ import annotations

import math

import pytest

from trl_aspo.algorithms.tool_metrics import resolve_call_token_ids, resolve_whitespace_token_ids


def _independent_tool_metrics(samples, opener: list[int], whitespace: set[int]) -> dict[str, float]:
    """tools/* of a step's `RolloutSample`s by a plain loop over each completion's tokens (from its first completion
    token; mask 0 = tool output): an opener among consecutive action tokens of one turn is a call when tool output
    follows it before the next opener (issue 45: only calls whose tool ran count)."""
    positions, lengths, calls, turns = [], [], [], []
    for sample in samples:
        mask = [int(m) for m in sample.completion_mask]
        start = mask.index(1)
        ids, mask = [int(i) for i in sample.input_ids[start:]], mask[start:]
        action = [i for i, m in enumerate(mask) if m]
        openers = [
            t
            for t in range(len(ids))
            if ids[t : t + len(opener)] == opener
            and len(ids[t : t + len(opener)]) == len(opener)
            and all(mask[t : t + len(opener)])
        ]
        ran = []
        for k, t in enumerate(openers):
            output = next((u for u in range(t, len(ids)) if not mask[u]), None)
            if output is not None and not any(o < output for o in openers[k + 1 :]):
                ran.append(t)
        interactive, text_in_turn, first_in_turn = 0, False, None
        for t in range(len(ids) + 1):
            if t == len(ids) or (t > 0 and mask[t] and not mask[t - 1]):  # a turn ends
                if first_in_turn is not None and text_in_turn and any(r >= first_in_turn for r in ran if r < t):
                    interactive += 1
                text_in_turn, first_in_turn = False, None
            if t == len(ids) or not mask[t]:
                continue
            if t in openers and first_in_turn is None:
                first_in_turn = t
            elif first_in_turn is None and ids[t] not in whitespace:
                text_in_turn = True
        first = action.index(ran[0]) if ran else -1
        positions.append(first), lengths.append(len(action)), calls.append(len(ran)), turns.append(interactive)
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
