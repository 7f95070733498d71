"""The field table the `trl-aspo` checks read before torch loads (trl_aspo.cli.field_cache): built once in a fresh
interpreter and cached, rebuilt when truncated, corrupt, of other sources or of another installation; a field whose
choices a registry holds takes the names this process registered; suggestions for a mistyped name."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import REPO_ROOT

from trl_aspo.cli import field_cache
from trl_aspo.cli.config_errors import suggestion

# Runs the command in a fresh interpreter and reports, at exit, whether torch was imported on the way.
RUNNER = textwrap.dedent(
    """
    import atexit, sys
    atexit.register(lambda: sys.stderr.write("\\n@@torch_imported=%s\\n" % ("torch" in sys.modules)))
    from trl_aspo.cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)
BAD_CONFIG = """\
model_name_or_path: builtin:tiny-calculator
dataset_name: builtin:calculator
reward_funcs: [builtin:correctness]
lerning_rate: 0.1
"""


def run_train(config, cache):
    """(exit status, stderr lines without the marker, whether torch was imported, seconds) of `trl-aspo train
    --config CONFIG` with its field tables in `cache`."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), field_cache.CACHE_DIR_ENV: str(cache)}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=env,
    )
    stderr, _, marker = result.stderr.rpartition("\n@@torch_imported=")
    return result.returncode, stderr.strip().splitlines(), marker.strip() == "True", time.perf_counter() - start


def test_a_cold_cache_is_built_once_without_torch_in_the_command_and_a_truncated_table_is_rebuilt(tmp_path):
    """The first command builds the table in a child interpreter (the command itself never imports torch), later
    ones read it without rebuilding; a table cut in half (a full disk, a killed writer) is built again."""
    config = tmp_path / "run.yaml"
    config.write_text(BAD_CONFIG)
    cache = tmp_path / "cache"
    expected = [
        f"trl-aspo train: lerning_rate (in {config}): unknown key; did you mean learning_rate?",
        "Run `trl-aspo train --help` for every field.",
    ]
    status, stderr, torch_imported, _ = run_train(config, cache)
    assert (status, stderr, torch_imported) == (2, expected, False)
    (table,) = cache.glob("fields-*.json")
    built, first = table.stat().st_mtime_ns, json.loads(table.read_text())

    status, stderr, torch_imported, seconds = run_train(config, cache)
    assert (status, stderr, torch_imported) == (2, expected, False)
    assert list(cache.glob("fields-*.json")) == [table]
    # Read, not rebuilt, unless a trl-aspo module changed in between (an edited checkout), which it then records.
    assert table.stat().st_mtime_ns == built or json.loads(table.read_text())["sources"] != first["sources"]
    print(f"cached: {seconds:.2f} s")

    text = table.read_text()
    table.write_text(text[: len(text) // 2])
    status, stderr, torch_imported, _ = run_train(config, cache)
    assert (status, stderr, torch_imported) == (2, expected, False)
    rebuilt = json.loads(table.read_text())
    assert rebuilt["installation"] == first["installation"] and set(rebuilt["trainers"]) == {"sync", "async"}


def test_a_table_is_read_only_whole_of_these_sources_and_this_installation(tmp_path, field_table_cache):
    """`_read` answers None (so the table is built again) for a file that is not a whole table, whose recorded
    module hashes differ from the files now (an edited checkout), or that another installation wrote."""
    path = tmp_path / field_table_cache.name
    shutil.copy(field_table_cache, path)
    table = field_cache._read(path, check_sources=True)
    assert table is not None and "config/fields.py" in table["sources"] and "cli/parsers.py" in table["sources"]

    def read_with(change) -> dict | None:
        changed = json.loads(field_table_cache.read_text())
        change(changed)
        path.write_text(json.dumps(changed))
        return field_cache._read(path, check_sources=True)

    assert read_with(lambda t: t["sources"].update({"config/fields.py": "0" * 64})) is None
    assert read_with(lambda t: t["installation"].update({"trl": "0.0.1"})) is None
    assert read_with(lambda t: t.pop("bounds")) is None
    for text in ("", "[]", "{}", '{"trainers": '):
        path.write_text(text)
        assert field_cache._read(path, check_sources=True) is None
    path.write_bytes(b"\xff\xfe")
    assert field_cache._read(path, check_sources=True) is None


def test_a_registry_field_takes_the_names_registered_in_this_process(monkeypatch, field_table_cache):
    """The table holds the loss names registered when it was built; a process that has loaded the config and
    registered another name before building its config gets that name accepted here too (as the config accepts it),
    and a near miss of a registered name is refused with it suggested."""
    from trl_aspo.cli.value_checks import field_choices, value_problem
    from trl_aspo.config import fields
    from trl_aspo.config.aspo_config import ASPOConfig

    table = field_cache.field_table()
    (loss_type,) = [field for field in table["trainers"]["sync"] if field["name"] == "loss_type"]
    assert loss_type["kind"] == "choice" and loss_type["registry"] == "trl_aspo.config.aspo_config"
    assert "aspo" in loss_type["choices"] and "dapo" in loss_type["choices"]
    assert value_problem(loss_type, "asp", "in run.yaml").startswith("loss_type (in run.yaml): 'asp' is not one of [")
    assert value_problem(loss_type, "asp", "in run.yaml").endswith(
        "] (or a name that a module listed in plugins registers); did you mean aspo?"
    )

    config_field = ASPOConfig.__dataclass_fields__["loss_type"]
    spec = fields.field_spec(config_field)
    registered = dataclasses.replace(spec, choices=lambda trainer: (*spec.allowed_choices(trainer), "my_test_loss"))
    monkeypatch.setitem(fields._SPECS, config_field, registered)
    assert "my_test_loss" in field_choices(loss_type) and "my_test_loss" not in loss_type["choices"]
    assert value_problem(loss_type, "my_test_loss", "in run.yaml") is None


@pytest.mark.parametrize(
    ("word", "names", "expected"),
    [
        # Both hold every part of the word, in order: offered in their declared order, the training one first.
        (
            "per_device_batch_size",
            ["learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size"],
            "; did you mean per_device_train_batch_size or per_device_eval_batch_size?",
        ),
        # A typo, not a shortened name: difflib's closest.
        ("num_generatons", ["num_generations", "num_iterations"], "; did you mean num_generations?"),
        ("asp", ["grpo", "aspo", "dapo"], "; did you mean aspo?"),
        ("zzz", ["grpo", "aspo"], ""),
        # One word is never a shortened name (it would match every field holding it).
        ("steps", ["max_steps", "save_steps", "logging_steps"], "; did you mean max_steps?"),
    ],
)
def test_a_mistyped_name_gets_the_names_it_likely_means(word, names, expected):
    assert suggestion(word, names) == expected
    if expected:
        assert suggestion(word, names, prefix="--") == expected.replace("mean ", "mean --").replace("or ", "or --")
