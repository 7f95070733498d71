"""`trl-aspo train` with `trainer: async`: the config classes it selects and what it refuses (the runs:
tests/integration/test_train_async_runs.py)."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import pytest
import torch

from trl_aspo.cli.train import build_async_trainer, parse_command_line, parse_config

ASYNC_YAML = """
trainer: async
rollout_jitter_s: 0.1
model_name_or_path: builtin:tiny-calculator
dataset_name: builtin:calculator
reward_funcs: [builtin:correctness]
output_dir: out
num_generations: 1
per_device_train_batch_size: 4
token_budget: 0
max_staleness: 3
advantage_estimator: spo++
loss_type: aspo
report_to: none
use_cpu: true
bf16: false
"""


def write_yaml(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_async_yaml_parses_into_async_config_with_command_line_overrides(tmp_path):
    from trl_aspo import AsyncASPOConfig
    from trl_aspo.cli.parsers import AsyncModelArguments

    path = write_yaml(tmp_path, ASYNC_YAML)
    script, training, model, _ = parse_command_line(
        ["--config", path, "--max_steps", "2", "--output_dir", str(tmp_path / "o"), "--max_staleness", "1"]
    )
    assert type(training) is AsyncASPOConfig and type(model) is AsyncModelArguments
    assert script.trainer == "async" and script.rollout_worker == "auto" and script.rollout_jitter_s == 0.1
    assert training.max_steps == 2 and training.output_dir == str(tmp_path / "o")
    assert training.max_staleness == 1  # command line beats YAML
    assert training.loss_type == "aspo" and training.advantage_estimator == "spo++" and training.num_generations == 1
    assert model.model_name_or_path == "builtin:tiny-calculator"
    # `--trainer` on the command line selects the class as the YAML key does.
    sync_path = write_yaml(tmp_path, "output_dir: out\nreport_to: none\nuse_cpu: true\n")
    _, training, _, _ = parse_command_line(["--config", sync_path, "--trainer", "async", "--max_staleness", "5"])
    assert type(training) is AsyncASPOConfig and training.max_staleness == 5


def test_default_trainer_is_the_synchronous_one(tmp_path):
    from trl import ModelConfig

    from trl_aspo import ASPOConfig

    path = write_yaml(tmp_path, "output_dir: out\nreport_to: none\nuse_cpu: true\nsteps_per_generation: 2\n")
    script, training, model, _ = parse_command_line(["--config", path])
    assert script.trainer == "sync" and type(training) is ASPOConfig and type(model) is ModelConfig
    assert training.steps_per_generation == 2


@pytest.mark.parametrize("argv_tail", [[], ["--trainer", "asynch"]])
def test_unknown_trainer_value_is_refused_by_name(tmp_path, argv_tail):
    path = write_yaml(tmp_path, ASYNC_YAML.replace("trainer: async", "trainer: asynch"))
    with pytest.raises(
        ValueError, match=r"trainer='asynch' is not one of the choices \['sync', 'async'\]; did you mean async"
    ):
        parse_command_line(["--config", path, *argv_tail])
    with pytest.raises(ValueError, match=r"trainer='asynch' is not one of the choices"):
        parse_config({"trainer": "asynch", "output_dir": "out"})


@pytest.mark.parametrize(
    ("key", "value", "owner"),
    [
        ("steps_per_generation", 2, "ASPOConfig"),  # a GRPOConfig field
        ("num_iterations", 2, "ASPOConfig"),
        ("use_peft", True, "ModelConfig"),
    ],
)
def test_sync_only_key_in_an_async_yaml_is_refused_by_name(tmp_path, key, value, owner):
    path = write_yaml(tmp_path, ASYNC_YAML + f"{key}: {json.dumps(value)}\n")
    message = rf"'{key}' is a field of {owner} \(trainer: sync\), which trainer: async does not take"
    with pytest.raises(ValueError, match=message):
        parse_command_line(["--config", path])
    with pytest.raises(ValueError, match=message):
        parse_config({"trainer": "async", "output_dir": "out", key: value})


def test_async_only_key_in_a_sync_yaml_and_unknown_flags_are_refused_by_name(tmp_path):
    path = write_yaml(tmp_path, "output_dir: out\nreport_to: none\nuse_cpu: true\nmax_staleness: 2\n")
    with pytest.raises(ValueError, match=r"'max_staleness' is a field of AsyncASPOConfig.*trainer: async"):
        parse_command_line(["--config", path])
    with pytest.raises(ValueError, match="steps_per_generation"):
        parse_command_line(["--config", write_yaml(tmp_path, ASYNC_YAML), "--steps_per_generation", "2"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("rollout_worker: local\n", r"rollout_worker='local' is a setting of the asynchronous trainer"),
        ("rollout_jitter_s: 0.5\n", r"rollout_jitter_s=0.5 is a setting of the asynchronous trainer"),
        (
            "trainer: async\nrollout_worker: vllm\n",
            r"rollout_worker \(in .*\): 'vllm' is not one of \['auto', 'local', 'trl'\]",
        ),
        (
            "trainer: async\nrollout_jitter_s: -1\n",
            r"rollout_jitter_s=-1(\.0)?: a delay in seconds, so it must be >= 0",
        ),
    ],
)
def test_rollout_settings_are_validated_by_name(tmp_path, extra, message):
    path = write_yaml(tmp_path, "output_dir: out\nreport_to: none\nuse_cpu: true\n" + extra)
    with pytest.raises(ValueError, match=message):
        parse_command_line(["--config", path])


def test_local_worker_refuses_several_processes_and_its_options_need_it():
    """The refusals come before any model is loaded."""

    def script(worker, **options):
        return SimpleNamespace(
            rollout_worker=worker, **{"rollout_jitter_s": 0.0, "rollout_processed_logprobs": False, **options}
        )

    with pytest.raises(
        ValueError, match=r"rollout_worker='local' with 2 processes: the local worker is a one-process"
    ):
        build_async_trainer(script("local"), SimpleNamespace(world_size=2, use_cpu=True), None, [], [], None)
    with pytest.raises(ValueError, match=r"rollout_jitter_s=0.2 needs rollout_worker: local"):
        build_async_trainer(
            script("trl", rollout_jitter_s=0.2), SimpleNamespace(world_size=1, use_cpu=False), None, [], [], None
        )
    with pytest.raises(ValueError, match=r"rollout_processed_logprobs=True needs rollout_worker: local"):
        build_async_trainer(
            script("trl", rollout_processed_logprobs=True),
            SimpleNamespace(world_size=1, use_cpu=False),
            None,
            [],
            [],
            None,
        )


def test_launching_several_processes_with_the_local_worker_is_refused_before_launch(tmp_path, monkeypatch):
    import accelerate.commands.launch

    from trl_aspo.cli.main import main

    def no_launch(*args, **kwargs):
        raise AssertionError("accelerate launch must not start")

    monkeypatch.setattr(accelerate.commands.launch, "launch_command", no_launch)
    path = write_yaml(tmp_path, ASYNC_YAML)
    with pytest.raises(SystemExit, match=r"trl-aspo train: rollout_worker='local' with 2 processes"):
        main(["train", "--num_processes", "2", "--config", path])


def test_generation_attention_swaps_packed_tree_attention_for_sdpa_and_back():
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

    from trl_aspo.builtin import CHECKPOINT_DIR
    from trl_aspo.evaluation.tool_use import PACKED_TREE_ATTENTION, generation_attention

    assert PACKED_TREE_ATTENTION == TREE_ATTENTION
    register_tree_attention()
    reference = AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR, attn_implementation="sdpa")
    packed = AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR, attn_implementation=TREE_ATTENTION)
    ids = torch.tensor([[5, 17, 230, 41, 9, 77]])
    with torch.no_grad(), generation_attention(packed) as model:
        assert model.config._attn_implementation == "sdpa"
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert packed.config._attn_implementation == TREE_ATTENTION
    with generation_attention(reference) as model:
        assert model is reference and model.config._attn_implementation == "sdpa"
