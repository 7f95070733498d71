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
import logging
import math
import os
import signal
import sys
import textwrap
import time

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
    from trl_aspo.cli.run_checks import check_train_command_line, existing_checkpoints_warning, output_dir
    from trl_aspo.cli.train_help import train_help
    from trl_aspo.trainers.resume import RELAUNCH_ENV, cli_command, interrupt_message

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
    # The processes' resume command (printed on a stop) starts the run the way this one was started; torchrun gives
    # a process that outlives a failed one stop_grace_s to exit. accelerate hands its processes this process's
    # environment; set only for the launch, so no later run in this interpreter inherits it.
    environment = {
        RELAUNCH_ENV: json.dumps([*cli_command(), "train", *launch_words(argv)]),
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(math.ceil(values.get("stop_grace_s", DEFAULT_STOP_GRACE_S))),
    }
    previous = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        return launch_forwarding_signals(
            [*launch, "-m", "trl_aspo.cli.train", *script_args],
            values.get("stop_signals"),
            values.get("stop_grace_s", DEFAULT_STOP_GRACE_S),
            lambda head: interrupt_message(script_args, output_dir(values), None, head),
        )
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ASPOConfig.stop_grace_s's default (this module does not import the config, which loads TRL).
DEFAULT_STOP_GRACE_S = 300.0
# How long past stop_grace_s the launcher waits before it kills the processes: each one's own timer ends it at
# stop_grace_s, with its message, unless it hangs where Python cannot run (a collective whose peer died).
LAUNCHER_MARGIN_S = 10.0


def launch_forwarding_signals(words: list[str], stop_signals, grace_s: float, expired_message) -> int:
    """`accelerate launch words`, with `trl-aspo train` as the process that handles `stop_signals`; the exit status.

    accelerate's launchers are run in a thread, where they install no signal handler (its one-process launcher
    would kill its child 5 s after a SIGTERM and die of SIGUSR1; torchrun forwards neither SIGUSR1 nor a stop that
    waits). The main thread forwards the first stop signal once to every training process (its direct children that
    run trl_aspo.cli.train; torchrun starts them in their own sessions, so a terminal's Ctrl-C reaches them only so),
    and to any that starts after it; a SIGINT 1 s or more later is forwarded again (the processes then stop at once,
    exit 130); other repeats are ignored. The processes' own status is returned (75 for a stop with a checkpoint).
    If they still run `LAUNCHER_MARGIN_S` past `stop_grace_s`, they are killed and `expired_message(head)` printed."""
    import threading

    import psutil
    from accelerate.commands.launch import launch_command, launch_command_parser

    from trl_aspo.infra.stop_signals import EXIT_STOPPED, StopRequest, note, signal_numbers

    outcome: dict = {}

    def launch() -> None:
        try:
            launch_command(launch_command_parser().parse_args(words))
            outcome["status"] = 0
        except SystemExit as error:
            outcome["status"] = error.code if isinstance(error.code, int) else 1
        except BaseException as error:  # handed to the main thread, which raises it as before
            outcome["error"] = error

    signalled: set[int] = set()

    def forward(signum: int, again: bool = False) -> None:
        for child in psutil.Process().children():
            try:
                if "trl_aspo.cli.train" in child.cmdline() and (again or child.pid not in signalled):
                    child.send_signal(signum)
                    signalled.add(child.pid)
            except psutil.NoSuchProcess:
                continue

    numbers = signal_numbers(stop_signals)
    if not numbers:  # stop_signals: [] leaves the signals to accelerate's launchers, as without trl-aspo
        launch_command(launch_command_parser().parse_args(words))
        return 0
    request = StopRequest(numbers, on_first=forward, on_second=lambda: forward(signal.SIGINT, again=True))
    thread = threading.Thread(target=launch, name="accelerate launch", daemon=True)

    # torchrun warns, in a thread, that nothing forwards signals to its processes (this function does); after a stop
    # it reports the status 75 as a failure and SIGTERMs the processes still exiting (each has written its part of
    # the checkpoint before any exits).
    def quiet(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        stopping = request.signum is not None and (f"exitcode: {EXIT_STOPPED}" in text or "closing signal" in text)
        return "running on a child thread" not in text and not stopping

    torchrun_logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torchrun_logger.addFilter(quiet)
    request.install("trl-aspo train")
    try:
        thread.start()
        while thread.is_alive():
            try:
                thread.join(timeout=0.2)
            except KeyboardInterrupt:  # SIGINT is not among stop_signals: stop at once, as accelerate would
                forward(signal.SIGINT, again=True)
                request.signum = request.signum or signal.SIGINT
                request.since = request.since or time.monotonic()
            if request.signum is None:
                continue
            forward(request.signum)  # processes started after the signal
            if time.monotonic() - request.since > grace_s + LAUNCHER_MARGIN_S:
                for child in psutil.Process().children(recursive=True):
                    child.kill()
                thread.join(timeout=30)
                head = f"No stop boundary within stop_grace_s={grace_s:g} s: killed, without a new checkpoint"
                note(expired_message(head))
                return EXIT_STOPPED
    finally:
        request.restore()
        torchrun_logger.removeFilter(quiet)
    if "error" in outcome:
        status = failed_processes_status(outcome["error"])
        if request.signum is None or status is None:
            raise outcome["error"]
        return status
    return outcome["status"]


def failed_processes_status(error: BaseException) -> int | None:
    """The exit status of the training processes a launcher's error reports (the first failed one's; killed by a
    signal: 128 + its number, as a shell reports it), else None."""
    import subprocess

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from trl_aspo.infra.stop_signals import EXIT_STOPPED

    if isinstance(error, subprocess.CalledProcessError):
        status = error.returncode
    elif isinstance(error, ChildFailedError):
        # After a stop, torchrun ends with SIGTERM the processes still exiting once the first one exits with
        # EXIT_STOPPED, whichever rank that is: each had written its part of the checkpoint by then, so the run
        # stopped. Otherwise the main process's status (it wrote the checkpoint and printed the resume command).
        codes = [failure.exitcode for failure in error.failures.values()]
        if EXIT_STOPPED in codes and all(code in (EXIT_STOPPED, -signal.SIGTERM) for code in codes):
            return EXIT_STOPPED
        status = error.failures.get(0, next(iter(error.failures.values()))).exitcode
    else:
        return None
    return 128 - status if status < 0 else status


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
