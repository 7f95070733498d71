"""What both trainers share is tested once, parametrized over `ASPOTrainer` and `AsyncASPOTrainer`: the same metric
keys from the shared pipeline and loss, the same refusal of a bad `tool_shaping_correct_reward`, the same warning
when shaping runs without tools, the same pre-pass accounting, the same per-step timing of their own work."""

from __future__ import annotations

import math
import warnings

import pytest
from helpers import MODEL, async_fields, calculator_tokenizer, tiny_run_fields, trainer_with_local_worker

TRAINERS = ["sync", "async"]

# Logged by the shared pipeline (values.scoring), the shared loss (trainers.loss_assembly) and the tool counter.
SHARED_KEYS = {
    "zero_advantage_share",
    "advantage/p10",
    "advantage/p50",
    "advantage/p90",
    "shaping/eligible_frac",
    "shaping/bias_mean",
    "tools/tool_call_frac",
    "tools/first_call_position",
    "aspo/flipped_frac",
    "aspo/hard_clip_pos_frac",
    "value/mean",
    "value/tracked_prompts",
    "value/effective_prompts",
    "policy_loss",
}

# `log_timing`'s metrics (trl_aspo.trainers.step_timing), and the off-policy correction each trainer times: TRL's
# off-policy mask on a registered loss's path (synchronous), the decoupled objective (asynchronous).
TIMING_KEYS = {
    "timing/advantages_s",
    "timing/policy_loss_s",
    "timing/offpolicy_correction_s",
    "timing/step_s",
    "timing/value_prepass_s",
}
CORRECTION = {"sync": {"off_policy_mask_threshold": 0.5}, "async": {"vllm_importance_sampling_correction": True}}


def build(kind: str, tmp_path, reward_funcs=None, tools=True, **overrides):
    """A trainer of `kind` on the built-in tiny-calculator model with the calculator tool: spo++ with one completion
    per prompt, prioritized sampling, token normalization, tool shaping and the aspo loss, two optimizer steps."""

    from trl_aspo import ASPOConfig, ASPOTrainer, AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin import TINY_CALCULATOR
    from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset

    reward_funcs = [correctness_reward] if reward_funcs is None else reward_funcs
    dataset = make_dataset("train", 16, seed=0)
    fields = {
        "advantage_estimator": "spo++",
        "num_generations": 1,
        "prioritized_sampling": True,
        "advantage_normalization": "token",
        "tool_shaping": True,
        "loss_type": "aspo",
        "max_steps": 2,
        "max_completion_length": 32,
        "max_tool_calling_iterations": 1,
        **overrides,
    }
    if kind == "sync":
        args = ASPOConfig(**tiny_run_fields(tmp_path / "out", steps_per_generation=2, **fields))
        return ASPOTrainer(
            TINY_CALCULATOR, reward_funcs, args, train_dataset=dataset, tools=[calculator] if tools else None
        )
    args = AsyncASPOConfig(**async_fields(tmp_path, **fields))
    tokenizer = calculator_tokenizer()
    if not tools:
        from trl_aspo.infra.local_worker import LocalRolloutWorker, LocalWeightTransfer

        worker = LocalRolloutWorker(MODEL, tokenizer, dataset, reward_funcs, args)
        return AsyncASPOTrainer(
            MODEL,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_worker=worker,
            weight_transfer=LocalWeightTransfer(worker),
        )
    return trainer_with_local_worker(AsyncASPOTrainer, args, tokenizer, dataset, reward_funcs)


def logged_keys(trainer) -> set[str]:
    return {key for row in trainer.state.log_history for key in row}


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINERS)
def test_both_trainers_log_the_shared_metric_keys(kind, tmp_path):
    trainer = build(kind, tmp_path)
    trainer.train()
    keys = logged_keys(trainer)
    assert keys >= SHARED_KEYS, sorted(SHARED_KEYS - keys)
    for row in trainer.state.log_history:
        if "zero_advantage_share" in row:
            assert 0.0 <= row["zero_advantage_share"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINERS)
def test_both_trainers_refuse_a_correct_reward_that_names_no_function(kind, tmp_path):
    """The synchronous trainer knows its reward functions at construction, the asynchronous one when its first
    step's samples arrive (the rollout worker scores): the same message, naming the field and the functions."""
    message = r"tool_shaping_correct_reward='nope' names no reward function; .*\['correctness_reward'\]"
    with pytest.raises(ValueError, match=message):
        build(kind, tmp_path, tool_shaping_correct_reward="nope").train()


@pytest.mark.parametrize("kind", TRAINERS)
def test_both_trainers_warn_when_shaping_runs_without_tools(kind, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(kind, tmp_path, tools=False)
    shaping = [str(w.message) for w in caught if "tool_shaping=True, but the trainer has no" in str(w.message)]
    assert len(shaping) == 1, [str(w.message) for w in caught]
    assert "shaping only acts on completions whose text contains tool_call_opener='<tool_call>'" in shaping[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINERS)
def test_both_pre_passes_count_successes_and_trials_the_same_way(kind, tmp_path, monkeypatch):
    """`value_init_samples`: each trainer rolls out with its own generation, and both hand the samples to their
    `ValueTracking`, which counts them with `init_values_from_samples`: right after it, each prompt's value is the
    Jeffreys-smoothed success rate (s + 0.5) / (n + 1) of its own samples (docs/design.md section 3), computed here
    from what was handed over."""
    import trl_aspo.values.single_stream as single_stream

    seen = []
    init = single_stream.init_values_from_samples

    def recording(tracker, prompts, sample_keys, outcomes, args, event=None):
        init(tracker, prompts, sample_keys, outcomes, args, event)
        seen.append((list(prompts), list(sample_keys), list(outcomes), tracker.value(list(prompts), 0)))

    monkeypatch.setattr("trl_aspo.trainers.value_tracking.init_values_from_samples", recording)
    build(kind, tmp_path, value_init_samples=2, max_steps=1).train()
    ((prompts, sample_keys, outcomes, values),) = seen
    assert len(prompts) == 16 and sorted(sample_keys) == sorted(prompts * 2)
    successes = {key: sum(o for k, o in zip(sample_keys, outcomes, strict=True) if k == key) for key in prompts}
    expected = [(successes[key] + 0.5) / 3 for key in prompts]
    assert values.tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINERS)
def test_both_trainers_time_their_own_work_per_step(kind, tmp_path):
    """Every timed region, per optimizer step, in seconds: finite, >= 0, the regions together within the step's wall
    time (one host clock on a CPU); the value pre-pass once."""
    trainer = build(kind, tmp_path, value_init_samples=1, **CORRECTION[kind])
    trainer.train()
    assert {key for key in logged_keys(trainer) if key.startswith("timing/")} == TIMING_KEYS
    steps = [row for row in trainer.state.log_history if "timing/step_s" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        timings = {key: value for key, value in row.items() if key.startswith("timing/")}
        assert set(timings) >= TIMING_KEYS - {"timing/value_prepass_s"}, timings  # from the first step on
        assert all(math.isfinite(value) and value >= 0.0 for value in timings.values()), timings
        regions = sum(
            value for key, value in timings.items() if key not in ("timing/step_s", "timing/value_prepass_s")
        )
        assert 0.0 < regions <= row["timing/step_s"], timings
    prepass = [row["timing/value_prepass_s"] for row in trainer.state.log_history if "timing/value_prepass_s" in row]
    assert len(prepass) == 1 and prepass[0] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINERS)
def test_with_log_timing_off_neither_trainer_logs_a_timing(kind, tmp_path):
    trainer = build(kind, tmp_path, log_timing=False, value_init_samples=1, max_steps=1, **CORRECTION[kind])
    trainer.train()
    assert not {key for key in logged_keys(trainer) if key.startswith("timing/")}


class NaNGradientAt:
    """A callback that makes one parameter's gradient NaN during optimizer step `step` (counted from 1), as one bad
    batch would, and keeps the weights just before and just after that step's `optimizer.step()`."""

    def __init__(self, step: int):
        self.step, self.handle, self.before, self.after = step, None, None, None

    def callback(self, trainer):
        import torch
        from transformers import TrainerCallback

        guard = self
        parameter = trainer.model.get_input_embeddings().weight

        def weights():
            return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

        class Poison(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == guard.step:
                    guard.handle = parameter.register_hook(lambda grad: torch.full_like(grad, float("nan")))

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                if state.global_step + 1 == guard.step:
                    guard.before = weights()

            def on_optimizer_step(self, args, state, control, **kwargs):
                if state.global_step + 1 == guard.step:
                    guard.after = weights()
                    guard.handle.remove()

        return Poison()


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINERS)
def test_a_step_with_a_nan_gradient_is_skipped_and_training_goes_on(kind, tmp_path):
    """`skip_nonfinite_grad_steps`: the poisoned step leaves every weight bitwise as it was, the next step trains,
    and the skip is logged; without the option the same poisoned step stops the run before the optimizer steps,
    naming the parameter (before issue 43 it wrote NaN into every weight)."""
    import torch

    poison = NaNGradientAt(step=1)
    trainer = build(kind, tmp_path / "skip", skip_nonfinite_grad_steps=True)
    trainer.add_callback(poison.callback(trainer))
    with pytest.warns(RuntimeWarning, match=r"Optimizer step 1: non-finite values: .*norm nan\. The step is skipped"):
        trainer.train()
    assert all(torch.equal(poison.before[name], poison.after[name]) for name in poison.before)
    final = dict(trainer.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in final.values())
    assert any(not torch.equal(poison.after[name], final[name].detach()) for name in poison.after)  # step 2 trained
    skipped = [row["optim/skipped_nonfinite_step"] for row in trainer.state.log_history if "optim/" in str(row)]
    assert skipped == [1.0, 0.0]

    from trl_aspo.trainers.step_guard import NonFiniteStepError

    poison = NaNGradientAt(step=1)
    unguarded = build(kind, tmp_path / "plain")
    unguarded.add_callback(poison.callback(unguarded))
    with pytest.raises(NonFiniteStepError, match=r"first non-finite gradient on this rank's shard: model\.embed"):
        unguarded.train()
    assert poison.after is None  # optimizer.step() never ran
    assert all(torch.isfinite(p).all() for p in unguarded.model.parameters())
