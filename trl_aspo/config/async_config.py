"""`AsyncASPOConfig`: TRL's experimental `AsyncGRPOConfig` plus the fields of `ASPOConfig`, declared once in
`ASPOFieldsMixin` (trl_aspo/config/aspo_config.py) so both configs give every field the same name, meaning and
validation.

`AsyncGRPOConfig` has no `loss_type`; the shared field adds one: "ppo" (the default, TRL's fixed PPO clip on the
generator's log-probs) or a registered loss ("aspo", or one registered with `register_policy_loss`). Fields the
asynchronous trainer does not act on yet are refused with a message naming them (their declarations say why:
`ASYNC_UNSUPPORTED_FIELDS`). With every new field at its default, the configuration means exactly what the same
`AsyncGRPOConfig` means.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl.experimental.async_grpo import AsyncGRPOConfig

from trl_aspo.algorithms.advantage_estimators import get_advantage_estimator
from trl_aspo.config.aspo_config import ASPOFieldsMixin
from trl_aspo.config.fields import ASYNC, check_dependencies, fields_docstring, independent_fields, unsupported_fields

# The fields the asynchronous trainer cannot honour yet (name -> why), from their declarations' `unsupported`.
ASYNC_UNSUPPORTED_FIELDS = unsupported_fields(ASPOFieldsMixin, ASYNC)

# ASPOFieldsMixin fields that ASPOConfig checks against other fields and that act on their own here (name -> why),
# from their declarations' `independent`.
ASYNC_INDEPENDENT_FIELDS = independent_fields(ASPOFieldsMixin, ASYNC)


@dataclass
class AsyncASPOConfig(ASPOFieldsMixin, AsyncGRPOConfig):
    r"""
    Configuration for [`AsyncASPOTrainer`]: every `trl.experimental.async_grpo.AsyncGRPOConfig` field, `loss_type`
    ("ppo", TRL's, or a registered loss), and the fields of [`ASPOConfig`] the asynchronous trainer acts on (same
    names, meanings and checks).

    The trainer scores samples itself, over the samples of one optimizer step (it needs `token_budget=0`, TRL's
    fixed-count batches, as soon as a field below changes the advantage): `advantage_estimator="spo"`/`"spo++"`
    (the sample's `model_version` is its policy event), `advantage_normalization="batch"`/`"token"`, and
    `tool_shaping`; with spo/spo++, `prioritized_sampling` makes the rollout worker draw each prompt group by
    priority (trl_aspo.infra.prompt_stream). `advantage_estimator="group"` with `advantage_normalization="group"` keeps
    the rollout worker's per-group z-score.
    """

    _trainer = ASYNC
    _default_loss_type = "ppo"

    def __post_init__(self):
        self._validate_aspo_fields()
        super().__post_init__()
        check_dependencies(self)

    @property
    def scores_on_trainer(self) -> bool:
        """Whether the trainer scores (and filters) each optimizer step's samples itself: unless the rollout worker's
        own advantage (TRL's group z-score) is kept unchanged."""
        return (
            not get_advantage_estimator(self.advantage_estimator).computed_by_trl
            or self.advantage_normalization != "group"
            or self.tool_shaping
            or self.filter_zero_variance_groups
        )


AsyncASPOConfig.__doc__ += fields_docstring(AsyncASPOConfig)
