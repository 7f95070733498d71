"""A non-finite step never reaches the weights (issue 43 item 4): a NaN loss and an inf gradient (a bf16-style
overflow) stop the run in both trainers with a message naming the step, the raw value and where it appeared, the
weights and optimizer state untouched and no checkpoint written; `skip_nonfinite_grad_steps` skips and counts
instead; a NaN loss on one rank only of two processes stops both, neither hanging."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import WORKERS_DIR

from trl_aspo.algorithms.policy_losses import unregister_policy_loss

TRAINERS = ["sync", "async"]


@pytest.fixture(scope="module")
def nonfinite_losses():
    spec = importlib.util.spec_from_file_location("nonfinite_losses", WORKERS_DIR / "nonfinite_losses.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    unregister_policy_loss("nan_loss")
    unregister_policy_loss("nan_on_rank_1")


def build(kind: str, tmp_path, **overrides):
    """A trainer of `kind` on the built-in tiny model, saving a checkpoint after every step."""
    from helpers import async_fields, tiny_run_fields

    from trl_aspo import ASPOConfig, ASPOTrainer, AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin import TINY_CALCULATOR
    from trl_aspo.builtin.task import correctness_reward, make_dataset

    fields = {"num_generations": 1, "advantage_estimator": "spo++", "max_steps": 2, "max_completion_length": 16}
    fields.update(save_strategy="steps", save_steps=1, **overrides)
    dataset = make_dataset("train", 16, seed=0)
    if kind == "sync":
        args = ASPOConfig(**tiny_run_fields(tmp_path / "out", **fields))
        return ASPOTrainer(TINY_CALCULATOR, [correctness_reward], args, train_dataset=dataset)
    from helpers import calculator_tokenizer, trainer_with_local_worker

    args = AsyncASPOConfig(**async_fields(tmp_path, **fields))
    return trainer_with_local_worker(AsyncASPOTrainer, args, calculator_tokenizer(), dataset, [correctness_reward])


def weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def overflow_at_step_one(trainer):
    """A gradient hook that turns the final norm's gradient inf during step 1, as a bf16 product overflowing would;
    the loss stays finite."""
    from transformers import TrainerCallback

    parameter = dict(trainer.model.named_parameters())["model.norm.weight"]
    handles = []

    class Overflow(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                handles.append(parameter.register_hook(lambda grad: torch.full_like(grad, float("inf"))))

        def on_step_end(self, args, state, control, **kwargs):
            for handle in handles:
                handle.remove()
            handles.clear()

    trainer.add_callback(Overflow())


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINERS)
def test_a_nan_loss_stops_the_run_naming_the_loss_with_the_weights_untouched(kind, tmp_path, nonfinite_losses):
    from trl_aspo.trainers.step_guard import NonFiniteStepError

    trainer = build(kind, tmp_path, loss_type="nan_loss")
    before = weights(trainer)
    with pytest.raises(NonFiniteStepError) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert message.startswith(
        "Optimizer step 1: non-finite values: loss nan (in the policy loss (loss_type='nan_loss'))"
    )
    assert "The step was not applied" in message
    after = weights(trainer)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not any(name.startswith("checkpoint-") for name in os.listdir(trainer.args.output_dir))
    # The optimizer never stepped: no moment holds a value.
    assert all(not state for state in trainer.optimizer.state.values())


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINERS)
def test_an_inf_gradient_names_the_parameter_and_skip_counts_it(kind, tmp_path):
    from trl_aspo.trainers.step_guard import NonFiniteStepError

    trainer = build(kind, tmp_path / "stop", max_steps=1)
    overflow_at_step_one(trainer)
    before = weights(trainer)
    with pytest.raises(
        NonFiniteStepError, match=r"first non-finite gradient on this rank's shard: model\.norm\.weight"
    ):
        trainer.train()
    assert all(torch.equal(before[name], p) for name, p in weights(trainer).items())

    trainer = build(kind, tmp_path / "skip", skip_nonfinite_grad_steps=True)
    overflow_at_step_one(trainer)
    with pytest.warns(RuntimeWarning, match=r"Optimizer step 1: non-finite values: .*The step is skipped"):
        trainer.train()
    counts = [row["optim/nonfinite_loss_steps"] for row in trainer.state.log_history if "optim/" in str(row)]
    assert counts == [1.0, 1.0]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_of_two_stops_both(tmp_path):
    """Rank 1's loss alone is NaN (its gradient is too, and DDP's all-reduce spreads it): both processes stop at
    step 1 before the optimizer steps, the message names rank 1's value; no checkpoint, no hang."""
    config = {
        "model_name_or_path": "builtin:tiny-calculator",
        "dataset_name": "builtin:calculator",
        "builtin_train_size": 32,
        "reward_funcs": ["builtin:correctness"],
        "plugins": ["nonfinite_losses"],
        "loss_type": "nan_on_rank_1",
        "evaluate_before_after": False,
        "plot": False,
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "num_generations": 1,
        "advantage_estimator": "spo++",
        "max_completion_length": 8,
        "save_strategy": "steps",
        "save_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    python_path = os.pathsep.join(filter(None, [str(WORKERS_DIR), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "trl_aspo.cli.main", "train", "--num_processes", "2", "--config", str(path),
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode != 0
    assert "trl-aspo train: Optimizer step 1: non-finite values: rank 0: loss " in result.stderr, result.stderr[-3000:]
    assert "rank 1: loss nan (in the policy loss (loss_type='nan_on_rank_1'))" in result.stderr
    assert not (tmp_path / "out").exists() or not any(
        name.startswith("checkpoint-") for name in os.listdir(tmp_path / "out")
    )
