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
import sys

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


def train(argv: list[str]) -> int:
    # Help and the configuration checks import neither torch nor TRL: they answer in a moment (see cli_config).
    from trl_aspo.cli.arguments import ConfigurationError, check_command_line, report, train_help

    launch, script_args = split_launch_args(argv)
    if "-h" in script_args or "--help" in script_args:
        print(train_help(script_args), end="")
        return 0
    try:
        check_command_line(script_args)
    except ConfigurationError as error:
        report("trl-aspo train", error)
    if not launch:
        from trl_aspo.cli.train import main as train_main

        train_main(script_args)
        return 0
    if "--num_processes" in launch and int(launch[launch.index("--num_processes") + 1]) > 1:
        from trl_aspo.cli.train import refuse_local_worker_with_processes

        refuse_local_worker_with_processes(int(launch[launch.index("--num_processes") + 1]), script_args)
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command(launch_command_parser().parse_args([*launch, "-m", "trl_aspo.cli.train", *script_args]))
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
        from trl_aspo.cli.compare import plot_main

        return plot_main(rest)
    parser.error(f"unknown command {command!r}; choose 'train', 'evaluate', 'values', 'compare' or 'plot'")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
