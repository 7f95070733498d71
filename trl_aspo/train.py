"""YAML-configured training: `trl-aspo train --config X.yaml [--key value ...]`.

Arguments follow TRL's `TrlParser` conventions: a YAML file given with `--config` sets the defaults of every field
of `ASPOScriptArguments`, `ASPOConfig`, `ModelConfig` and `DatasetMixtureConfig`; command-line flags override it;
an `env:` block sets environment variables; a key that no dataclass knows is an error that names it.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

from .config import ASPOConfig

BUILTIN_DATASET = "builtin:calculator"
BUILTIN_REWARDS = {"builtin:correctness": "trl_aspo.builtin.task.correctness_reward"}
BUILTIN_TOOLS = {"builtin:calculator": "trl_aspo.builtin.task.calculator"}


@dataclass
class ASPOScriptArguments(ScriptArguments):
    """What to train on: dataset, reward functions, tools, and the built-in task's sizes and evaluation."""

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: dotted import paths (e.g. 'my_lib.rewards.correct') or built-in names "
            f"{sorted(BUILTIN_REWARDS)}. Their `rewards/<name>` metrics use the function names."
        },
    )
    tools: list[str] | None = field(
        default=None,
        metadata={
            "help": "Tools the model may call through TRL's tool loop: dotted import paths of functions with type "
            f"hints and a Google-style docstring, or built-in names {sorted(BUILTIN_TOOLS)}."
        },
    )
    builtin_train_size: int = field(
        default=2000, metadata={"help": f"Training problems generated for dataset_name={BUILTIN_DATASET!r}."}
    )
    builtin_test_size: int = field(
        default=200, metadata={"help": f"Held-out problems generated for dataset_name={BUILTIN_DATASET!r}."}
    )
    builtin_seed: int = field(default=0, metadata={"help": "Seed of the built-in task's problem generator."})
    evaluate_before_after: bool = field(
        default=False,
        metadata={
            "help": "Evaluate tool use on the held-out split before and after training, print a before/after "
            "summary and write it to `<output_dir>/summary.json`."
        },
    )
    eval_samples_per_problem: int = field(
        default=1, metadata={"help": "Completions per held-out problem in the before/after evaluation (avg@k)."}
    )
    eval_temperature: float = field(
        default=0.0, metadata={"help": "Sampling temperature of the before/after evaluation; 0 = greedy."}
    )
    plot: bool = field(default=True, metadata={"help": "Save training curves as `<output_dir>/training_curves.png`."})


def make_parser(prog: str | None = None) -> TrlParser:
    return TrlParser((ASPOScriptArguments, ASPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def resolve_callable(name: str, builtins: dict[str, str], what: str):
    """Import `name` (a built-in name or a dotted path), naming the argument in the error."""
    dotted = builtins.get(name, name)
    module_name, _, attribute = dotted.rpartition(".")
    if not module_name:
        raise ValueError(
            f"{what} {name!r} is neither a built-in ({sorted(builtins)}) nor a dotted import path like 'pkg.mod.fn'."
        )
    # User modules in the working directory are found, after installed packages: a local `matplotlib.py` shadows none.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {name!r} could not be imported: {error}") from None


def load_datasets(script_args: ASPOScriptArguments, dataset_args: DatasetMixtureConfig):
    """Return (train, test) datasets; the built-in task is generated locally, anything else goes through TRL."""
    if script_args.dataset_name == BUILTIN_DATASET:
        from .builtin.task import make_dataset

        train = make_dataset("train", script_args.builtin_train_size, seed=script_args.builtin_seed)
        test = make_dataset("test", script_args.builtin_test_size, seed=script_args.builtin_seed)
        return train, test
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    else:
        raise ValueError(f"Set `dataset_name` (a dataset name or {BUILTIN_DATASET!r}) or `datasets`.")
    test = dataset.get(script_args.dataset_test_split)
    return dataset[script_args.dataset_train_split], test


def main(argv: list[str] | None = None) -> None:
    # TRL 1.16 still calls transformers' renamed gradient-checkpointing API; the notices say nothing to a user.
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.*deprecated", category=FutureWarning)
    parser = make_parser(prog="trl-aspo train")
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(args=argv)
    run(script_args, training_args, model_args, dataset_args)


def run(
    script_args,
    training_args: ASPOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    callbacks: list | None = None,
):
    """Train, save the model and return the trainer; `callbacks` replace transformers' progress bar when given."""
    from transformers.trainer_callback import ProgressCallback
    from trl import get_peft_config

    from .trainer import ASPOTrainer

    if not model_args.model_name_or_path:
        raise ValueError("Set `model_name_or_path`: a local model directory, a hub id, or 'builtin:tiny-calculator'.")
    if not script_args.reward_funcs:
        raise ValueError(f"Set `reward_funcs`: dotted import paths or built-in names {sorted(BUILTIN_REWARDS)}.")
    reward_funcs = [resolve_callable(name, BUILTIN_REWARDS, "reward_funcs entry") for name in script_args.reward_funcs]
    tools = [resolve_callable(name, BUILTIN_TOOLS, "tools entry") for name in script_args.tools or []]
    train_dataset, test_dataset = load_datasets(script_args, dataset_args)

    if not model_args.model_name_or_path.startswith("builtin:"):
        init_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype}
        if model_args.attn_implementation is not None:
            init_kwargs["attn_implementation"] = model_args.attn_implementation
        training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}

    trainer = ASPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=test_dataset if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
        tools=tools or None,
    )
    if callbacks:
        trainer.remove_callback(ProgressCallback)
        for callback in callbacks:
            trainer.add_callback(callback)
    report = None
    if script_args.evaluate_before_after:
        from .report import BeforeAfterReport

        report = BeforeAfterReport(
            trainer,
            test_dataset,
            reward_funcs,
            tools,
            script_args.eval_samples_per_problem,
            script_args.eval_temperature,
        )
        report.measure("before")
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if report is not None:
        report.measure("after")
        report.finish()
    if script_args.plot and trainer.accelerator.is_main_process:
        from .plotting import plot_training_curves

        path = plot_training_curves(trainer.state.log_history, training_args.output_dir)
        trainer.accelerator.print(f"Training curves saved to {path}.")
    trainer.accelerator.wait_for_everyone()
    return trainer


if __name__ == "__main__":
    main()
