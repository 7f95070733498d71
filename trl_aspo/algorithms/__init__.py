"""Pure tensor functions of trl-aspo: tensors in, tensors out, no trainer, no config object.

Each module states its equation and the paper it follows: `losses` (the asymmetric IS loss, arXiv 2510.06062),
`kl`, `shaping` (tool-position advantage shaping, arXiv 2508.19201), `normalize` (SPO's batch and SPO++'s
action-token measure), `filters`, `tool_metrics`, `weight_map`, `lr_schedule`, `advantage_checks`, `packed`, and the
policy-loss registry `policy_losses` (`register_policy_loss`; `aspo_policy_loss` is the aspo loss's registration)
and the advantage-estimator registry `advantage_estimators` (`register_advantage_estimator`; `group` is registered
there, `spo`/`spo++` by trl_aspo.values).
This package is their public path: `from trl_aspo.algorithms import register_policy_loss, PolicyLossInputs`.
"""

# Imported for its registration of loss_type="aspo" (the module, not a name: `get_policy_loss("aspo")`).
from trl_aspo.algorithms import aspo_policy_loss as _aspo_registration  # noqa: F401
from trl_aspo.algorithms.advantage_checks import NonFiniteAdvantageError, advantage_sources, check_finite_advantages
from trl_aspo.algorithms.advantage_estimators import (
    AdvantageEstimator,
    get_advantage_estimator,
    group_mean_baseline,
    register_advantage_estimator,
    registered_advantage_estimators,
)
from trl_aspo.algorithms.filters import zero_variance_from_std, zero_variance_groups
from trl_aspo.algorithms.kl import k3_kl
from trl_aspo.algorithms.losses import (
    aggregate_loss,
    asymmetric_policy_loss,
    entropy_split_mask,
    progressive_flip_threshold,
    repetition_rate,
    step_loss_normalizer,
    unflipped_sample_mask,
)
from trl_aspo.algorithms.lr_schedule import per_generation_lr_lambda
from trl_aspo.algorithms.normalize import batch_normalize, token_measure_normalize
from trl_aspo.algorithms.packed import SegmentRows, packed_loss_units
from trl_aspo.algorithms.policy_losses import (
    TRL_LOSS_TYPES,
    PolicyLoss,
    PolicyLossInputs,
    RatioMetric,
    get_policy_loss,
    reduce_ratio_metrics,
    register_policy_loss,
    registered_policy_losses,
)
from trl_aspo.algorithms.shaping import (
    CallablePenalty,
    InteractiveTurnBonus,
    ShapingHook,
    is_correct,
    shaping_stats,
    tool_position_bias,
    tool_position_shaping,
)
from trl_aspo.algorithms.tool_metrics import (
    ToolCallCounter,
    first_tool_call_positions,
    is_model_text,
    regex_tool_call_positions,
    resolve_call_token_ids,
    resolve_whitespace_token_ids,
    tool_call_metrics,
)
from trl_aspo.algorithms.weight_map import WeightMapLog, aspo_weight, clipped_ratio_weight, weight_map_sums

__all__ = [
    "AdvantageEstimator",
    "CallablePenalty",
    "InteractiveTurnBonus",
    "NonFiniteAdvantageError",
    "PolicyLoss",
    "PolicyLossInputs",
    "RatioMetric",
    "TRL_LOSS_TYPES",
    "SegmentRows",
    "ShapingHook",
    "WeightMapLog",
    "advantage_sources",
    "aggregate_loss",
    "aspo_weight",
    "asymmetric_policy_loss",
    "batch_normalize",
    "check_finite_advantages",
    "clipped_ratio_weight",
    "entropy_split_mask",
    "ToolCallCounter",
    "first_tool_call_positions",
    "get_advantage_estimator",
    "group_mean_baseline",
    "get_policy_loss",
    "is_correct",
    "is_model_text",
    "k3_kl",
    "packed_loss_units",
    "per_generation_lr_lambda",
    "progressive_flip_threshold",
    "reduce_ratio_metrics",
    "register_advantage_estimator",
    "registered_advantage_estimators",
    "register_policy_loss",
    "registered_policy_losses",
    "regex_tool_call_positions",
    "repetition_rate",
    "resolve_call_token_ids",
    "resolve_whitespace_token_ids",
    "shaping_stats",
    "step_loss_normalizer",
    "token_measure_normalize",
    "tool_call_metrics",
    "tool_position_bias",
    "tool_position_shaping",
    "unflipped_sample_mask",
    "weight_map_sums",
    "zero_variance_from_std",
    "zero_variance_groups",
]
