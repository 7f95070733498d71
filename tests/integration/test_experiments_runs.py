"""`trl-aspo compare` running variants x seeds (resumable, refusing a changed config, held-out evaluation during
training) and `trl-aspo plot` on a real TRL GRPOTrainer run."""

from __future__ import annotations

import json

import pytest
from helpers import write_experiment

from trl_aspo.cli.experiment_file import load_experiment


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


def test_plot_reads_a_plain_trl_grpo_run(tmp_path, tiny_model, tiny_tokenizer, calculator_dataset):
    """A real GRPOTrainer run (no aspo metrics) saved by TRL itself: `plot` draws what it logged."""
    from helpers import digit_share_reward
    from trl import GRPOConfig, GRPOTrainer

    from trl_aspo.cli.main import main
    from trl_aspo.cli.plot_command import load_run

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
