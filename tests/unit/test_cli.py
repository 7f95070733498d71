"""YAML configuration through TrlParser conventions and the `trl-aspo` command's argument handling (the field table
it checks against before torch loads: tests/unit/test_field_cache.py)."""

from __future__ import annotations

import textwrap

import pytest

from trl_aspo.cli.main import split_launch_args
from trl_aspo.cli.parsers import make_parser, resolve_callable


def write_yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_yaml_with_overrides_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("ASPO_TEST_ENV", raising=False)
    path = write_yaml(
        tmp_path,
        """
        env:
          ASPO_TEST_ENV: hello
        model_name_or_path: builtin:tiny-random
        dataset_name: builtin:calculator
        reward_funcs: [builtin:correctness, tests.helpers.digit_share_reward]
        output_dir: out
        loss_type: aspo
        aspo_dual_clip: 2.5
        learning_rate: 1.0e-5
        advantage_estimator: spo++
        num_generations: 1
        per_device_train_batch_size: 4
        report_to: none
        use_cpu: true
        """,
    )
    script, training, model, _ = make_parser().parse_args_and_config(
        args=["--config", path, "--learning_rate", "3e-6", "--aspo_dual_clip", "4.0"]
    )
    import os

    assert os.environ["ASPO_TEST_ENV"] == "hello"
    assert model.model_name_or_path == "builtin:tiny-random"
    assert script.reward_funcs == ["builtin:correctness", "tests.helpers.digit_share_reward"]
    assert training.loss_type == "aspo"
    assert training.learning_rate == 3e-6  # command line beats YAML
    assert training.aspo_dual_clip == 4.0
    assert training.num_generations == 1 and training.advantage_normalization == "token"


def test_unknown_yaml_key_is_named(tmp_path):
    path = write_yaml(tmp_path, "output_dir: out\nlerning_rate: 0.1\nreport_to: none\nuse_cpu: true\n")
    with pytest.raises(ValueError, match="lerning_rate"):
        make_parser().parse_args_and_config(args=["--config", path])


def test_invalid_yaml_value_names_the_field(tmp_path):
    path = write_yaml(tmp_path, "output_dir: out\nreport_to: none\nuse_cpu: true\naspo_dual_clip: 0.5\n")
    with pytest.raises(ValueError, match="aspo_dual_clip"):
        make_parser().parse_args_and_config(args=["--config", path])


def test_reward_names_resolve():
    from trl_aspo.builtin.task import correctness_reward

    assert (
        resolve_callable(
            "builtin:correctness", {"builtin:correctness": "trl_aspo.builtin.task.correctness_reward"}, "x"
        )
        is correctness_reward
    )
    with pytest.raises(ValueError, match="reward_funcs entry 'nodots'"):
        resolve_callable("nodots", {}, "reward_funcs entry")
    with pytest.raises(ValueError, match="could not be imported"):
        resolve_callable("no_such_module.fn", {}, "reward_funcs entry")


def test_launch_flags_are_split_from_script_args():
    launch, rest = split_launch_args(["--num_processes", "2", "--config", "x.yaml", "--multi_gpu", "--seed", "3"])
    assert launch == ["--num_processes", "2", "--multi_gpu"]
    assert rest == ["--config", "x.yaml", "--seed", "3"]
    launch, _ = split_launch_args(["--accelerate_config", "zero3.yaml"])
    assert launch == ["--config_file", "zero3.yaml"]


def test_dotted_paths_do_not_let_the_working_directory_shadow_installed_modules(tmp_path, monkeypatch):
    import colorsys
    import sys

    (tmp_path / "colorsys.py").write_text("hls_to_rgb = 'shadowed'\n")
    (tmp_path / "my_rewards.py").write_text(
        "def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "colorsys")
    assert callable(resolve_callable("colorsys.hls_to_rgb", {}, "reward_funcs entry"))
    assert sys.modules["colorsys"].__file__ == colorsys.__file__
    assert resolve_callable("my_rewards.reward", {}, "reward_funcs entry")(["a", "b"]) == [1.0, 1.0]
    monkeypatch.delitem(sys.modules, "my_rewards")
