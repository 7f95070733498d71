"""YAML-configured training: `trl-aspo train --config X.yaml [--key value ...]`.

Arguments follow TRL's `TrlParser` conventions: a YAML file given with `--config` sets the defaults of every field
of `ASPOScriptArguments`, `ASPOConfig`, `ModelConfig` and `DatasetMixtureConfig`; command-line flags override it;
an `env:` block sets environment variables; a key that no dataclass knows is an error that names it.

The script argument `trainer` picks the trainer before anything else is parsed: `sync` (default) trains with
`ASPOTrainer`; `async` with `AsyncASPOTrainer`, whose fields come from `AsyncASPOConfig` (in place of `ASPOConfig`)
and `AsyncModelArguments` (in place of `ModelConfig`: TRL's async trainer loads the model from a path with the
config's `dtype` and `model_init_kwargs`).
"""

from __future__ import annotations

import math
import os
import sys

from trl import DatasetMixtureConfig, ModelConfig, TrlParser

from trl_aspo.builtin.registry import BUILTIN_REWARDS, BUILTIN_TOOLS
from trl_aspo.cli.command_line import check_command_line, config_path, config_value_problems
from trl_aspo.cli.command_line import requested_trainer as _requested_trainer
from trl_aspo.cli.config_errors import ConfigurationError, report
from trl_aspo.cli.parsers import (
    TRAINERS,
    check_choice,
    check_keys_for_trainer,
    load_datasets,
    make_parser,
    resolve_callable,
)
from trl_aspo.cli.run_checks import check_train_command_line
from trl_aspo.cli.yaml_loading import read_config
from trl_aspo.config.aspo_config import ASPOConfig


def config_file(argv: list[str]) -> dict | None:
    """The mapping of the `--config` YAML of a command line; None without one (or unreadable: the checks say why)."""
    path = config_path(argv)
    if not path:
        return None
    try:
        return read_config(path)
    except ConfigurationError:
        return None


def requested_trainer(argv: list[str]) -> str:
    """The `trainer` a command line asks for: its `--trainer` flag, else the `--config` YAML's key, else 'sync'.

    Read before parsing, because it decides which config class parses everything else."""
    return _requested_trainer(argv, config_file(argv))


def parse_config(config: dict):
    """(script_args, training_args, model_args, dataset_args) of a config mapping (the keys of a YAML file), parsed
    as `trl-aspo train --config` parses it, so a value YAML reads as a string (`1e-3`) gets its field's type."""
    trainer = config.get("trainer", "sync")
    check_choice("trainer", trainer, TRAINERS)
    check_keys_for_trainer(config, trainer)
    problems = config_value_problems(config, "run config")
    if problems:
        raise ConfigurationError(problems)
    return parse_checked(make_parser(trainer=trainer), config, [])


def resolve_functions(script_args) -> tuple[list, list]:
    """(reward_funcs, tools) of the script arguments, imported; `ConfigurationError` listing every entry that is
    missing, cannot be imported or is not a function, before any model loads."""
    problems = []
    if not script_args.reward_funcs:
        problems.append(f"reward_funcs: not set; give dotted import paths or built-in names {sorted(BUILTIN_REWARDS)}")
    resolved: dict[str, list] = {"reward_funcs": [], "tools": []}
    for what, names, builtins in (
        ("reward_funcs", script_args.reward_funcs or [], BUILTIN_REWARDS),
        ("tools", script_args.tools or [], BUILTIN_TOOLS),
    ):
        for name in names:
            try:
                resolved[what].append(resolve_callable(name, builtins, f"{what} entry"))
            except ValueError as error:
                problems.append(str(error))
    if problems:
        raise ConfigurationError(problems)
    return resolved["reward_funcs"], resolved["tools"]


def parse_command_line(argv: list[str]):
    """(script_args, training_args, model_args, dataset_args) of a `trl-aspo train` command line.

    Every mistake raises one `ConfigurationError` listing them all: those `check_command_line` finds in the YAML and
    the flags, then a value the dataclasses' own validation refuses."""
    config, trainer = check_command_line(argv)
    without_config = list(argv)
    if "--config" in without_config:
        index = without_config.index("--config")
        del without_config[index : index + 2]
    return parse_checked(make_parser(prog="trl-aspo train", trainer=trainer), config, without_config)


def parse_checked(parser: TrlParser, config: dict, argv: list[str]):
    """The dataclasses of an already checked YAML mapping and flags, as TrlParser fills them (the `env:` block sets
    environment variables; flags override the YAML), with argparse's and `__post_init__`'s errors raised as a
    `ConfigurationError` instead of a usage dump or a traceback."""
    config = dict(config)
    for key, value in (config.pop("env", None) or {}).items():
        os.environ[key] = str(value)
    remaining = parser.set_defaults_with_config(**config)
    if remaining:
        raise ConfigurationError([f"unknown keys: {remaining[::2]}"])

    def refuse(message: str):
        raise ConfigurationError([message])

    parser.error = refuse  # argparse would print every field's usage first, then exit
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except (ValueError, TypeError) as error:
        if isinstance(error, ConfigurationError):
            raise
        raise ConfigurationError([" ".join(str(error).split())]) from None


def main(argv: list[str] | None = None) -> None:
    from trl_aspo.infra.notices import ignore_known_notices

    ignore_known_notices()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from trl_aspo.cli.train_help import train_help

        print(train_help(argv), end="")
        return
    try:
        check_train_command_line(argv)  # what a run needs (a model, ...): `trl-aspo train` asked before torch loaded
        parsed = parse_command_line(argv)
        functions = resolve_functions(parsed[0])
    except ConfigurationError as error:
        report("trl-aspo train", error)
    run_until_interrupted(argv, parsed, functions)


def sharded_launch_on_cpu(training_args) -> str | None:
    """'FSDP' or 'DEEPSPEED' when `accelerate launch` asks for it (its `ACCELERATE_USE_*` environment, from an FSDP or
    DeepSpeed accelerate config) and the run trains on CPU processes, where accelerate 1.15 alone drops the plugin
    and trains plain data parallel; None otherwise."""
    import torch

    if not (training_args.use_cpu or not torch.cuda.is_available()):
        return None
    launched = [
        name for name in ("FSDP", "DEEPSPEED") if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true"
    ]
    return launched[0] if launched else None


class TrainingInterrupted(KeyboardInterrupt):
    """A second Ctrl-C during `trainer.train()`: a KeyboardInterrupt that knows the optimizer step it stopped at."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


class TrainingStopped(Exception):
    """`trainer.train()` stopped on one of `stop_signals` at `step`, with a checkpoint there."""

    def __init__(self, signal_name: str, step: int, boundary: str):
        super().__init__(signal_name, step)
        self.signal_name, self.step, self.boundary = signal_name, step, boundary


def run_until_interrupted(argv: list[str], parsed, functions: tuple[list, list] | None = None) -> None:
    """`run` a parsed command line. Stopped on one of `stop_signals` (`GracefulStop`): print one line naming the
    checkpoint written at the stop and the command that resumes from it (main process only) and exit with
    `EXIT_STOPPED` (75), skipping the final `save_model`, the "after" evaluation and the plot. A non-finite step
    (`NonFiniteStepError`, raised before it reached the weights): its message, exit 1. On a Ctrl-C that stops
    at once (the second, or any with `stop_signals: []`): the same line with the latest checkpoint, exit 130, the
    shell's code for SIGINT. Neither prints a traceback."""
    from trl_aspo.infra.stop_signals import EXIT_STOPPED
    from trl_aspo.trainers.resume import interrupt_message
    from trl_aspo.trainers.step_guard import NonFiniteStepError

    config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    main_process = os.environ.get("RANK", "0") == "0"
    try:
        trainer = run(
            *parsed,
            functions=functions,
            config_name=os.path.splitext(os.path.basename(config))[0] if config else None,
            stop_message=lambda head: interrupt_message(argv, parsed[1].output_dir, None, head),
        )
    except KeyboardInterrupt as interrupt:
        if main_process:
            step = interrupt.step if isinstance(interrupt, TrainingInterrupted) else None
            print(f"\n{interrupt_message(argv, parsed[1].output_dir, step)}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except NonFiniteStepError as error:
        if main_process:
            print(f"\ntrl-aspo train: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except TrainingStopped as stop:
        if main_process:
            stopped = f"Stopped on {stop.signal_name} at step {stop.step} ({stop.boundary})"
            print(
                f"\n{interrupt_message(argv, parsed[1].output_dir, stop.step, stopped)}", file=sys.stderr, flush=True
            )
        raise SystemExit(EXIT_STOPPED) from None
    # A gloo group left for interpreter exit aborts a process now and then ("terminate called without an active
    # exception", 11 of 60 two-process gloo runs here, none of 40 with it), failing a run that trained and saved.
    trainer.accelerator.end_training()


def curves_title(name: str, training_args) -> str:
    """'quickstart: spo++ advantages, aspo loss, tool shaping, 80 steps': the training curves' title."""
    parts = [
        f"{getattr(training_args, 'advantage_estimator', 'group')} advantages",
        f"{training_args.loss_type} loss",
        "tool shaping" if getattr(training_args, "tool_shaping", False) else "no tool shaping",
        f"{training_args.max_steps} steps" if training_args.max_steps > 0 else None,
    ]
    return f"{name}: " + ", ".join(part for part in parts if part)


def use_console_progress(trainer, callbacks: list | None) -> None:
    """Replace transformers' progress bar, which prints every logged metric as a dict, by `callbacks` when given,
    else by a bar showing `TRAIN_CONSOLE_METRICS` (everything logged still reaches the trackers and log history)."""
    from transformers.trainer_callback import ProgressCallback

    from trl_aspo.cli.progress import TRAIN_CONSOLE_METRICS, MetricProgressCallback

    had_bar = any(isinstance(callback, ProgressCallback) for callback in trainer.callback_handler.callbacks)
    if not callbacks and not had_bar:
        return  # disable_tqdm: the user asked for transformers' plain log lines
    trainer.remove_callback(ProgressCallback)
    for callback in callbacks or [MetricProgressCallback("train", TRAIN_CONSOLE_METRICS)]:
        trainer.add_callback(callback)


def run(
    script_args,
    training_args,
    model_args,
    dataset_args: DatasetMixtureConfig,
    callbacks: list | None = None,
    functions: tuple[list, list] | None = None,
    config_name: str | None = None,
    stop_message=None,
):
    """Train, save the model and return the trainer; `callbacks` replace transformers' progress bar when given;
    `functions` are the (reward_funcs, tools) `resolve_functions` returned, resolved here when not given;
    `config_name` titles the training curves (default: the output folder's name); `stop_message` is
    `GracefulStop`'s `expired_message`.

    `resume_from_checkpoint: true` resumes from the latest checkpoint of `output_dir`. One of `stop_signals` during
    training raises `TrainingStopped` once the stop checkpoint is written (`GracefulStop`); a Ctrl-C that stops at
    once raises `TrainingInterrupted` with the step it stopped at."""
    from trl_aspo.cli.progress import MetricProgressCallback
    from trl_aspo.trainers.graceful_stop import GracefulStop
    from trl_aspo.trainers.resume import resolve_resume_checkpoint, skipped_checkpoints_note

    if not model_args.model_name_or_path:
        raise ValueError("Set `model_name_or_path`: a local model directory, a hub id, or 'builtin:tiny-calculator'.")
    if script_args.threads is not None:
        import torch

        torch.set_num_threads(script_args.threads)
    reward_funcs, tools = functions if functions is not None else resolve_functions(script_args)
    if script_args.reward_timeout_s is not None:
        from trl_aspo.trainers.reward_checks import reward_with_timeout

        reward_funcs = [reward_with_timeout(func, script_args.reward_timeout_s) for func in reward_funcs]
    train_dataset, test_dataset = load_datasets(script_args, dataset_args)
    resume = resolve_resume_checkpoint(
        training_args.resume_from_checkpoint, training_args.output_dir, training_args.max_steps
    )

    sharding = sharded_launch_on_cpu(training_args)
    if sharding is not None:
        from trl_aspo.infra.cpu_sharding import enable_cpu_sharding

        enable_cpu_sharding()
    if script_args.trainer == "async":
        trainer = build_async_trainer(script_args, training_args, model_args, reward_funcs, tools, train_dataset)
    else:
        trainer = build_sync_trainer(training_args, model_args, reward_funcs, tools, train_dataset, test_dataset)
    if sharding is not None:
        trainer.accelerator.print(
            f"Sharded on {trainer.accelerator.num_processes} CPU processes: {trainer.accelerator.distributed_type} "
            "(trl_aspo.infra.cpu_sharding; accelerate alone would train plain data parallel on CPU)."
        )
    elif trainer.accelerator.num_processes > 1:
        # A sharded launch says how it trains; a data-parallel one (ddp.yaml, --multi_gpu, --num_processes) said
        # nothing, so a user could not tell from the output that N processes were training.
        cpu = "CPU " if trainer.accelerator.device.type == "cpu" else ""
        trainer.accelerator.print(
            f"Data parallel on {trainer.accelerator.num_processes} {cpu}processes: "
            f"{trainer.accelerator.distributed_type} (each holds the whole model and trains on its share of every "
            "batch)."
        )
    if training_args.max_steps <= 0 or getattr(trainer, "epoch_stop_groups", None) is not None:
        trainer.accelerator.print(training_length_message(trainer, train_dataset))
    use_console_progress(trainer, callbacks)
    stop = None
    if training_args.stop_signals != []:  # None: the default signals
        stop = GracefulStop(stop_message)
        trainer.add_callback(stop)
    report = None
    if script_args.evaluate_before_after:
        from trl_aspo.evaluation.report import BeforeAfterReport

        report = BeforeAfterReport(
            trainer,
            test_dataset,
            reward_funcs,
            tools,
            script_args.eval_samples_per_problem,
            script_args.eval_temperature,
        )
        report.measure_before(reuse_saved=resume is not None)
    if resume is not None:
        trainer.accelerator.print(f"Resuming from {resume}.")
        # Only `true` chooses the checkpoint: then say which newer, incomplete ones it passed over.
        skipped = (
            None
            if resume == training_args.resume_from_checkpoint
            else (skipped_checkpoints_note(training_args.output_dir, resume))
        )
        if skipped:
            trainer.accelerator.print(skipped)
    try:
        trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, MetricProgressCallback):
                callback.close()
        raise TrainingInterrupted(trainer.state.global_step) from None
    if stop is not None and stop.stopped is not None:
        # Every rank has written its share of the checkpoint before any of them exits.
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()
        raise TrainingStopped(*stop.stopped)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if report is not None:
        report.measure("after")
        report.finish()
    if script_args.plot and trainer.accelerator.is_main_process:
        from trl_aspo.cli.plot import plot_training_curves

        heldout = None
        if report is not None:
            heldout = {"initial": report.results["before"]["accuracy"], "final": report.results["after"]["accuracy"]}
        title = curves_title(
            config_name or os.path.basename(os.path.normpath(training_args.output_dir)), training_args
        )
        path = plot_training_curves(trainer.state.log_history, training_args.output_dir, title=title, heldout=heldout)
        trainer.accelerator.print(f"Training curves saved to {path}.")
    trainer.accelerator.wait_for_everyone()
    return trainer


def training_length_message(trainer, train_dataset) -> str:
    """What a run without a positive `max_steps` trains (transformers reads max_steps=-1 as "num_train_epochs
    epochs"), said once at the start.

    The synchronous trainer's optimizer steps per epoch follow from its sampler: an epoch has
    R = floor(N / P) generation rounds of P = generation_batch_size / num_generations prompts, each round is
    trained for num_iterations * steps_per_generation micro-batches, so

        steps = ceil(num_train_epochs * max(1, ceil(R * num_iterations * steps_per_generation / grad_accum)))

    as `Trainer.set_initial_training_values` computes it. The asynchronous trainer stops after
    ceil(num_train_epochs * N) prompt groups instead (its max_steps is then only a ceiling)."""
    args = trainer.args
    epochs, prompts = args.num_train_epochs, len(train_dataset)
    stop_groups = getattr(trainer, "epoch_stop_groups", None)
    if stop_groups is not None:
        return (
            f"max_steps is not set: training num_train_epochs={epochs:g} epochs over {prompts} prompts, i.e. until "
            f"{stop_groups} prompt groups have been trained (max_steps={args.max_steps} is only a ceiling)."
        )
    prompts_per_round = args.generation_batch_size // args.num_generations
    rounds = prompts // prompts_per_round
    micro_batches = rounds * args.num_iterations * args.steps_per_generation
    per_epoch = max(math.ceil(micro_batches / args.gradient_accumulation_steps), 1)
    return (
        f"max_steps={args.max_steps}: training num_train_epochs={epochs:g} epochs over {prompts} prompts "
        f"({rounds} generation rounds of {prompts_per_round} prompts per epoch) = "
        f"{math.ceil(epochs * per_epoch)} optimizer steps."
    )


def build_sync_trainer(
    training_args: ASPOConfig, model_args: ModelConfig, reward_funcs, tools, train_dataset, test_dataset
):
    """`ASPOTrainer` on the model named by `ModelConfig` (built-in names load locally)."""
    from trl import get_peft_config

    from trl_aspo.trainers.aspo_trainer import ASPOTrainer

    if not model_args.model_name_or_path.startswith("builtin:"):
        init_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype}
        if model_args.attn_implementation is not None:
            init_kwargs["attn_implementation"] = model_args.attn_implementation
        training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}
    return ASPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=test_dataset if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
        tools=tools or None,
    )


def resolve_rollout_worker(script_args, training_args) -> str:
    """'local' or 'trl': `rollout_worker`, with 'auto' = local on a CPU run, TRL's worker otherwise."""
    if script_args.rollout_worker != "auto":
        return script_args.rollout_worker
    import torch

    return "local" if training_args.use_cpu or not torch.cuda.is_available() else "trl"


def _local_worker_processes_message(num_processes: int) -> str:
    return (
        f"rollout_worker='local' with {num_processes} processes: the local worker is a one-process path (it "
        "generates inside the training process, on a CPU copy of the policy). Run one process (no --num_processes), "
        "or use rollout_worker: trl with a vLLM server for several."
    )


def refuse_local_worker_with_processes(num_processes: int, argv: list[str]) -> None:
    """Before `accelerate launch` starts `num_processes` copies: exit with the reason if the command line asks for
    the asynchronous trainer with the local worker, which runs in one process."""
    if requested_trainer(argv) != "async":
        return
    script_args, training_args, _, _ = parse_command_line(argv)
    if resolve_rollout_worker(script_args, training_args) == "local":
        raise SystemExit(f"trl-aspo train: {_local_worker_processes_message(num_processes)}")


def build_async_trainer(script_args, training_args, model_args, reward_funcs, tools, train_dataset):
    """`AsyncASPOTrainer` with the rollout worker `rollout_worker` names.

    The local worker generates in the training process (on a policy copy that `LocalWeightTransfer` keeps current)
    with `install_cpu_fallbacks()` for what TRL's async trainer otherwise fetches or needs a GPU for. TRL's worker is
    the trainer's default: a spawned process posting to the vLLM server at `vllm_server_base_url`, NCCL weight sync."""
    from trl_aspo.builtin import is_builtin_tokenizer_dir, load_tokenizer
    from trl_aspo.infra import resolve_model_path
    from trl_aspo.trainers.async_aspo_trainer import AsyncASPOTrainer

    worker_kind = resolve_rollout_worker(script_args, training_args)
    if worker_kind == "local" and training_args.world_size > 1:
        raise ValueError(_local_worker_processes_message(training_args.world_size))
    if worker_kind == "trl" and script_args.rollout_processed_logprobs:
        raise ValueError(
            "rollout_processed_logprobs=True needs rollout_worker: local; TRL's worker reports what its vLLM server "
            "reports (processed log-probs under trl vllm-serve)."
        )
    if worker_kind == "trl" and script_args.rollout_jitter_s:
        raise ValueError(
            f"rollout_jitter_s={script_args.rollout_jitter_s} needs rollout_worker: local; TRL's worker is timed by "
            "its vLLM server."
        )
    model = resolve_model_path(model_args.model_name_or_path)
    if is_builtin_tokenizer_dir(model):
        tokenizer = load_tokenizer(model)  # AutoTokenizer would rebuild it with different ids (see load_tokenizer)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=training_args.trust_remote_code)
    worker_kwargs = {}
    if worker_kind == "local":
        from trl_aspo.infra import LocalRolloutWorker, LocalWeightTransfer, install_cpu_fallbacks

        install_cpu_fallbacks()
        worker = LocalRolloutWorker(
            model,
            tokenizer,
            train_dataset,
            reward_funcs,
            training_args,
            tools=tools or None,
            jitter_s=script_args.rollout_jitter_s,
            processed_logprobs=script_args.rollout_processed_logprobs,
            seed=training_args.seed,
        )
        worker_kwargs = {"rollout_worker": worker, "weight_transfer": LocalWeightTransfer(worker)}
    return AsyncASPOTrainer(
        model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        tools=tools or None,
        **worker_kwargs,
    )


if __name__ == "__main__":
    main()
