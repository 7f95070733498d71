"""Issue 19 item 1, second half: `log_weight_map` in AsyncASPOTrainer. Every trained token enters the map with the
generator's log-prob as its old one; the weight is the ppo loss's clipped ratio or the aspo loss's, binned as in the
synchronous trainer (trl_aspo.algorithms.weight_map, shared through trl_aspo.trainers.weight_map_mixin)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    async_weight_map_config,
    calculator_tokenizer,
    fixed_policy,
    packed_inputs,
    trainer_with_local_worker,
)

from trl_aspo.algorithms.weight_map import WEIGHT_MAP_FILE

SIGNS = ("positive", "negative")


@pytest.fixture(scope="module")
def tokenizer():
    return calculator_tokenizer()


def _trainer(trainer_class, args, tokenizer):
    from helpers import digit_share_reward

    from trl_aspo.builtin.task import correctness_reward, make_dataset

    dataset = make_dataset("train", 32, seed=0)
    return trainer_with_local_worker(trainer_class, args, tokenizer, dataset, [correctness_reward, digit_share_reward])


def _counting(base):
    """`base` counting, from each training micro-batch's inputs alone, the trained tokens with a nonzero advantage
    (the tokens the map must hold: A = 0 enters neither sign's grid)."""

    class Counting(base):
        signed_tokens = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            selected = inputs["token_index"] >= 0
            type(self).signed_tokens += int((inputs["advantages"][selected] != 0).sum())
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return Counting


def _total_count(state: dict) -> float:
    return sum(sum(map(sum, state["total"][sign]["count"])) for sign in SIGNS)


# Five packed action tokens (old probability from the generator, current probability from the trainer's forward):
# sample 0 (A = +1): (0.95, 0.85) -> cell (9, 8), r = 0.85/0.95; (0.05, 0.15) -> cell (0, 1), r = 3 (above 1 + eps);
# sample 1 (A = -1): (0.55, 0.55) and (0.55, 0.58) -> cell (5, 5), r = 1 and 0.58/0.55; sample 2 (A = 0) left out.
OLD = [0.95, 0.05, 0.55, 0.55, 0.3]
CURRENT = [0.85, 0.15, 0.55, 0.58, 0.3]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 0.0]
SEGMENTS = [0, 0, 1, 1, 2]
# w of the token at (9, 8): TRL's clipped ratio keeps r; aspo flips it to 1/r. r = 3 is clipped to 0 by both.
# Negative tokens: w = r in both (no flip, r >= 1 - eps and below the dual clip C = 3).
POSITIVE_98 = {"ppo": 0.85 / 0.95, "aspo": 0.95 / 0.85}


@pytest.mark.parametrize("loss_type", ["ppo", "aspo"])
def test_the_packed_loss_bins_every_trained_token_with_its_weight(tmp_path, tokenizer, loss_type):
    from trl_aspo import AsyncASPOTrainer

    trainer = _trainer(AsyncASPOTrainer, async_weight_map_config(tmp_path, loss_type), tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train for each optimizer step
    trainer._loss_step_units = torch.tensor([5.0, 3.0])  # what get_batch_samples counts for aspo_aggregation

    current = torch.tensor(CURRENT).log()[None].requires_grad_(True)
    trainer.compute_loss(fixed_policy(current), packed_inputs(OLD, ADVANTAGES, SEGMENTS)).backward()
    # Each loss is a token mean over the 5 targets: d loss / d lp = -A w / 5, so the loss's own gradient gives w.
    advantages = torch.tensor(ADVANTAGES)
    signed = advantages != 0
    weight_of_loss = -5 * current.grad[0][signed] / advantages[signed]
    expected = [POSITIVE_98[loss_type], 0.0, 1.0, 0.58 / 0.55]
    assert weight_of_loss.tolist() == pytest.approx(expected, rel=1e-5)
    trainer.state.global_step = 1
    trainer._log_weight_map()

    state = json.loads((Path(trainer.args.output_dir) / WEIGHT_MAP_FILE).read_text())
    assert state["loss_type"] == loss_type
    assert [(window["first_step"], window["last_step"]) for window in state["windows"]] == [(1, 1)]
    positive, negative = (state["total"][sign] for sign in SIGNS)
    assert _total_count(state) == 4
    assert positive["count"][9][8] == 1 and positive["weight_sum"][9][8] == pytest.approx(POSITIVE_98[loss_type])
    assert positive["count"][0][1] == 1 and positive["weight_sum"][0][1] == 0.0
    assert negative["count"][5][5] == 2
    assert negative["weight_sum"][5][5] / 2 == pytest.approx((1.0 + 0.58 / 0.55) / 2)


@pytest.mark.slow
def test_a_run_maps_every_trained_token_and_plot_draws_it(tmp_path, tokenizer, capsys):
    from trl_aspo import AsyncASPOTrainer
    from trl_aspo.cli.plot_command import plot_main

    trainer_class = _counting(AsyncASPOTrainer)
    trainer = _trainer(trainer_class, async_weight_map_config(tmp_path, "ppo"), tokenizer)
    trainer.train()
    output_dir = Path(trainer.args.output_dir)
    state = json.loads((output_dir / WEIGHT_MAP_FILE).read_text())
    assert state["loss_type"] == "ppo"
    assert trainer_class.signed_tokens > 0
    assert _total_count(state) == trainer_class.signed_tokens
    trained = sum(log.get("batch/trained_tokens_per_step", 0.0) for log in trainer.state.log_history)
    assert _total_count(state) <= trained
    windows = state["windows"]  # one per logged step that trained a token with A != 0
    assert windows[0]["first_step"] == 1 and windows[-1]["last_step"] <= 2
    assert sum(_total_count({"total": window}) for window in windows) == _total_count(state)
    figure = tmp_path / "map.png"
    assert plot_main([str(output_dir), "--weights", "--output", str(figure)]) == 0
    assert figure.stat().st_size > 10_000
    assert "Figure written to" in capsys.readouterr().out


@pytest.mark.slow
def test_a_resumed_run_continues_the_checkpoints_map(tmp_path, tokenizer):
    from trl_aspo import AsyncASPOTrainer

    first_class = _counting(AsyncASPOTrainer)
    first = _trainer(
        first_class, async_weight_map_config(tmp_path, "aspo", save_strategy="steps", save_steps=2), tokenizer
    )
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    saved = json.loads((checkpoint / WEIGHT_MAP_FILE).read_text())
    assert _total_count(saved) == first_class.signed_tokens > 0

    resumed_class = _counting(AsyncASPOTrainer)
    resumed = _trainer(resumed_class, async_weight_map_config(tmp_path, "aspo", max_steps=3), tokenizer)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    state = json.loads((tmp_path / "out" / WEIGHT_MAP_FILE).read_text())
    assert resumed_class.signed_tokens > 0
    assert _total_count(state) == _total_count(saved) + resumed_class.signed_tokens
    assert state["windows"][-1]["first_step"] == 3 and state["windows"][-1]["last_step"] == 3
