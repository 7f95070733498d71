"""Fields of TRL's configs whose documented domain TRL does not check when the config is built (TRL_FIELD_BOUNDS):
a value outside it failed once the model had loaded, with a message naming no field, or never ended (measured with
`trl-aspo train`: temperature 0 -> generate's "has to be a strictly positive float"; per_device_train_batch_size,
gradient_accumulation_steps or steps_per_generation 0 -> torch's "batch_size should be a positive integer value";
max_staleness -1 (every sample dropped) or max_inflight_tasks 0 (nothing generated) -> no step in 90 s). Both
configs refuse them by name, and `trl-aspo train` before torch loads."""

from __future__ import annotations

import pytest
from test_cli_input_checks import base_with, run_cli

from trl_aspo import ASPOConfig, AsyncASPOConfig
from trl_aspo.config.fields import TRL_FIELD_BOUNDS

pytestmark = pytest.mark.usefixtures("field_table_cache")

BASE = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
# field -> (a value outside its domain, what the message says is allowed, the edge values inside it)
CASES = {
    "per_device_train_batch_size": (0, r"\[1, 1e\+09\]", [8]),
    "gradient_accumulation_steps": (0, r"\[1, 1e\+09\]", [1]),
    "max_completion_length": (0, r"\[1, 1e\+09\]", [1]),
    "temperature": (0.0, r"\(0, 1e\+06\]", [1e-3]),
    "top_p": (1.5, r"\(0, 1\]", [1.0, 0.05]),
    "top_k": (-2, r"\[-1, 1e\+09\]", [-1, 0, 20]),
    "epsilon": (-0.1, r"\[0, 1e\+06\]", [0.0]),
    "epsilon_high": (-0.1, r"\[0, 1e\+06\] or be None", [0.0, None]),
    "beta": (-0.1, r"\[0, 1e\+06\]", [0.0]),
    "num_iterations": (0, r"\[1, 1e\+09\]", [1]),
    "steps_per_generation": (0, r"\[1, 1e\+09\] or be None", [None]),
    "generation_batch_size": (0, r"\[1, 1e\+09\] or be None", [None]),
    "max_staleness": (-1, r"\[0, 1e\+09\]", [0]),
    "weight_sync_steps": (0, r"\[1, 1e\+09\]", [1]),
    "max_inflight_tasks": (0, r"\[-1, 1e\+09\] except 0", [-1, 1]),
}


def test_every_bounded_field_has_a_case():
    assert set(CASES) == set(TRL_FIELD_BOUNDS)


@pytest.mark.parametrize(
    ("config_class", "field"),
    [(cls, field) for cls in (ASPOConfig, AsyncASPOConfig) for field in CASES if field in cls.__dataclass_fields__],
)
def test_a_value_outside_trls_documented_domain_is_refused_by_name(config_class, field):
    outside, allowed, inside = CASES[field]
    with pytest.raises(
        ValueError, match=rf"{config_class.__name__}\.{field}={outside!r} is invalid: must lie in {allowed}"
    ):
        config_class(**BASE, **{field: outside})
    for value in inside:  # None: TRL derives the value
        config = config_class(**BASE, **{field: value})
        assert value is None or getattr(config, field) == value


def test_a_wrong_type_is_refused_by_name_not_compared():
    with pytest.raises(ValueError, match=r"AsyncASPOConfig\.max_staleness='4' is invalid: must be an integer"):
        AsyncASPOConfig(**BASE, max_staleness="4")


def test_the_command_refuses_them_before_torch(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(base_with(temperature="0", top_p="1.5", trainer="async", max_staleness="-1"))
    status, _, stderr, torch_imported, _ = run_cli("train", "--config", path, cwd=tmp_path)
    assert (status, torch_imported) == (2, False), stderr
    assert stderr == [
        "trl-aspo train: 3 configuration errors:",
        "  AsyncASPOConfig.temperature=0 is invalid: must lie in (0, 1e+06].",
        "  AsyncASPOConfig.top_p=1.5 is invalid: must lie in (0, 1].",
        "  AsyncASPOConfig.max_staleness=-1 is invalid: must lie in [0, 1e+09].",
        "Run `trl-aspo train --help` for every field.",
    ]
