"""What a `trl-aspo train` configuration is made of: the trainers it can pick, the dataclasses its YAML fills
(`config_classes`, parsed by TRL's `TrlParser`), and how its names become functions and datasets
(`resolve_callable`, `load_datasets`). Shared by the commands (`train`, `evaluate`, `compare`) and by the field table
that `trl_aspo.cli.command_line` checks command lines against (`trl_aspo.cli.field_table`)."""

from __future__ import annotations

import importlib
import os
import reprlib
import sys
from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

from trl_aspo.builtin.registry import BUILTIN_DATASETS, BUILTIN_REWARDS, BUILTIN_TOOLS
from trl_aspo.config.aspo_config import ASPOConfig

TRAINERS = {
    "sync": "ASPOTrainer, on TRL's GRPOTrainer loop (config: ASPOConfig)",
    "async": "AsyncASPOTrainer, on TRL's experimental AsyncGRPOTrainer (config: AsyncASPOConfig)",
}
ROLLOUT_WORKERS = {
    "auto": "'local' when training on a CPU (use_cpu, or no CUDA device), else 'trl'",
    "local": "trl_aspo's in-process LocalRolloutWorker with LocalWeightTransfer (CPU, no vLLM, no network)",
    "trl": "TRL's own rollout worker process with a vLLM server at vllm_server_base_url (GPU)",
}


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
    plugins: list[str] | None = field(
        default=None,
        metadata={
            "help": "Your own modules, imported before the configuration is checked (dotted names, found on the "
            "Python path or in the working folder): where your losses and advantage estimators register "
            "themselves with register_policy_loss / register_advantage_estimator, so that loss_type and "
            "advantage_estimator accept their names (docs/development.md, 'Adding a method')."
        },
    )
    builtin_train_size: int = field(
        default=2000,
        metadata={"help": f"Training problems generated for a built-in dataset_name ({', '.join(BUILTIN_DATASETS)})."},
    )
    builtin_test_size: int = field(
        default=200,
        metadata={"help": f"Held-out problems generated for a built-in dataset_name ({', '.join(BUILTIN_DATASETS)})."},
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
    trainer: str = field(
        default="sync",
        metadata={
            "help": "Which trainer runs: " + "; ".join(f"'{name}' = {text}" for name, text in TRAINERS.items()) + ".",
            "choices": list(TRAINERS),
        },
    )
    rollout_worker: str = field(
        default="auto",
        metadata={
            "help": "trainer='async' only: who generates the rollouts. "
            + "; ".join(f"'{name}' = {text}" for name, text in ROLLOUT_WORKERS.items())
            + ".",
            "choices": list(ROLLOUT_WORKERS),
        },
    )
    rollout_jitter_s: float = field(
        default=0.0,
        metadata={
            "help": "trainer='async' with the local worker only: each generated turn waits a seeded U(0, "
            "rollout_jitter_s) seconds first, so samples arrive out of order and stale, as from a real server. "
            "0 = no delay."
        },
    )
    rollout_processed_logprobs: bool = field(
        default=False,
        metadata={
            "help": "trainer='async' with the local worker only: report each token's log-prob under the distribution "
            "sampled from (after top_p / top_k, renormalized), as vLLM behind TRL's worker does, instead of the "
            "full softmax the trainer computes. With top_p < 1 or top_k > 0 the ratio at zero drift then differs "
            "from 1 (allow_processed_sampling_logprobs accepts that)."
        },
    )
    threads: int | None = field(
        default=None,
        metadata={
            "help": "torch's CPU threads in each training process (torch.set_num_threads). None = torch's default, "
            "one per core. What threads and OMP_WAIT_POLICY (PASSIVE unless the environment sets it) did on a CPU "
            "that other jobs share: README, Training on a shared CPU."
        },
    )
    reward_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "trainer='sync' only: the most seconds one call of a reward function may take; a call past it "
            "stops the run with an error naming the function (a synchronous function's call is abandoned, not "
            "stopped: it runs on in a background thread until the process exits). None = no limit, as in TRL, "
            "where a call that never returns holds the run forever."
        },
    )

    def __post_init__(self):
        check_choice("trainer", self.trainer, TRAINERS)
        check_choice("rollout_worker", self.rollout_worker, ROLLOUT_WORKERS)
        if not self.rollout_jitter_s >= 0:
            raise ValueError(f"rollout_jitter_s={self.rollout_jitter_s}: a delay in seconds, so it must be >= 0.")
        if self.threads is not None and not self.threads >= 1:
            raise ValueError(f"threads={self.threads}: torch CPU threads per process, so an integer >= 1 (or none).")
        if self.reward_timeout_s is not None and not (0 < self.reward_timeout_s < float("inf")):
            raise ValueError(
                f"reward_timeout_s={self.reward_timeout_s}: seconds a reward call may take, so a finite number > 0 "
                "(or none for no limit)."
            )
        if self.trainer == "async" and self.reward_timeout_s is not None:
            raise ValueError(
                f"reward_timeout_s={self.reward_timeout_s} is a setting of the synchronous trainer, which calls the "
                "reward functions in its training loop; trainer='async' scores in its rollout worker. Remove it, or "
                "set trainer: sync."
            )
        if self.trainer == "sync":
            for name, default in (
                ("rollout_worker", "auto"),
                ("rollout_jitter_s", 0.0),
                ("rollout_processed_logprobs", False),
            ):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} is a setting of the asynchronous trainer, but trainer='sync' "
                        "generates inside its own loop: set trainer: async, or remove it."
                    )


@dataclass
class AsyncModelArguments:
    """The model of a `trainer: async` run. TRL's AsyncGRPOTrainer loads it from a path, with `AsyncASPOConfig`'s
    `dtype` and `model_init_kwargs`, so `ModelConfig`'s loading, quantization and PEFT fields do not apply."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A local model directory, a hub id, or 'builtin:tiny-calculator' / 'builtin:tiny-multicall'."
        },
    )


def check_choice(name: str, value, choices: dict[str, str]) -> None:
    if value not in choices:
        allowed = "; ".join(f"{choice!r} = {text}" for choice, text in choices.items())
        raise ValueError(f"{name}={value!r} is not one of the choices: {allowed}.")


def config_classes(trainer: str = "sync") -> tuple[type, ...]:
    """The dataclasses a `trl-aspo train` config of this `trainer` fills, in the order the parser returns them."""
    check_choice("trainer", trainer, TRAINERS)
    if trainer == "async":
        from trl_aspo.config.async_config import AsyncASPOConfig

        return ASPOScriptArguments, AsyncASPOConfig, AsyncModelArguments, DatasetMixtureConfig
    return ASPOScriptArguments, ASPOConfig, ModelConfig, DatasetMixtureConfig


def make_parser(prog: str | None = None, trainer: str = "sync") -> TrlParser:
    return TrlParser(config_classes(trainer), prog=prog)


def check_keys_for_trainer(keys, trainer: str) -> None:
    """Refuse, by name, a key that only the other trainer's config has (instead of TrlParser's bare "unknown")."""
    own = {name for cls in config_classes(trainer) for name in cls.__dataclass_fields__}
    for other in TRAINERS:
        if other == trainer:
            continue
        for key in sorted(set(keys) - own):
            owner = next((cls for cls in config_classes(other) if key in cls.__dataclass_fields__), None)
            if owner is not None:
                raise ValueError(
                    f"{key!r} is a field of {owner.__name__} (trainer: {other}), which trainer: {trainer} does not "
                    f"take ({TRAINERS[trainer]}): remove it, or set trainer: {other}."
                )


def resolve_callable(name: str, builtins: dict[str, str], what: str):
    """Import `name` (a built-in name or a dotted path), naming the argument in the error."""
    if not isinstance(name, str):
        raise ValueError(
            f"{what} {reprlib.repr(name)} ({type(name).__name__}) is not a name: give a built-in name "
            f"{sorted(builtins)} or a dotted import path like 'pkg.mod.fn'."
        )
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
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {name!r} could not be imported: {error}") from None
    if not callable(function):
        raise ValueError(f"{what} {name!r} is a {type(function).__name__} ({function!r}), not a function.")
    return function


def load_datasets(script_args: ASPOScriptArguments, dataset_args: DatasetMixtureConfig):
    """Return (train, test) datasets; the built-in task is generated locally, anything else goes through TRL."""
    if script_args.dataset_name in BUILTIN_DATASETS:
        make_dataset = resolve_callable(
            script_args.dataset_name, {k: v for k, (v, _) in BUILTIN_DATASETS.items()}, "dataset_name"
        )
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
        raise ValueError(f"Set `dataset_name` (a dataset name or one of {sorted(BUILTIN_DATASETS)}) or `datasets`.")
    test = dataset.get(script_args.dataset_test_split)
    return dataset[script_args.dataset_train_split], test
