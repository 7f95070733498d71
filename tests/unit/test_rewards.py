"""The GPU recipes parse into the reference arithmetic, and summed rewards add functions as the async worker does
(the code reward's sandbox: tests/integration/test_rewards_sandbox.py)."""

from __future__ import annotations

import warnings

import pytest

from trl_aspo.cli.parsers import make_parser


@pytest.mark.parametrize("path", ["configs/archer2_math.yaml", "configs/archer2_code.yaml"])
def test_reference_recipes_match_the_reference_arithmetic(path):
    """Issue 11 item 5: the Archer2.0 scripts' 64 prompts x 16 completions per rollout, mini-batches of 16 prompts
    and 3 epochs (12 optimizer steps per rollout), under GRPOConfig's semantics on the recipe's 8 GPUs."""
    # bf16 and vLLM are GPU settings: override them so the configuration validates on a CPU machine.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        script, training, model, _ = make_parser().parse_args_and_config(
            args=["--config", path, "--bf16", "false", "--use_cpu", "true", "--use_vllm", "false"]
        )
    assert not [w for w in caught if "on-policy" in str(w.message)]  # the flip acts in this recipe
    gpus = 8
    # GRPOConfig: generation_batch_size = per_device_train_batch_size x processes x steps_per_generation.
    assert training.generation_batch_size == training.per_device_train_batch_size * training.steps_per_generation
    completions_per_round = training.per_device_train_batch_size * gpus * training.steps_per_generation
    assert completions_per_round == 1024 and completions_per_round // training.num_generations == 64
    completions_per_optimizer_step = training.per_device_train_batch_size * gpus * training.gradient_accumulation_steps
    assert completions_per_optimizer_step // training.num_generations == 16  # mini-batch of 16 prompts
    assert training.steps_per_generation // training.gradient_accumulation_steps == 4  # mini-batches per rollout
    assert training.num_iterations == 3  # ppo_epochs
    optimizer_steps_per_rollout = training.steps_per_generation // training.gradient_accumulation_steps * 3
    assert optimizer_steps_per_rollout == 12
    assert training.learning_rate == 1e-6 and training.weight_decay == 0.1 and training.max_grad_norm == 1.0
    assert training.beta == 0.001 and training.loss_type == "aspo"  # schedule, aggregation: test_reference_recipes.py
    assert (training.epsilon, training.epsilon_high) == (0.2, 0.2)
    assert (training.aspo_dual_clip_pos, training.aspo_dual_clip_neg) == (3.0, 3.0)
    assert training.aspo_entropy_quantile == 0.8 and training.aspo_epsilon_high_entropy == 0.4
    assert training.max_completion_length == 32768 and training.temperature == 1.0
    assert training.overlong_buffer_length == 16 and training.overlong_penalty_factor == 1.0
    assert training.filter_zero_variance_groups
    assert model.model_name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"


def test_summed_rewards_adds_functions_like_the_async_worker():
    import math

    from trl_aspo.evaluation.rewards import summed_rewards

    def first(completions, **kwargs):
        return [1.0, None, None, 0.5]

    async def second(completions, **kwargs):
        return [0.25, 0.5, None, float("nan")]

    totals = summed_rewards([first, second])(completions=["a", "b", "c", "d"], prompts=["p"] * 4)
    assert totals[0] == 1.25 and totals[1] == 0.5 and math.isnan(totals[2]) and totals[3] == 0.5
