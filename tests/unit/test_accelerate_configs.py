"""The ready configs in configs/accelerate/: each parses with accelerate, and `trl-aspo train` forwards it."""

from __future__ import annotations

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser

from trl_aspo.cli.main import main

# file -> (distributed type, what accelerate launch derives from it)
CONFIGS = {
    "ddp.yaml": ("MULTI_GPU", dict(multi_gpu=True, use_deepspeed=False, use_fsdp=False, num_machines=1)),
    "deepspeed_zero2.yaml": ("DEEPSPEED", dict(use_deepspeed=True, zero_stage=2, num_machines=1)),
    "deepspeed_zero3.yaml": ("DEEPSPEED", dict(use_deepspeed=True, zero_stage=3, zero3_init_flag=True)),
    "fsdp2.yaml": ("FSDP", dict(use_fsdp=True, fsdp_version=2, fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP")),
    "multi_node.yaml": ("MULTI_GPU", dict(multi_gpu=True, num_machines=2, num_processes=16, main_process_port=29500)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_accelerate_config_parses(name):
    path = f"configs/accelerate/{name}"
    distributed_type, expected = CONFIGS[name]
    assert load_config_from_file(path).distributed_type == distributed_type
    args = launch_command_parser().parse_args(
        ["--config_file", path, "-m", "trl_aspo.cli.train", "--config", "x.yaml"]
    )
    args, _, _ = _validate_launch_command(args)
    assert {key: getattr(args, key) for key in expected} == expected
    assert args.training_script == "trl_aspo.cli.train" and args.module
    assert args.training_script_args == ["--config", "x.yaml"]


def test_trl_aspo_train_forwards_the_accelerate_config(monkeypatch):
    """The launch flags reach accelerate; the launched processes' resume command (TRL_ASPO_RELAUNCH) is set for the
    launch only, so later runs in this interpreter print their own."""
    import os

    launched = []
    monkeypatch.delenv("TRL_ASPO_RELAUNCH", raising=False)

    def launch(args):
        launched.append(args)
        assert "--machine_rank" in os.environ["TRL_ASPO_RELAUNCH"]

    monkeypatch.setattr("accelerate.commands.launch.launch_command", launch)
    argv = ["train", "--accelerate_config", "configs/accelerate/multi_node.yaml", "--machine_rank", "1"]
    argv += ["--main_process_ip", "10.1.2.3", "--config", "configs/smoke.yaml", "--seed", "4"]
    assert main(argv) == 0
    (args,) = launched
    assert args.config_file == "configs/accelerate/multi_node.yaml"
    assert (args.machine_rank, args.main_process_ip) == (1, "10.1.2.3")
    assert args.module and args.training_script == "trl_aspo.cli.train"
    assert args.training_script_args == ["--config", "configs/smoke.yaml", "--seed", "4"]
    assert "TRL_ASPO_RELAUNCH" not in os.environ
