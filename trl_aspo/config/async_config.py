"""`AsyncASPOConfig`: TRL's experimental `AsyncGRPOConfig` plus the fields of `ASPOConfig`, defined once in
`ASPOFieldsMixin` (trl_aspo/config.py) so both configs give every field the same name, meaning and validation.

`AsyncGRPOConfig` has no `loss_type`; this config adds one: "ppo" (the default, TRL's fixed PPO clip on the
generator's log-probs) or "aspo". Fields the asynchronous trainer does not act on yet are refused with a message
naming them (see `ASYNC_UNSUPPORTED_FIELDS`). With every new field at its default, the configuration means exactly
what the same `AsyncGRPOConfig` means.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from trl_aspo.config.aspo_config import ASPOFieldsMixin, Dependency

ASYNC_LOSS_TYPES = ("ppo", "aspo")

_NOT_YET = "the asynchronous trainer does not implement it yet"
ASYNC_UNSUPPORTED_FIELDS = {
    "aspo_adaptive_kl_beta": "AsyncGRPOTrainer has no KL term (no reference model)",
    "aspo_adaptive_kl_entropy_target": "AsyncGRPOTrainer has no KL term (no reference model)",
    "kl_clamp": "AsyncGRPOTrainer has no KL term (no reference model)",
    "lr_schedule_per_generation": "the asynchronous trainer generates continuously: no rounds to step a schedule by",
    "overlong_buffer_length": f"{_NOT_YET}; add TRL's soft overlong punishment to reward_funcs instead",
    "overlong_penalty_factor": _NOT_YET,
    "value_rho_mode": "'kl' needs a log-prob pass on stored completions, which the asynchronous trainer does not run",
}

# ASPOFieldsMixin fields that ASPOConfig checks against other fields and that act on their own here (name -> why).
ASYNC_INDEPENDENT_FIELDS = {
    "log_weight_map": "every trained token carries the generator's log-probs, and both loss types have a weight "
    "(trl_aspo.algorithms.weight_map)",
}


@dataclass
class AsyncASPOConfig(ASPOFieldsMixin, AsyncGRPOConfig):
    r"""
    Configuration for [`AsyncASPOTrainer`]: every `trl.experimental.async_grpo.AsyncGRPOConfig` field, `loss_type`,
    and the fields of [`ASPOConfig`] the asynchronous trainer acts on (same names, meanings and checks).

    The trainer scores samples itself, over the samples of one optimizer step (it needs `token_budget=0`, TRL's
    fixed-count batches, as soon as a field below changes the advantage): `advantage_estimator="spo"`/`"spo++"`
    (the sample's `model_version` is its policy event), `advantage_normalization="batch"`/`"token"`, and
    `tool_shaping`; with spo/spo++, `prioritized_sampling` makes the rollout worker draw each prompt group by
    priority (trl_aspo.infra.prompt_stream). `advantage_estimator="group"` with `advantage_normalization="group"` keeps
    the rollout worker's per-group z-score.
    """

    loss_type: str = field(
        default="ppo",
        metadata={
            "help": "Policy loss on the generator's log-probs: 'ppo' = TRL's fixed PPO clip with epsilon / "
            "epsilon_high (AsyncGRPOTrainer's loss); 'aspo' = the asymmetric IS loss (flipped ratio for positive "
            "advantages, soft dual clip).",
            "choices": list(ASYNC_LOSS_TYPES),
        },
    )

    _unsupported_fields = ASYNC_UNSUPPORTED_FIELDS

    def __post_init__(self):
        self._validate_aspo_fields()
        super().__post_init__()
        self._check_field_dependencies()

    def _config_dependencies(self) -> tuple[Dependency, ...]:
        return (
            Dependency(
                "aspo_unflipped_fraction",
                ("per_device_train_batch_size", "token_budget"),
                "aspo_unflipped_fraction x per_device_train_batch_size > 0.5 (or token_budget > 0)",
                lambda c: c.aspo_unflipped_fraction * c.per_device_train_batch_size > 0.5 or bool(c.token_budget),
                "round(fraction x a micro-batch's positive-advantage samples) are left unflipped, 0 in every "
                "micro-batch",
            ),
        )

    @property
    def scores_on_trainer(self) -> bool:
        """Whether the trainer scores (and filters) each optimizer step's samples itself."""
        return (
            self.advantage_estimator != "group"
            or self.advantage_normalization != "group"
            or self.tool_shaping
            or self.filter_zero_variance_groups
        )

    def _validate_loss_coupling(self, require) -> None:
        require(self.loss_type in ASYNC_LOSS_TYPES, "loss_type", f"must be one of {ASYNC_LOSS_TYPES}")

    def _validate_reward_aggregation(self, require, single_stream: bool) -> None:
        """AsyncGRPOTrainer sums the reward functions (weight 1 each); the tracker learns that sum."""
        require(
            not (self.scores_on_trainer and self.token_budget != 0),
            "token_budget",
            "trainer-side scoring normalizes over the samples of one optimizer step, which needs TRL's fixed-count "
            "batches: set token_budget=0",
        )
