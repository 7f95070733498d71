"""Initial counts for the value tracker: from a JSON file, or the layout of a pre-pass with the starting policy.

A prompt with s successes in n0 samples starts at alpha_0 = N0 (s + 0.5) / (n0 + 1), beta_0 = N0 (n0 - s + 0.5) /
(n0 + 1) (`tracker.*.init_from_counts`; SPO, Xu & Ding 2025, arXiv 2509.13232). This module only produces the counts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from trl_aspo.values.prompt_ids import prompt_id_key, prompt_key, prompt_match_key


@dataclass
class InitRecords:
    """The records of a value-init file, by kind: Jeffreys counts (`successes`, `trials`) and exact pseudo-counts
    (`alpha`, `beta`, as `trl-aspo values` exports them)."""

    count_keys: list[str] = field(default_factory=list)
    successes: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    pseudo_keys: list[str] = field(default_factory=list)
    alphas: list[float] = field(default_factory=list)
    betas: list[float] = field(default_factory=list)


def _load_records(path: str, where: str) -> list:
    """A `.jsonl` file holds one JSON object per line (blank lines skipped); any other file one JSON list."""
    try:
        with open(path) as handle:
            if not path.endswith(".jsonl"):
                return json.load(handle)
            return [json.loads(line) for line in handle if line.strip()]
    except OSError as error:
        raise ValueError(f"{where} cannot be read: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON: {error}") from None


def read_init_records(
    path: str, prompt_id_column: str | None, prompt_keys_by_match: dict[str, str] | None = None
) -> InitRecords:
    """Read `[{'prompt_id' | 'prompt': ..., 'successes': s, 'trials': n}, ...]` (a JSON list, or JSON Lines when the
    name ends in `.jsonl`). A record may give `alpha` and `beta` instead of `successes` and `trials`: the prompt then
    starts at exactly Beta(alpha, beta) (the records `trl-aspo values` writes; other fields are ignored).

    A record names its prompt by `prompt_id` (matched against `prompt_id_column` values, or against the content hash
    when no column is used) or by the prompt itself (matched by its content hash, so only when no `prompt_id_column`
    is used). `prompt_keys_by_match` maps the `prompt_match_key` of each dataset prompt to its key, so a record's
    prompt matches a dataset prompt that differs only by None-valued fields. Counts must be finite. Every problem
    raises a `ValueError` naming the file and the record."""
    where = f"ASPOConfig.value_init_file={path!r}"
    records = _load_records(path, where)
    if not isinstance(records, list):
        raise ValueError(f"{where} must hold a JSON list of records, got a {type(records).__name__}.")
    out = InitRecords()
    seen: list[str] = []
    for index, record in enumerate(records):
        exact = isinstance(record, dict) and {"alpha", "beta"} <= set(record)
        if (
            not isinstance(record, dict)
            or not ({"successes", "trials"} <= set(record) or exact)
            or not {"prompt_id", "prompt"} & set(record)
        ):
            got = f"keys {sorted(record)}" if isinstance(record, dict) else f"a {type(record).__name__}"
            raise ValueError(
                f"{where}: record {index} must be an object with 'successes', 'trials' (or 'alpha', 'beta') and "
                f"'prompt_id' or 'prompt'; got {got}."
            )
        names = ("alpha", "beta") if exact else ("successes", "trials")
        counts = tuple(record[name] for name in names)
        if not all(isinstance(value, int | float) and not isinstance(value, bool) for value in counts):
            raise ValueError(f"{where}: record {index} needs numeric '{names[0]}' and '{names[1]}', got {counts}.")
        if not all(math.isfinite(value) for value in counts):
            raise ValueError(f"{where}: record {index} needs finite '{names[0]}' and '{names[1]}', got {counts}.")
        if "prompt_id" in record:
            try:
                key = prompt_id_key(record["prompt_id"], "prompt_id")
            except ValueError as error:
                raise ValueError(f"{where}: record {index}: {error}") from None
        elif prompt_id_column is not None:
            # A content hash would never match: prompts are identified by the column's values.
            raise ValueError(
                f"{where}: record {index} names its prompt by 'prompt', but prompts are identified by "
                f"prompt_id_column={prompt_id_column!r}; give its 'prompt_id' instead."
            )
        else:
            key = prompt_key(record["prompt"])
            if prompt_keys_by_match is not None:
                key = prompt_keys_by_match.get(prompt_match_key(record["prompt"]), key)
        if key in seen:
            raise ValueError(f"{where}: record {index} repeats the prompt of record {seen.index(key)}.")
        seen.append(key)
        if exact:
            out.pseudo_keys.append(key)
            out.alphas.append(float(counts[0]))
            out.betas.append(float(counts[1]))
        else:
            out.count_keys.append(key)
            out.successes.append(float(counts[0]))
            out.trials.append(float(counts[1]))
    return out


def prepass_plan(rows: list[int], samples: int, group: int, span: int) -> list[tuple[int, bool]]:
    """The pre-pass rows as (dataset row, counted) pairs, in generation order; the length is a multiple of `span`.

    Each prompt gets `samples` counted rows, rounded up to whole blocks of `group` identical rows (the layout TRL's
    vLLM server mode expects: it generates once per block); the extra rows are not counted. The tail is padded with
    uncounted copies of the first prompt so that every rank processes the same number of rows. `span` (one generation
    batch across ranks) is a multiple of `group`, so padding keeps the blocks whole."""
    block_rows = -(-samples // group) * group
    plan = [(row, sample < samples) for row in rows for sample in range(block_rows)]
    return plan + [(rows[0], False)] * (-len(plan) % span)
