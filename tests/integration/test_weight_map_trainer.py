"""Issue 19 item 1: the trainer's weight_map.json holds every trained token of an off-policy run, and a resumed run
continues the checkpoint's map."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import digit_share_reward

from trl_aspo.algorithms.weight_map import WEIGHT_MAP_FILE


class _CountingTrainer:
    """Counts, per loss call with behaviour log-probs, the action tokens with a nonzero advantage (from the inputs
    alone, independently of the map)."""

    @staticmethod
    def build(base):
        class Counting(base):
            off_policy_tokens = 0

            def _compute_loss(self, model, inputs):
                if self.model.training and inputs.get("old_per_token_logps") is not None:
                    mask = inputs["completion_mask"].bool()
                    advantages = inputs["advantages"]
                    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
                    type(self).off_policy_tokens += int((mask & (advantages != 0)).sum())
                return super()._compute_loss(model, inputs)

        return Counting


@pytest.mark.parametrize("loss_type", ["dapo", "aspo"])
def test_an_off_policy_run_writes_the_map_of_every_trained_token(
    loss_type, tiny_model, tiny_tokenizer, calculator_dataset, tiny_config
):
    from trl_aspo import ASPOTrainer

    args = tiny_config(
        loss_type=loss_type, num_iterations=2, max_steps=3, max_completion_length=8, log_weight_map=True
    )
    trainer_class = _CountingTrainer.build(ASPOTrainer)
    trainer = trainer_class(
        tiny_model, [digit_share_reward], args, train_dataset=calculator_dataset, processing_class=tiny_tokenizer
    )
    trainer.train()
    with open(f"{args.output_dir}/{WEIGHT_MAP_FILE}") as handle:
        state = json.load(handle)
    assert state["loss_type"] == loss_type and state["bins"] == 10
    total = sum(sum(map(sum, state["total"][sign]["count"])) for sign in ("positive", "negative"))
    assert trainer_class.off_policy_tokens > 0
    assert total == trainer_class.off_policy_tokens
    windows = state["windows"]
    assert windows and windows[0]["first_step"] == 1 and windows[-1]["last_step"] <= 3
    window_total = sum(sum(map(sum, entry[sign]["count"])) for entry in windows for sign in ("positive", "negative"))
    assert window_total == total
    weights = [w for sign in ("positive", "negative") for row in state["total"][sign]["weight_sum"] for w in row]
    assert all(math.isfinite(w) and w >= 0 for w in weights)


def test_a_resumed_run_continues_the_checkpoints_map(tiny_tokenizer, calculator_dataset, tiny_config):
    from trl_aspo import ASPOTrainer
    from trl_aspo.builtin import build_random_model

    fields = dict(loss_type="aspo", num_iterations=2, max_completion_length=8, log_weight_map=True)
    first_args = tiny_config(**fields, max_steps=2, save_strategy="steps", save_steps=2)
    first_class = _CountingTrainer.build(ASPOTrainer)
    first = first_class(
        build_random_model(tiny_tokenizer, seed=0),
        [digit_share_reward],
        first_args,
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
    )
    first.train()
    checkpoint = Path(first_args.output_dir) / "checkpoint-2"
    saved = json.loads((checkpoint / WEIGHT_MAP_FILE).read_text())
    saved_total = sum(sum(map(sum, saved["total"][sign]["count"])) for sign in ("positive", "negative"))
    assert saved_total == first_class.off_policy_tokens > 0

    resumed_args = tiny_config(**fields, max_steps=3)
    resumed_class = _CountingTrainer.build(ASPOTrainer)
    resumed = resumed_class(
        build_random_model(tiny_tokenizer, seed=0),
        [digit_share_reward],
        resumed_args,
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    state = json.loads((Path(resumed_args.output_dir) / WEIGHT_MAP_FILE).read_text())
    total = sum(sum(map(sum, state["total"][sign]["count"])) for sign in ("positive", "negative"))
    assert resumed_class.off_policy_tokens > 0
    assert total == saved_total + resumed_class.off_policy_tokens
    assert state["windows"][-1]["first_step"] == 3 and state["windows"][-1]["last_step"] == 3
