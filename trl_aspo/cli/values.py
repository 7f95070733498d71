"""`trl-aspo values CHECKPOINT --output values.jsonl`: the value tracker of a checkpoint, one JSON record per prompt.

Each record holds the prompt's key (`prompt_id`: the `prompt_id_column` value or the prompt's content hash), its
`value` alpha / (alpha + beta), its pseudo-counts `alpha` and `beta` at the checkpoint's next dispatch (SPO++: aged to
that event), its effective `evidence` alpha + beta and its `visits` (outcomes observed in training). For curricula and
data filtering; the file is also a valid `value_init_file`: a run given it starts each prompt at exactly
Beta(alpha, beta) (SPO++: anchored at the start of training).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from trl_aspo.cli.config_errors import ConfigurationError, report


def load_value_state(checkpoint_dir: str) -> dict[str, Any]:
    """The trl-aspo state saved in `checkpoint_dir` (tracker, event counter, sampler), validated and never unpickled;
    the one place this command reads a checkpoint."""
    from trl_aspo.trainers.checkpoint_state import STATE_JSON, load_checkpoint_state

    try:
        return load_checkpoint_state(checkpoint_dir)
    except FileNotFoundError:
        raise ValueError(
            f"{checkpoint_dir!r} holds no trl-aspo state ({STATE_JSON}): not a checkpoint saved by ASPOTrainer."
        ) from None


def value_records(state: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per tracked prompt (sorted by key) from a saved trl-aspo state."""
    from trl_aspo.values import EventValueTracker, VisitValueTracker

    tracker_state = state.get("tracker")
    if tracker_state is None:
        raise ValueError(
            "the checkpoint holds no value tracker: it was trained with advantage_estimator='group' (only 'spo' and "
            "'spo++' track values)."
        )
    keys = sorted(tracker_state["state"])
    if tracker_state.get("type") == "EventValueTracker":
        tracker = EventValueTracker()
        tracker.load_state_dict(tracker_state)
        event = int(state["value_event"])
        alphas, betas = tracker.pseudo_counts(keys, event)
        values = tracker.value(keys, event)
    else:
        tracker = VisitValueTracker()
        tracker.load_state_dict(tracker_state)
        alphas, betas = tracker.pseudo_counts(keys)
        values = tracker.value(keys)
    return [
        {"prompt_id": key, "value": value, "alpha": alpha, "beta": beta, "evidence": alpha + beta, "visits": visits}
        for key, value, alpha, beta, visits in zip(
            keys, values.tolist(), alphas.tolist(), betas.tolist(), tracker.visits(keys).tolist(), strict=True
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trl-aspo values",
        description="Export the per-prompt values, pseudo-counts, evidence and visits of a checkpoint's value tracker "
        "as JSON Lines (readable back as ASPOConfig.value_init_file).",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory saved by ASPOTrainer (output_dir/checkpoint-N)")
    parser.add_argument("--output", default="values.jsonl", help="where to write the records (default values.jsonl)")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.expanduser(args.checkpoint)):
        report("trl-aspo values", ConfigurationError([f"CHECKPOINT {args.checkpoint!r}: no such directory"]))
    try:
        records = value_records(load_value_state(args.checkpoint))
    except ValueError as error:
        parser.error(str(error))
    with open(args.output, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    print(f"wrote {len(records)} prompts to {args.output}")
    return 0
