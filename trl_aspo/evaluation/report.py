"""Before/after tool-use evaluation around a training run: a printed summary and `summary.json`."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

from trl.models.utils import unwrap_model_for_generation

from trl_aspo.evaluation.tool_use import evaluate_tool_use, generation_attention

SUMMARY_ROWS = (
    ("held-out accuracy", "accuracy", "{:.1%}"),
    ("tool-call rate", "tool_call_rate", "{:.1%}"),
    ("mean first-call position (tokens)", "mean_first_call_position", "{:.1f}"),
    ("calls per completion", "calls_per_completion", "{:.2f}"),
    ("accuracy when calling", "accuracy_with_call", "{:.1%}"),
    ("accuracy without a call", "accuracy_without_call", "{:.1%}"),
)


def format_summary(before: dict, after: dict) -> str:
    """A fixed-width before/after table of the tool-use metrics."""
    return format_columns({"before": before, "after": after})


def format_columns(columns: dict[str, dict]) -> str:
    """A fixed-width table of the tool-use metrics, one column per named summary ("n/a" for a missing number)."""
    lines = [f"{'metric':<36}" + "".join(f"{name:>10}" for name in columns)]
    for label, key, fmt in SUMMARY_ROWS:
        cells = [
            fmt.format(run[key]) if run.get(key) == run.get(key) and key in run else "n/a" for run in columns.values()
        ]
        lines.append(f"{label:<36}" + "".join(f"{cell:>10}" for cell in cells))
    return "\n".join(lines)


def correctness_reward(reward_funcs, args):
    """The reward function that decides correctness in a held-out evaluation: the one `tool_shaping_correct_reward`
    names, else the first."""
    names = [getattr(function, "__name__", str(function)) for function in reward_funcs]
    name = getattr(args, "tool_shaping_correct_reward", None)
    if name is None:
        return reward_funcs[0]
    if name not in names:
        raise ValueError(f"tool_shaping_correct_reward={name!r} names no reward function of {names}.")
    return reward_funcs[names.index(name)]


def heldout_settings(args, samples_per_problem: int, temperature: float) -> dict:
    """The `evaluate_tool_use` settings of a held-out evaluation of a run configured by `args` (its training config):
    the one definition shared by the before/after summary of `trl-aspo train` and `trl-aspo evaluate --config`, so
    both measure the same thing. Generation follows the run's `max_completion_length`,
    `max_tool_calling_iterations`, `tool_call_opener` and `seed`."""
    return {
        "num_samples": samples_per_problem,
        "temperature": temperature,
        "max_completion_length": args.max_completion_length,
        "max_tool_calls": args.max_tool_calling_iterations,
        "call_opener": args.tool_call_opener,
        "seed": args.seed,
    }


@contextmanager
def generation_model(trainer):
    """The trainer's model ready for a held-out generation, entered on every rank, each then generating the same
    completions (same prompts, greedy or seeded sampling).

    Every rank must take part: under FSDP2 each forward of the sharded model all-gathers its layers' shards, and
    under DeepSpeed ZeRO-3 TRL's `unwrap_model_for_generation` gathers the partitioned weights (as GRPOTrainer's own
    generation does); both are collectives, which hang when the main process generates alone while the others wait
    at a barrier. Under DDP it is the unwrapped module, with standard attention (`generation_attention`)."""
    with (
        unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped,
        generation_attention(unwrapped) as model,
    ):
        yield model


class BeforeAfterReport:
    """Evaluates the trainer's model on the held-out split before and after training (on every rank, so that
    sharded models can gather their weights; the main process prints and writes `summary.json`).

    `correctness_reward` decides correctness; the settings are `heldout_settings` of the training config."""

    def __init__(self, trainer, dataset, reward_funcs, tools, samples_per_problem: int = 1, temperature: float = 0.0):
        if dataset is None:
            raise ValueError("evaluate_before_after needs a held-out split (dataset_test_split or the built-in task).")
        self.trainer, self.dataset, self.tools = trainer, dataset, tools
        self.reward_fn = correctness_reward(reward_funcs, trainer.args)
        self.samples_per_problem, self.temperature = samples_per_problem, temperature
        self.results: dict[str, dict] = {}
        self.path = os.path.join(trainer.args.output_dir, "summary.json")

    def settings(self) -> dict:
        """What the held-out numbers depend on besides the model: a saved "before" is reused only when they match."""
        args = self.trainer.args
        return {
            "num_problems": len(self.dataset),
            "samples_per_problem": self.samples_per_problem,
            "temperature": self.temperature,
            "max_completion_length": args.max_completion_length,
            "max_tool_calls": args.max_tool_calling_iterations,
            "seed": args.seed,
        }

    def measure_before(self, reuse_saved: bool = False) -> None:
        """Evaluate the starting model and write its numbers to `summary.json` at once (printing them), so that an
        interrupted run keeps them; with `reuse_saved` (a resumed run) take them from that file instead when it
        holds them for the same settings."""
        trainer = self.trainer
        saved = self._saved_before() if reuse_saved else None
        if saved is not None:
            self.results["before"] = saved
            trainer.accelerator.print(f"Held-out numbers before training: reused from {self.path}.")
            return
        self.measure("before")
        if trainer.accelerator.is_main_process:
            before = self.results["before"]
            self._write({"settings": self.settings(), "before": before})
            table = format_columns({"before": before})
            trainer.accelerator.print(
                f"\nHeld-out tool use before training, {before['num_problems']} problems:\n{table}\n"
                f"Written to {self.path}.\n"
            )

    def _saved_before(self) -> dict | None:
        if not os.path.exists(self.path):
            return None
        with open(self.path) as handle:
            saved = json.load(handle)
        return saved.get("before") if saved.get("settings") == self.settings() else None

    def _write(self, content: dict) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        temporary = f"{self.path}.tmp"
        with open(temporary, "w") as handle:
            json.dump(content, handle, indent=2)
        os.replace(temporary, self.path)

    def measure(self, label: str) -> None:
        """Evaluate the trainer's model now and keep the summary under `label`, on every rank.

        Every rank generates (`generation_model`): the main process alone would deadlock a sharded model."""
        trainer = self.trainer
        with generation_model(trainer) as model:
            summary = evaluate_tool_use(
                model,
                trainer.processing_class,
                self.dataset,
                self.reward_fn,
                self.tools,
                progress=trainer.accelerator.is_main_process,
                **heldout_settings(trainer.args, self.samples_per_problem, self.temperature),
            )
        summary.pop("records")
        self.results[label] = summary
        trainer.accelerator.wait_for_everyone()

    def finish(self) -> None:
        trainer = self.trainer
        if not trainer.accelerator.is_main_process:
            return
        before, after = self.results["before"], self.results["after"]
        table = format_summary(before, after)
        trainer.accelerator.print(f"\nHeld-out tool use, {before['num_problems']} problems:\n{table}\n")
        self._write({"settings": self.settings(), "before": before, "after": after})
        trainer.accelerator.print(f"Summary written to {self.path}.")
