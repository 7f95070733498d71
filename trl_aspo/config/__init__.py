"""`ASPOConfig` (TRL's `GRPOConfig` plus the fields of the three methods) and `AsyncASPOConfig` (TRL's
`AsyncGRPOConfig` plus the same fields). Public path: `from trl_aspo.config import ASPOConfig, FIELD_BOUNDS`.

Each field is declared once, with its help, section, bound, choices, dependencies and checks (trl_aspo.config.fields);
`FIELD_BOUNDS`, `FIELD_DEPENDENCIES`, `INDEPENDENT_FIELDS`, `DERIVED_DEFAULTS` and `RESUME_FIELDS` are views of the
declarations."""

from trl_aspo.config.aspo_config import (
    ADVANTAGE_NORMALIZATIONS,
    ASPO_AGGREGATIONS,
    DERIVED_DEFAULTS,
    FIELD_BOUNDS,
    FIELD_DEPENDENCIES,
    INDEPENDENT_FIELDS,
    RESUME_FIELDS,
    VALUE_RHO_MODES,
    ASPOConfig,
    ASPOFieldsMixin,
    Bound,
    Dependency,
    aspo_field_types,
)
from trl_aspo.config.fields import Check, Needs, Section, field_spec

__all__ = [
    "ADVANTAGE_NORMALIZATIONS",
    "ASPO_AGGREGATIONS",
    "DERIVED_DEFAULTS",
    "FIELD_BOUNDS",
    "FIELD_DEPENDENCIES",
    "INDEPENDENT_FIELDS",
    "RESUME_FIELDS",
    "VALUE_RHO_MODES",
    "ASPOConfig",
    "ASPOFieldsMixin",
    "AsyncASPOConfig",
    "Bound",
    "Check",
    "Dependency",
    "Needs",
    "Section",
    "aspo_field_types",
    "field_spec",
]


def __getattr__(name):
    # TRL's experimental asynchronous package loads only for the asynchronous config.
    if name == "AsyncASPOConfig":
        from trl_aspo.config.async_config import AsyncASPOConfig

        return AsyncASPOConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
