"""Issues 11 and 17: the reference recipe's options and the honesty checks, exercised through real TRL training on
the tiny model (a few steps each), including the schedule stepped once per generation round and the clamped k3 KL.
Expected numbers are recomputed by hand from what the trainer was given."""

from __future__ import annotations

import warnings

import numpy
import pytest
import torch
from helpers import digit_share_reward, stepped_learning_rates

from trl_aspo import ASPOTrainer
from trl_aspo.algorithms.kl import k3_kl
from trl_aspo.builtin import build_random_model
from trl_aspo.values.scoring import AdvantageBatch


def first_char_is_digit(completions, **kwargs) -> list[float]:
    """1 if the completion starts with a digit: coarse, so many groups of 4 have all-equal rewards."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(text[:1].isdigit()) for text in texts]


def record_rounds(trainer: ASPOTrainer) -> list[dict]:
    """Per generation round: TRL's gathered rewards per function and the trainer's output batch."""
    rounds: list[dict] = []
    calculate_rewards = trainer._calculate_rewards
    generate_and_score = trainer._generate_and_score_completions

    def recording_calculate_rewards(inputs, prompts, completions, completion_ids_list):
        rewards = calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rounds.append({"rewards": rewards.clone(), "lengths": [len(ids) for ids in completion_ids_list]})
        return rewards

    def recording_generate_and_score(inputs):
        output = generate_and_score(inputs)
        rounds[-1]["output"] = output
        return output

    trainer._calculate_rewards = recording_calculate_rewards
    trainer._generate_and_score_completions = recording_generate_and_score
    return rounds


def make(tiny_tokenizer, dataset, config, reward_funcs=(digit_share_reward,), **kwargs) -> ASPOTrainer:
    return ASPOTrainer(
        model=build_random_model(tiny_tokenizer, seed=0),
        reward_funcs=list(reward_funcs),
        args=config,
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
        **kwargs,
    )


@pytest.mark.slow
def test_zero_variance_filter_and_overlong_penalty(tiny_tokenizer, calculator_dataset, tiny_config):
    """Item 5: TRL's soft overlong punishment as a YAML-configurable reward, and groups with all-equal rewards
    dropped from the loss (their tokens leave the mask and the token count), logged as the share dropped."""
    config = tiny_config(
        max_completion_length=16,
        overlong_buffer_length=8,
        overlong_penalty_factor=0.5,
        filter_zero_variance_groups=True,
        max_steps=3,
    )
    trainer = make(tiny_tokenizer, calculator_dataset, config, reward_funcs=(first_char_is_digit,))
    assert trainer.reward_func_names == ["first_char_is_digit", "soft_overlong_punishment_reward"]
    assert trainer.reward_weights.tolist() == [1.0, 0.5]
    assert config.reward_weights is None  # the user's config is not mutated
    rounds = record_rounds(trainer)
    trainer.train()

    steps = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rounds) == len(steps) == 3
    dropped_any = kept_any = False
    for record, step in zip(rounds, steps, strict=True):
        # DAPO's penalty by hand: 0 up to 16 - 8 = 8 tokens, then (8 - L) / 8, -1 beyond 16.
        lengths = torch.tensor(record["lengths"], dtype=torch.float32)
        penalty = torch.where(lengths <= 8, torch.zeros_like(lengths), (8 - lengths) / 8).clamp(min=-1.0)
        torch.testing.assert_close(record["rewards"][:, 1], penalty)
        total = record["rewards"][:, 0] + 0.5 * penalty
        grouped = total.view(-1, 4)
        equal = (grouped.max(dim=1).values == grouped.min(dim=1).values).repeat_interleave(4)
        assert step["filter/zero_variance_dropped_share"] == pytest.approx(equal.float().mean().item())
        output = record["output"]
        assert (output["completion_mask"][equal] == 0).all()
        kept_mask = output["completion_mask"][~equal]
        assert (kept_mask.sum(dim=1) > 0).all()
        assert output["num_items_in_batch"].item() == kept_mask.sum().item()
        # Item 10: quantiles of the normalized advantages of the kept groups (numpy's linear interpolation).
        if (~equal).any():
            quantiles = numpy.quantile(output["advantages"][~equal].double().numpy(), [0.1, 0.3, 0.5, 0.7, 0.9])
            for level, value in zip((10, 30, 50, 70, 90), quantiles, strict=True):
                assert step[f"advantage/p{level}"] == pytest.approx(value, abs=1e-6)
        dropped_any |= bool(equal.any())
        kept_any |= bool((~equal).any())
    assert dropped_any and kept_any, "the run must exercise both dropped and kept groups"


def test_tool_shaping_without_tools_or_pattern_warns(tiny_tokenizer, tiny_model, calculator_dataset, tiny_config):
    """Item 9: only the trainer sees `tools=`: shaping with neither tools nor a pattern is named in a warning."""
    from trl_aspo.builtin.task import calculator

    with pytest.warns(UserWarning, match="ASPOConfig.tool_shaping=True.*tool_call_pattern"):
        ASPOTrainer(
            tiny_model,
            [digit_share_reward],
            tiny_config(tool_shaping=True),
            train_dataset=calculator_dataset,
            processing_class=tiny_tokenizer,
        )
    for config, tools in (
        (tiny_config(tool_shaping=True), [calculator]),
        (tiny_config(tool_shaping=True, tool_call_pattern="```"), None),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ASPOTrainer(
                build_random_model(tiny_tokenizer, seed=0),
                [digit_share_reward],
                config,
                train_dataset=calculator_dataset,
                processing_class=tiny_tokenizer,
                tools=tools,
            )
        assert not [w for w in caught if "tool_shaping" in str(w.message)]


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call><|im_end|>'


def test_interactive_turns_ignore_whitespace_in_training_as_in_evaluation(
    tiny_tokenizer, tiny_model, calculator_dataset, tiny_config
):
    """Item 7: text before a call that is only whitespace does not make the turn interactive, in the trainer's
    tool statistics exactly as in evaluation's per-turn rule (the parsed turn's content)."""
    from trl.chat_template_utils import parse_response

    from trl_aspo.algorithms.tool_metrics import is_model_text
    from trl_aspo.builtin.task import calculator

    trainer = ASPOTrainer(
        tiny_model,
        [digit_share_reward],
        tiny_config(),
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
        tools=[calculator],
    )
    turns = ["\n  " + CALL, "Let me compute.\n" + CALL, CALL, "\n\n" + CALL]
    rows = [tiny_tokenizer.encode(text, add_special_tokens=False) for text in turns]
    # Each call ran: the tool's response follows it (tool_mask 0), as TRL's tool loop inserts it.
    response = tiny_tokenizer.encode("\n<tool_response>\n408\n</tool_response>", add_special_tokens=False)
    width = max(map(len, rows)) + len(response)
    completion_ids = torch.zeros(len(rows), width, dtype=torch.long)
    completion_mask = torch.zeros(len(rows), width, dtype=torch.long)
    tool_mask = torch.ones(len(rows), width, dtype=torch.long)
    for index, ids in enumerate(rows):
        completion_ids[index, : len(ids) + len(response)] = torch.tensor(ids + response)
        completion_mask[index, : len(ids) + len(response)] = 1
        tool_mask[index, len(ids) : len(ids) + len(response)] = 0
    output = {"completion_ids": completion_ids, "completion_mask": completion_mask, "tool_mask": tool_mask}
    training_turns = trainer._tool_statistics(output)[:, 3].tolist()

    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 * 34?"}],
        tools=[calculator],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    evaluation_turns = []
    for ids in rows:
        message = parse_response(tiny_tokenizer, ids, prefix=prompt, tools=[calculator])
        assert message.get("tool_calls")
        evaluation_turns.append(int(is_model_text(message.get("content") or "")))
    assert training_turns == evaluation_turns == [0, 1, 0, 0]


def test_correct_means_reward_at_least_threshold_in_shaping_and_evaluation(
    tiny_tokenizer, tiny_model, calculator_dataset, tiny_config
):
    """Item 8: a reward equal to the threshold is correct for tool shaping as for `trl-aspo evaluate`."""
    from trl_aspo.algorithms.shaping import is_correct, tool_position_bias
    from trl_aspo.builtin.task import calculator, make_dataset
    from trl_aspo.evaluation.tool_use import evaluate_tool_use

    assert is_correct(torch.tensor([0.4, 0.5, 0.6, float("nan")]), 0.5).tolist() == [False, True, True, False]

    trainer = ASPOTrainer(
        tiny_model,
        [digit_share_reward],
        tiny_config(tool_shaping=True, tool_shaping_correct_threshold=0.5),
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
        tools=[calculator],
    )
    advantages = torch.tensor([1.0, 1.0, 1.0, -0.5])
    rewards = torch.tensor([0.5, 0.5, 0.75, 0.25])  # the first two sit exactly on the threshold
    positions = torch.tensor([0, 4, 8, 2])
    tool_stats = torch.stack(
        [positions, torch.full((4,), 10), torch.ones(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)], dim=1
    )
    trainer.num_generations = 4
    batch = AdvantageBatch(
        centered=advantages,
        scorable=torch.ones(len(advantages), dtype=torch.bool),
        token_counts=tool_stats[:, 1],
        group_ids=torch.arange(len(advantages)) // trainer.num_generations,
        rewards=rewards,
        tool_stats=tool_stats,
    )
    shaped, shaping_metrics = trainer._pipeline.shape(advantages, batch)
    eligible = torch.tensor([True, True, True, False])
    expected = advantages + tool_position_bias(
        advantages, positions, torch.full((4,), 10), eligible, torch.zeros(4, dtype=torch.long)
    )
    torch.testing.assert_close(shaped, expected)
    # By hand: mean position of the eligible 0, 4, 8 is 4, mean length 10: b = -2 (p - 4) / 10 = 0.8, 0, -0.8,
    # clipped to +-0.7 |A| = 0.7.
    torch.testing.assert_close(shaped, torch.tensor([1.7, 1.0, 0.3, -0.5]))

    def half_reward(completions, **kwargs):
        return [0.5] * len(completions)

    result = evaluate_tool_use(
        trainer.model,
        tiny_tokenizer,
        make_dataset("test", 2, seed=0),
        half_reward,
        [calculator],
        max_completion_length=4,
        success_threshold=0.5,
    )
    assert result["accuracy"] == 1.0


@pytest.mark.slow
def test_value_evidence_visits_and_advantage_quantiles(tiny_tokenizer, calculator_dataset, tiny_config):
    """Item 10: `value/alpha_plus_beta` (effective evidence of the dispatched prompts), `value/visits_per_prompt`
    and `advantage/p10`..`p90` after normalization, by hand for SPO++ with every prompt drawn every round."""
    config = tiny_config(advantage_estimator="spo++", num_generations=1, max_steps=3, max_completion_length=12)
    trainer = make(tiny_tokenizer, calculator_dataset.select(range(8)), config)
    rounds = record_rounds(trainer)
    trainer.train()
    steps = [row for row in trainer.state.log_history if "loss" in row]
    # Prior (0.5, 0.5) entered at the first dispatch, one outcome per round: alpha + beta = 1, then
    # 0.875 * (1 + 1) = 1.75, then 0.875 * (1.75 + 1) = 2.40625.
    assert [step["value/alpha_plus_beta"] for step in steps] == pytest.approx([1.0, 1.75, 2.40625], abs=1e-6)
    assert [step["value/visits_per_prompt"] for step in steps] == [0.0, 1.0, 2.0]
    for record, step in zip(rounds, steps, strict=True):
        quantiles = numpy.quantile(record["output"]["advantages"].double().numpy(), [0.1, 0.3, 0.5, 0.7, 0.9])
        for level, value in zip((10, 30, 50, 70, 90), quantiles, strict=True):
            assert step[f"advantage/p{level}"] == pytest.approx(value, abs=1e-6)
    assert trainer._values.tracker.visits(sorted(trainer._values.tracker.state_dict()["state"])).tolist() == [3] * 8


@pytest.mark.slow
def test_model_card_cites_the_methods_used(tiny_tokenizer, calculator_dataset, tiny_config, tmp_path):
    """Item 11: after a short run, TRL's model card names the first method and cites every one used, and GRPO."""
    config = tiny_config(
        loss_type="aspo", num_iterations=2, advantage_estimator="spo++", num_generations=1, max_steps=1
    )
    trainer = make(tiny_tokenizer, calculator_dataset.select(range(8)), config)
    trainer.train()
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "https://huggingface.co/papers/2510.06062" in card  # the named paper: ASPO, the first method
    for arxiv_id in ("2510.06062", "2608.24870", "2509.13232", "2402.03300"):
        assert f"eprint       = {{arXiv:{arxiv_id}}}" in card
    assert "2508.19201" not in card  # tool shaping is off

    plain = make(tiny_tokenizer, calculator_dataset, tiny_config(output_dir=str(tmp_path / "plain")))
    assert plain._paper["id"] == "2402.03300"  # every switch off: GRPO's card


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["spo++", "spo"])
def test_values_export_round_trips_as_value_init_file(
    tiny_tokenizer, calculator_dataset, tiny_config, tmp_path, estimator
):
    """Item 12: `trl-aspo values CHECKPOINT --output values.jsonl` exports each prompt's value, alpha, beta, evidence
    and visits; a new run given the file as `value_init_file` starts every prompt at exactly those pseudo-counts."""
    import json

    from trl_aspo.cli.main import main as cli_main

    dataset = calculator_dataset.select(range(8))
    config = tiny_config(
        advantage_estimator=estimator,
        num_generations=1,
        max_steps=2,
        max_completion_length=12,
        save_strategy="steps",
        save_steps=2,
        output_dir=str(tmp_path / "run"),
    )
    trainer = make(tiny_tokenizer, dataset, config)
    trainer.train()
    output = tmp_path / "values.jsonl"
    assert cli_main(["values", str(tmp_path / "run" / "checkpoint-2"), "--output", str(output)]) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]

    tracker = trainer._values.tracker
    keys = sorted(tracker.state_dict()["state"])
    assert [record["prompt_id"] for record in records] == keys and len(keys) == 8
    alphas, betas = tracker.pseudo_counts(keys, 2) if estimator == "spo++" else tracker.pseudo_counts(keys)
    for record, alpha, beta in zip(records, alphas.tolist(), betas.tolist(), strict=True):
        assert (record["alpha"], record["beta"]) == pytest.approx((alpha, beta), abs=1e-12)
        assert record["evidence"] == pytest.approx(alpha + beta, abs=1e-12)
        assert record["value"] == pytest.approx(alpha / (alpha + beta), abs=1e-12)
        assert record["visits"] == 2  # every prompt drawn in both rounds
    if estimator == "spo++":
        # By hand: prior (0.5, 0.5) entered at event 0, outcomes at events 0 and 1, aged to event 2.
        assert records[0]["evidence"] == pytest.approx(0.875**2 + 0.875**2 + 0.875, abs=1e-12)

    restarted = make(
        tiny_tokenizer,
        dataset,
        tiny_config(advantage_estimator=estimator, num_generations=1, value_init_file=str(output)),
    )
    fresh = restarted._values.tracker
    counts = fresh.pseudo_counts(keys, 0) if estimator == "spo++" else fresh.pseudo_counts(keys)
    assert counts[0].tolist() == [record["alpha"] for record in records]
    assert counts[1].tolist() == [record["beta"] for record in records]


def test_trainer_steps_its_schedule_once_per_generation_round(tiny_tokenizer, calculator_dataset, tiny_config):
    """2 optimizer steps per round (steps_per_generation=2, one accumulation step), warmup over 4 steps: the
    multipliers by hand are 0, 0, 0.5, 0.5, 1, 1 (TRL's per-step warmup: 0, 0.25, 0.5, 0.75, 1, 1)."""
    rates = {}
    for per_generation in (True, False):
        config = tiny_config(
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=4,
            steps_per_generation=2,
            gradient_accumulation_steps=1,
            lr_schedule_per_generation=per_generation,
        )
        trainer = ASPOTrainer(
            model=build_random_model(tiny_tokenizer, seed=0),
            reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
            args=config,
            train_dataset=calculator_dataset,
            processing_class=tiny_tokenizer,
        )
        trainer.create_optimizer_and_scheduler(num_training_steps=6)
        trainer.create_scheduler(6, trainer.optimizer)  # a second call must not change the rounding
        rates[per_generation] = stepped_learning_rates(trainer.lr_scheduler.lr_lambdas[0], 1e-3, 6)
    assert rates[True] == pytest.approx([0.0, 0.0, 5e-4, 5e-4, 1e-3, 1e-3])
    assert rates[False] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


@pytest.mark.slow
@pytest.mark.parametrize("clamp", [None, 1e-9])
def test_trainer_kl_term_is_the_clamped_k3(
    tiny_tokenizer, calculator_dataset, tiny_config, monkeypatch, tmp_path, clamp
):
    """The aspo loss's per-token KL is k3 clamped to [-kl_clamp, kl_clamp] (by hand), or TRL's k3 without it. The
    second step's policy has moved from the reference, so a 1e-9 clamp binds."""
    from helpers import digit_share_reward

    import trl_aspo.trainers.loss_assembly as trainer_module

    calls = []

    def recording_k3_kl(ref_logps, logps, kl_clamp=None):
        out = k3_kl(ref_logps, logps, kl_clamp)
        calls.append((ref_logps.detach(), logps.detach(), kl_clamp, out.detach()))
        return out

    monkeypatch.setattr(trainer_module, "k3_kl", recording_k3_kl)
    config = tiny_config(loss_type="aspo", beta=0.1, kl_clamp=clamp, num_iterations=2)
    build_random_model(tiny_tokenizer, seed=0).save_pretrained(tmp_path / "policy")  # TRL loads the reference from it
    ASPOTrainer(
        model=str(tmp_path / "policy"),
        reward_funcs=[digit_share_reward],
        args=config,
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
    ).train()
    assert calls
    for ref, logps, kl_clamp, out in calls:
        assert kl_clamp == clamp
        log_ratio = ref - logps
        k3 = torch.exp(log_ratio) - log_ratio - 1  # TRL's expression
        torch.testing.assert_close(out, k3 if clamp is None else k3.clamp(-clamp, clamp), rtol=0, atol=0)
    if clamp is not None:
        ref, logps, _, out = calls[-1]
        assert bool((torch.exp(ref - logps) - (ref - logps) - 1 > clamp).any())  # the clamp bound somewhere
