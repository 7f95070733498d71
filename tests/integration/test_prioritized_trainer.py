"""Prioritized sampling inside `ASPOTrainer`: each draw sees the previous round's outcomes, and resume is exact.

The checks observe the trainer from outside: every `PrioritizedRepeatSampler.draw` call records the weights it drew
with and a snapshot of the trainer's tracker, and TRL's `_calculate_rewards` records which prompts each generation
round used. The expected weights are recomputed from the snapshot with the tracker's public API and the weight
formula written out by hand.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import digit_share_reward

from trl_aspo import ASPOTrainer
from trl_aspo.values import EventValueTracker, VisitValueTracker
from trl_aspo.values.prompt_ids import prompt_key
from trl_aspo.values.sampler import PrioritizedRepeatSampler


class DrawLog:
    """Per `draw` call: the weights used and the tracker state at that moment; per round: the prompt keys."""

    def __init__(self, monkeypatch) -> None:
        self.trainer: ASPOTrainer | None = None
        self.draws: list[dict] = []
        self.rounds: list[list[str]] = []
        draw = PrioritizedRepeatSampler.draw

        def recording_draw(sampler, *args, **kwargs):
            weights = sampler.weights.clone()
            tracker = self.trainer._values.tracker.state_dict()
            indices = draw(sampler, *args, **kwargs)
            self.draws.append({"weights": weights, "tracker": tracker, "indices": indices})
            return indices

        monkeypatch.setattr(PrioritizedRepeatSampler, "draw", recording_draw)

    def attach(self, trainer: ASPOTrainer) -> ASPOTrainer:
        self.trainer = trainer
        calculate_rewards = trainer._calculate_rewards

        def recording_calculate_rewards(inputs, prompts, completions, completion_ids_list):
            self.rounds.append([prompt_key(prompt) for prompt in prompts])
            return calculate_rewards(inputs, prompts, completions, completion_ids_list)

        trainer._calculate_rewards = recording_calculate_rewards
        return trainer


def expected_weights(tracker_state: dict, keys: list[str], event: int) -> torch.Tensor:
    """sqrt(v (1 - v)) + 0.05 of every dataset prompt, from a tracker snapshot (full recomputation)."""
    if tracker_state["type"] == "EventValueTracker":
        tracker = EventValueTracker()
        tracker.load_state_dict(tracker_state)
        values = tracker.value(keys, event)
    else:
        tracker = VisitValueTracker()
        tracker.load_state_dict(tracker_state)
        values = tracker.value(keys)
    return (values * (1 - values)).sqrt() + 0.05


@pytest.fixture
def make_trainer(tiny_config, tiny_tokenizer, calculator_dataset):
    """SPO++ with prioritized sampling: one completion per prompt, 4 prompts per round out of 16."""
    from trl_aspo.builtin import build_random_model

    def make(**overrides) -> ASPOTrainer:
        fields = dict(
            advantage_estimator="spo++",
            num_generations=1,
            per_device_train_batch_size=4,
            max_steps=4,
            max_completion_length=12,
            prioritized_sampling=True,
        )
        fields.update(overrides)
        return ASPOTrainer(
            model=build_random_model(tiny_tokenizer, seed=0),
            reward_funcs=[digit_share_reward],
            args=tiny_config(**fields),
            train_dataset=calculator_dataset.select(range(16)),
            processing_class=tiny_tokenizer,
        )

    return make


SETUPS = {
    "spo++": dict(),
    "spo++, 2 loader workers": dict(dataloader_num_workers=2),
    "spo++, 2 steps per round": dict(per_device_train_batch_size=2, steps_per_generation=2, max_steps=6),
    "spo, KL-adaptive rho": dict(advantage_estimator="spo", value_rho_mode="kl"),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(SETUPS))
def test_each_draw_uses_the_previous_rounds_outcomes(make_trainer, monkeypatch, setup):
    log = DrawLog(monkeypatch)
    trainer = log.attach(make_trainer(**SETUPS[setup]))
    trainer.train()
    keys = trainer._values.dataset_keys
    assert len(log.rounds) >= 3
    for index, round_keys in enumerate(log.rounds):
        drawn = log.draws[index]
        assert round_keys == [keys[row] for row in drawn["indices"]]
        torch.testing.assert_close(
            drawn["weights"], expected_weights(drawn["tracker"], keys, index), atol=1e-12, rtol=0
        )
        if index == 0:
            continue
        # Every prompt of the previous round has entered the tracker since the previous draw.
        before, now = log.draws[index - 1]["tracker"]["state"], drawn["tracker"]["state"]
        changed = {key for key in now if before.get(key) != now[key]}
        assert set(log.rounds[index - 1]) <= changed
    # The incrementally refreshed weights equal a full recomputation from the final tracker.
    if trainer._values.pending_visit is None:
        final = expected_weights(trainer._values.tracker.state_dict(), keys, trainer._value_event)
        torch.testing.assert_close(trainer._priority_sampler.weights, final, atol=1e-12, rtol=0)
        assert trainer._priority_sampler.weights.std() > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [
        dict(),
        dict(per_device_train_batch_size=2, steps_per_generation=2, max_steps=8, save_steps=4),
        dict(advantage_estimator="spo", value_rho_mode="kl"),
    ],
    ids=["spo++", "spo++, 2 steps per round", "spo, KL-adaptive rho"],
)
def test_resumed_run_draws_what_the_uninterrupted_run_drew(make_trainer, monkeypatch, tmp_path, setup):
    fields = dict(save_strategy="steps", save_steps=2, output_dir=str(tmp_path / "run"))
    fields.update(setup)
    log = DrawLog(monkeypatch)
    uninterrupted = log.attach(make_trainer(**fields))
    uninterrupted.train()
    rounds_total = len(log.rounds)

    resumed_log = DrawLog(monkeypatch)
    fields["output_dir"] = str(tmp_path / "resumed")
    resumed = resumed_log.attach(make_trainer(**fields))
    checkpoint = os.path.join(tmp_path / "run", f"checkpoint-{fields['save_steps']}")
    resumed.train(resume_from_checkpoint=checkpoint)

    assert resumed.state.global_step == uninterrupted.state.global_step
    first = rounds_total - len(resumed_log.rounds)
    assert first > 0 and resumed_log.rounds == log.rounds[first:]
    assert resumed._values.tracker.state_dict() == uninterrupted._values.tracker.state_dict()
    torch.testing.assert_close(resumed._priority_sampler.weights, uninterrupted._priority_sampler.weights)
