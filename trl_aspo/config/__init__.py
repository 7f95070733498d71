"""`ASPOConfig` (TRL's `GRPOConfig` plus the fields of the three methods) and `AsyncASPOConfig` (TRL's
`AsyncGRPOConfig` plus the same fields). Public path: `from trl_aspo.config import ASPOConfig, FIELD_BOUNDS`."""

from trl_aspo.config.aspo_config import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_NORMALIZATIONS,
    ASPO_AGGREGATIONS,
    DERIVED_DEFAULTS,
    FIELD_BOUNDS,
    FIELD_DEPENDENCIES,
    INDEPENDENT_FIELDS,
    SINGLE_STREAM_ESTIMATORS,
    VALUE_RHO_MODES,
    ASPOConfig,
    ASPOFieldsMixin,
    Bound,
    Dependency,
    aspo_field_types,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_NORMALIZATIONS",
    "ASPO_AGGREGATIONS",
    "DERIVED_DEFAULTS",
    "FIELD_BOUNDS",
    "FIELD_DEPENDENCIES",
    "INDEPENDENT_FIELDS",
    "SINGLE_STREAM_ESTIMATORS",
    "VALUE_RHO_MODES",
    "ASPOConfig",
    "ASPOFieldsMixin",
    "AsyncASPOConfig",
    "Bound",
    "Dependency",
    "aspo_field_types",
]


def __getattr__(name):
    # TRL's experimental asynchronous package loads only for the asynchronous config.
    if name == "AsyncASPOConfig":
        from trl_aspo.config.async_config import AsyncASPOConfig

        return AsyncASPOConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
