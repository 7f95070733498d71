"""`trl-aspo compare` (variants x seeds, resumable) and `trl-aspo plot` (any TRL run's log history)."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from trl_aspo.cli.compare import load_experiment, mean_sd, tail_mean
from trl_aspo.cli.plot import mean_and_spread

BASE = """
base:
  model_name_or_path: builtin:tiny-random
  dataset_name: builtin:calculator
  builtin_train_size: 16
  builtin_test_size: 2
  reward_funcs: [builtin:correctness]
  tools: [builtin:calculator]
  max_steps: 2
  per_device_train_batch_size: 4
  num_generations: 2
  max_completion_length: 12
  max_tool_calling_iterations: 1
  learning_rate: 1.0e-3
  logging_steps: 1
  save_strategy: "no"
  report_to: none
  use_cpu: true
  bf16: false
"""


def write_experiment(tmp_path, body: str, base: str = BASE) -> str:
    path = tmp_path / "experiment.yaml"
    path.write_text(textwrap.dedent(body) + textwrap.dedent(base))
    return str(path)


def test_compare_runs_variants_over_seeds_and_resumes(tmp_path, capsys):
    from trl_aspo.cli.main import main

    output = tmp_path / "cmp"
    config = write_experiment(
        tmp_path,
        f"""
        output_dir: {output}
        seeds: [0, 1]
        metrics: [repetition_rate, aspo/hard_clip_pos_frac]
        evaluation: {{samples_per_problem: 1, temperature: 1.0, initial: true}}
        variants:
          dapo: {{loss_type: dapo}}
          aspo: {{loss_type: aspo}}
        """,
    )
    assert main(["compare", "--config", config]) == 0
    for variant in ("dapo", "aspo"):
        for seed in (0, 1):
            run = output / "runs" / variant / f"seed{seed}"
            state = json.loads((run / "trainer_state.json").read_text())
            assert [row["step"] for row in state["log_history"] if "reward" in row] == [1, 2]
            summary = json.loads((run / "run_summary.json").read_text())
            assert summary["seed"] == seed and summary["config"]["loss_type"] == variant
            assert summary["completions_per_step"] == 4
            assert summary["heldout"]["num_problems"] == 2
    assert (output / "comparison.png").stat().st_size > 0
    table = (output / "results.md").read_text()
    assert "| dapo (n=2) | aspo (n=2) |" in table
    assert "reward-curve area" in table and "held-out accuracy" in table
    # aspo's clip metric is tabulated for aspo and n/a for dapo, which does not log it.
    clip_row = next(line for line in table.splitlines() if line.startswith("| aspo/hard_clip_pos_frac"))
    assert clip_row.split("|")[3].strip() == "n/a"

    # The table's reward-curve area is the mean over seeds of each run's mean logged reward.
    results = json.loads((output / "results.json").read_text())
    areas = []
    for seed in (0, 1):
        state = json.loads((output / "runs" / "aspo" / f"seed{seed}" / "trainer_state.json").read_text())
        rewards = [row["reward"] for row in state["log_history"] if "reward" in row]
        areas.append(sum(rewards) / len(rewards))
    assert results["mean_sd"]["aspo"]["reward-curve area (mean training reward)"][0] == pytest.approx(sum(areas) / 2)

    capsys.readouterr()
    (output / "comparison.png").unlink()
    assert main(["compare", "--config", config]) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished before, skipped") == 4
    assert (output / "comparison.png").stat().st_size > 0


def test_compare_refuses_a_finished_run_made_with_another_config(tmp_path):
    from trl_aspo.cli.compare import compare

    output = tmp_path / "cmp"
    body = f"""
        output_dir: {output}
        seeds: [0]
        variants:
          only: {{max_steps: 1}}
        """
    compare(load_experiment(write_experiment(tmp_path, body)))
    changed = load_experiment(write_experiment(tmp_path, body.replace("max_steps: 1", "max_steps: 2")))
    with pytest.raises(ValueError, match=r"different config \(keys \['max_steps'\]\)"):
        compare(changed)


@pytest.mark.parametrize(
    "body, message",
    [
        ("output_dir: o\nseeds: [0]\nvariants: {a: {}}\ncolour: red\n", "unknown key 'colour' in the file"),
        ("output_dir: o\nseeds: [0]\nvariants: {}\n", "'variants' must be a non-empty mapping"),
        ("output_dir: o\nseeds: []\nvariants: {a: {}}\n", "'seeds' must be a non-empty list"),
        ("output_dir: o\nseeds: [0, -1]\nvariants: {a: {}}\n", "'seeds' entry -1 is not a non-negative integer"),
        ("output_dir: o\nseeds: [1, 1]\nvariants: {a: {}}\n", "'seeds' has a repeated seed"),
        ("output_dir: o\nseeds: [0.5]\nvariants: {a: {}}\n", "'seeds' entry 0.5"),
        ("seeds: [0]\nvariants: {a: {}}\n", "missing key 'output_dir'"),
        ("output_dir: o\nseeds: [0]\nvariants: {a: {seed: 3}}\n", "key 'seed' in variant 'a'"),
        ("output_dir: o\nseeds: [0]\nvariants: {a: {lerning_rate: 1}}\n", "variant 'a' .*lerning_rate"),
        ("output_dir: o\nseeds: [0]\nvariants: {a: {aspo_dual_clip: 0.5}}\n", "variant 'a' .*aspo_dual_clip=0.5"),
        ("output_dir: o\nseeds: [0]\nvariants: {a: 3}\n", "variant 'a' must be a mapping"),
        ("output_dir: o\nseeds: [0]\nvariants: {a b: {}, a_b: {}}\n", "same folder name"),
        (
            "output_dir: o\nseeds: [0]\nvariants: {a: {}}\nevaluation: {samples: 2}\n",
            "unknown key 'samples' in 'evaluation'",
        ),
        (
            "output_dir: o\nseeds: [0]\nvariants: {a: {}}\nevaluation: {samples_per_problem: 0}\n",
            "'evaluation.samples_per_problem' must be an integer >= 1",
        ),
        (
            "output_dir: o\nseeds: [0]\nvariants: {a: {}}\nevaluation: {every_steps: 0}\n",
            r"'evaluation.every_steps' must be an integer >= 1 \(or left out\), got 0",
        ),
        (
            "output_dir: o\nseeds: [0]\nvariants: {a: {}}\nevaluation: {every_steps: true}\n",
            "'evaluation.every_steps' must be an integer >= 1",
        ),
    ],
)
def test_experiment_file_errors_name_the_key(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        load_experiment(write_experiment(tmp_path, body))


def test_plot_reads_a_plain_trl_grpo_run(tmp_path, tiny_model, tiny_tokenizer, calculator_dataset):
    """A real GRPOTrainer run (no aspo metrics) saved by TRL itself: `plot` draws what it logged."""
    from trl import GRPOConfig, GRPOTrainer

    from tests.dense_reward import digit_share_reward
    from trl_aspo.cli.compare import load_run
    from trl_aspo.cli.main import main

    run_dir = tmp_path / "grpo"
    args = GRPOConfig(
        output_dir=str(run_dir),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = GRPOTrainer(
        tiny_model, digit_share_reward, args, train_dataset=calculator_dataset, processing_class=tiny_tokenizer
    )
    trainer.train()
    run = load_run(str(run_dir))  # TRL wrote trainer_state.json and training_args.bin into checkpoint-2
    assert [row["step"] for row in run["history"] if "reward" in row] == [1, 2]
    assert run["completions_per_step"] == 4
    figure = tmp_path / "plot.png"
    assert main(["plot", str(run_dir), str(run_dir), "--labels", "grpo", "grpo", "--output", str(figure)]) == 0
    assert figure.stat().st_size > 0


class _OpensAFile:
    """Unpickling this creates `path`: the stand-in for a crafted `training_args.bin` that runs a command."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_plot_never_unpickles_training_args_of_a_run_folder(tmp_path):
    """Issue 17 item 7: a folder without a compare summary used to have its `training_args.bin` unpickled with
    `weights_only=False`; now the batch size comes from `trainer_state.json` and the pickle is never opened."""
    import torch

    from trl_aspo.cli.compare import load_run
    from trl_aspo.cli.main import main

    run_dir = tmp_path / "handed_over"
    checkpoint = run_dir / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    history = [{"step": step, "reward": 0.1 * step, "loss": 0.0} for step in (1, 2, 3)]
    (checkpoint / "trainer_state.json").write_text(json.dumps({"log_history": history, "train_batch_size": 6}))
    marker = tmp_path / "command_ran"
    torch.save(_OpensAFile(str(marker)), checkpoint / "training_args.bin")
    run = load_run(str(run_dir))
    assert run["completions_per_step"] == 6
    assert main(["plot", str(run_dir), "--output", str(tmp_path / "plot.png")]) == 0
    assert not marker.exists()
    torch.load(checkpoint / "training_args.bin", weights_only=False)  # the file is live: loading it runs the payload
    assert marker.exists()


def test_plot_names_a_bad_batch_size(tmp_path):
    from trl_aspo.cli.compare import load_run

    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [], "train_batch_size": "six"}))
    with pytest.raises(ValueError, match=r"trainer_state.json: train_batch_size must be a positive integer"):
        load_run(str(tmp_path))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    assert load_run(str(tmp_path))["completions_per_step"] is None  # no number: the figure falls back to steps


def test_plot_names_a_folder_without_a_log(tmp_path):
    from trl_aspo.cli.main import main

    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])


def test_mean_and_spread_by_hand():
    steps, means, spreads = mean_and_spread([{1: 1.0, 2: 2.0}, {1: 3.0, 2: 2.0, 3: 9.0}])
    assert steps == [1, 2]  # step 3 is not logged by every run
    assert means == [2.0, 2.0]
    assert spreads == pytest.approx([math.sqrt(2.0), 0.0])
    assert mean_sd([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1.0))
    history = [{"step": s, "x": float(s)} for s in range(1, 21)] + [{"train_loss": 0.1}]
    assert tail_mean(history, "x") == pytest.approx(19.5)  # the last 10% = the last 2 of 20 values


def test_heldout_during_training_and_train_seconds_leave_training_unchanged(tmp_path):
    """`evaluation.every_steps` logs held-out rows at those steps (not the last, evaluated after training), every
    log row gets `train_seconds`, and training is the same as without the evaluations (they fork the RNG)."""
    from trl_aspo.cli.compare import compare

    body = """
        output_dir: {output}
        seeds: [0]
        evaluation: {{samples_per_problem: 1, temperature: 1.0, initial: false{every}}}
        variants:
          aspo: {{loss_type: aspo, max_steps: 4}}
        """
    histories = {}
    for name, every in (("plain", ""), ("curve", ", every_steps: 2")):
        output = tmp_path / name
        experiment = load_experiment(write_experiment(tmp_path, body.format(output=output, every=every)))
        histories[name] = compare(experiment)["aspo"][0]["history"]
    curve = histories["curve"]
    heldout_rows = [row for row in curve if "heldout/accuracy" in row]
    assert [row["step"] for row in heldout_rows] == [2]
    assert set(heldout_rows[0]) == {
        "step",
        "heldout/accuracy",
        "heldout/tool_call_rate",
        "heldout/first_call_position",
        "heldout/calls_per_completion",
    }
    timed = [row["train_seconds"] for row in curve if "loss" in row]
    assert len(timed) == 4 and timed == sorted(timed) and timed[0] > 0

    def training(history):
        return [(row["step"], row["loss"], row.get("reward")) for row in history if "loss" in row]

    assert training(curve) == training(histories["plain"])
    assert (tmp_path / "curve" / "comparison_wallclock.png").stat().st_size > 0


def test_completions_per_step_is_not_rounded():
    """8 completions per optimizer step over 3 iterations: 8/3 generated per step (the x axis of the figure)."""
    from types import SimpleNamespace

    from trl_aspo.cli.compare import completions_per_step

    sync = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_iterations=3)
    assert completions_per_step(sync) == pytest.approx(8 / 3)
    assert completions_per_step(sync, num_processes=3) == 8
    asynchronous = SimpleNamespace(per_device_train_batch_size=16, gradient_accumulation_steps=2)
    assert completions_per_step(asynchronous) == 32


def test_pool_weight_maps_adds_the_runs_cell_by_cell():
    """Seeds of one variant under one label: weight sums and counts add, so a cell's mean is over all their tokens."""
    from trl_aspo.cli.compare import pool_weight_maps

    def state(weight, count, loss_type="aspo"):
        grid = {"weight_sum": [[weight, 0.0], [0.0, 0.0]], "count": [[count, 0], [0, 1]]}
        return {"loss_type": loss_type, "bins": 2, "total": {"positive": grid, "negative": grid}, "windows": [{}]}

    pooled = pool_weight_maps([state(3.0, 2), state(1.0, 2)], "aspo")
    assert pooled["total"]["positive"] == {"weight_sum": [[4.0, 0.0], [0.0, 0.0]], "count": [[4, 0], [0, 2]]}
    assert pooled["windows"] == []
    with pytest.raises(ValueError, match="--labels 'x': runs pooled under one label must share 'loss_type'"):
        pool_weight_maps([state(1.0, 1), state(1.0, 1, "dapo")], "x")


def test_plot_weights_pools_runs_with_one_label(tmp_path):
    from trl_aspo.cli.main import main

    grid = {"weight_sum": [[2.0, 0.0], [0.0, 1.0]], "count": [[2, 0], [0, 1]]}
    state = {"format": 1, "loss_type": "aspo", "bins": 2, "total": {"positive": grid, "negative": grid}, "windows": []}
    runs = []
    for seed in (0, 1):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        (run / "weight_map.json").write_text(json.dumps(state))
        runs.append(str(run))
    output = tmp_path / "pooled.png"
    assert main(["plot", "--weights", *runs, "--labels", "aspo", "aspo", "--output", str(output)]) == 0
    assert output.stat().st_size > 0


def test_a_number_yaml_reads_as_a_string_gets_its_field_type(tmp_path):
    """YAML 1.1 reads `1e-3` (no dot) as a string; `trl-aspo train` converts it, and so must compare (it reached
    torch's optimizer as a string before)."""
    from trl_aspo.cli.compare import apply_command_line, parse_run_config

    body = """
        output_dir: o
        seeds: [0]
        variants:
          a: {learning_rate: 1e-3}
        """
    experiment = load_experiment(write_experiment(tmp_path, body))
    _, training_args, _, _ = parse_run_config(experiment.run_config("a", 0))
    assert training_args.learning_rate == 0.001
    apply_command_line(experiment, overrides=["max_steps=3", "beta=1e-2"])
    _, training_args, _, _ = parse_run_config(experiment.run_config("a", 0))
    assert (training_args.max_steps, training_args.beta) == (3, 0.01)
    with pytest.raises(ValueError, match="variant 'a'.*learning_rate"):
        load_experiment(write_experiment(tmp_path, body.replace("1e-3", "fast")))
