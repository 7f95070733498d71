"""The `trl-aspo` command.

    trl-aspo train --config X.yaml [--key value ...]                  # one process, in this interpreter
    trl-aspo train --num_processes 8 --config X.yaml                   # through `accelerate launch`
    trl-aspo train --accelerate_config configs/accelerate/fsdp2.yaml --config X.yaml   # DeepSpeed / FSDP configs
    trl-aspo evaluate --model builtin:tiny-calculator [--config X.yaml] [--key value ...]
    trl-aspo values CHECKPOINT --output values.jsonl                   # per-prompt values of a checkpoint
    trl-aspo compare --config configs/experiments/NAME.yaml                # variants x seeds: figure, table, logs
    trl-aspo plot RUN_DIR [RUN_DIR ...] [--labels ...]                   # the comparison figure of existing runs
    trl-aspo plot --weights RUN_DIR [RUN_DIR ...]                        # their ASPO weight maps (log_weight_map)

Launcher flags (`--num_processes`, `--accelerate_config`, `--main_process_port`, `--main_process_ip`,
`--machine_rank`, `--num_machines`, `--mixed_precision`, `--multi_gpu`) must come before `--config`; everything else
goes to the training script, whose `--help` lists every field.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

LAUNCH_FLAGS = {
    "--num_processes": True,
    "--accelerate_config": True,
    "--main_process_port": True,
    "--main_process_ip": True,
    "--machine_rank": True,
    "--num_machines": True,
    "--mixed_precision": True,
    "--multi_gpu": False,
}


def split_launch_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `accelerate launch` flags from the training script's arguments."""
    launch, rest = [], []
    index = 0
    while index < len(argv):
        flag = argv[index]
        if flag in LAUNCH_FLAGS:
            takes_value = LAUNCH_FLAGS[flag]
            if takes_value and index + 1 >= len(argv):
                raise SystemExit(f"trl-aspo train: {flag} needs a value")
            name = "--config_file" if flag == "--accelerate_config" else flag
            launch += [name, argv[index + 1]] if takes_value else [name]
            index += 2 if takes_value else 1
        else:
            rest.append(flag)
            index += 1
    return launch, rest


def launch_words(argv: list[str]) -> list[str]:
    """The launcher flags of a `trl-aspo train` command line as the user wrote them (for the resume command), the
    `--accelerate_config` file made absolute so that the command runs from any folder."""
    words, index = [], 0
    while index < len(argv):
        if argv[index] in LAUNCH_FLAGS:
            width = 2 if LAUNCH_FLAGS[argv[index]] else 1
            flag = argv[index : index + width]
            if flag[0] == "--accelerate_config" and len(flag) == 2:
                flag = [flag[0], os.path.abspath(flag[1])]
            words += flag
            index += width
        else:
            index += 1
    return words


def cpu_launch(launch: list[str], values: dict) -> list[str]:
    """The `accelerate launch` flags that run `--num_processes N` (N > 1, no `--accelerate_config`) as N processes.

    Without a config file, accelerate starts several processes only for `--multi_gpu` or when it sees several GPUs;
    otherwise it starts one and says nothing. With `use_cpu: true` (or no CUDA device at all) `--multi_gpu` is
    added: it picks accelerate's torch.distributed launcher, and each process, on the CPU, joins a gloo group
    (accelerate's MULTI_CPU). Refused when the processes would share one GPU, or when there is no GPU and the config
    does not set use_cpu (transformers would refuse it in every process)."""
    if "--num_processes" not in launch or "--config_file" in launch or "--multi_gpu" in launch:
        return launch
    processes = int(launch[launch.index("--num_processes") + 1])
    if processes < 2:
        return launch
    import torch

    gpus = torch.cuda.device_count()
    if values.get("use_cpu") is True or gpus == 0:
        if values.get("use_cpu") is not True:
            raise SystemExit(
                f"trl-aspo train: --num_processes {processes} on a machine without a CUDA device: add --use_cpu true "
                "(or use_cpu: true in the YAML); the processes then train on the CPU and talk over gloo."
            )
        return [*launch, "--multi_gpu"]
    if gpus == 1:
        raise SystemExit(
            f"trl-aspo train: --num_processes {processes} with one CUDA device: accelerate would run one process. "
            "Run one process (no --num_processes), or several on the CPU with --use_cpu true (gloo)."
        )
    return launch


def train(argv: list[str]) -> int:
    # Help and the configuration checks import neither torch nor TRL: they answer in a moment (see cli_config).
    from trl_aspo.cli.config_errors import ConfigurationError, report
    from trl_aspo.cli.run_checks import check_train_command_line, existing_checkpoints_warning
    from trl_aspo.cli.train_help import train_help
    from trl_aspo.trainers.resume import RELAUNCH_ENV, cli_command

    launch, script_args = split_launch_args(argv)
    if "-h" in script_args or "--help" in script_args:
        print(train_help(script_args), end="")
        return 0
    try:
        processes = launch[launch.index("--num_processes") + 1] if "--num_processes" in launch else "1"
        if not processes.isdigit() or int(processes) < 1:
            raise ConfigurationError(
                [f"--num_processes: {processes!r} is not a number of processes; give an integer >= 1"]
            )
        _, _, values = check_train_command_line(script_args)
    except ConfigurationError as error:
        report("trl-aspo train", error)
    warning = existing_checkpoints_warning(values)
    if warning:
        # Wrapped: a terminal line, as the progress bar's, stays readable (a path can make the message long).
        lines = textwrap.wrap(
            f"trl-aspo train: warning: {warning}",
            width=119,
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        print("\n".join(lines), file=sys.stderr)
    if not launch:
        from trl_aspo.cli.train import main as train_main

        train_main(script_args)
        return 0
    if "--num_processes" in launch and int(launch[launch.index("--num_processes") + 1]) > 1:
        from trl_aspo.cli.train import refuse_local_worker_with_processes

        refuse_local_worker_with_processes(int(launch[launch.index("--num_processes") + 1]), script_args)
    launch = cpu_launch(launch, values)
    from accelerate.commands.launch import launch_command, launch_command_parser

    # The processes' resume command (printed on Ctrl-C) starts the run the way this one was started. accelerate
    # hands its processes this process's environment; set only for the launch, so no later run in this
    # interpreter inherits it.
    previous = os.environ.get(RELAUNCH_ENV)
    os.environ[RELAUNCH_ENV] = json.dumps([*cli_command(), "train", *launch_words(argv)])
    try:
        launch_command(launch_command_parser().parse_args([*launch, "-m", "trl_aspo.cli.train", *script_args]))
    finally:
        if previous is None:
            os.environ.pop(RELAUNCH_ENV, None)
        else:
            os.environ[RELAUNCH_ENV] = previous
    return 0


def main(argv: list[str] | None = None) -> int:
    from trl_aspo.infra.notices import ignore_known_notices

    ignore_known_notices()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="trl-aspo",
        description="ASPO / tool-position shaping / SPO++ training on top of TRL's GRPOTrainer.",
        epilog="Run `trl-aspo COMMAND --help` (train, evaluate, values, compare, plot) for every option.",
    )
    parser.add_argument("command", choices=["train", "evaluate", "values", "compare", "plot"], help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train(rest)
    if command == "evaluate":
        from trl_aspo.cli.evaluate import main as evaluate_main

        return evaluate_main(rest)
    if command == "values":
        from trl_aspo.cli.values import main as values_main

        return values_main(rest)
    if command == "compare":
        from trl_aspo.cli.compare import compare_main

        return compare_main(rest)
    if command == "plot":
        from trl_aspo.cli.plot_command import plot_main

        return plot_main(rest)
    parser.error(f"unknown command {command!r}; choose 'train', 'evaluate', 'values', 'compare' or 'plot'")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
