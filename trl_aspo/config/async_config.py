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

import warnings
from dataclasses import dataclass

from trl.experimental.async_grpo import AsyncGRPOConfig

from trl_aspo.algorithms.advantage_estimators import get_advantage_estimator
from trl_aspo.algorithms.policy_losses import get_policy_loss
from trl_aspo.algorithms.proximal_policy import PROXIMAL_POLICIES
from trl_aspo.algorithms.rollout_correction import CORRECTION_MODES
from trl_aspo.config.aspo_config import ASPOFieldsMixin
from trl_aspo.config.fields import (
    ASYNC,
    Bound,
    Check,
    Needs,
    Section,
    check_dependencies,
    fields_docstring,
    independent_fields,
    unsupported_fields,
)

# The fields the asynchronous trainer cannot honour yet (name -> why), from their declarations' `unsupported`.
ASYNC_UNSUPPORTED_FIELDS = unsupported_fields(ASPOFieldsMixin, ASYNC)

# ASPOFieldsMixin fields that ASPOConfig checks against other fields and that act on their own here (name -> why),
# from their declarations' `independent`.
ASYNC_INDEPENDENT_FIELDS = independent_fields(ASPOFieldsMixin, ASYNC)


# SPO++'s cap on the rollout weight (arXiv 2608.24870, Table 3: token_truncate with upper bound 2).
SPO_PP_CLIP_MAX = 2.0


def default_truncation_bound(config) -> None:
    """A truncate mode of the rollout correction without an upper bound gets SPO++'s, 2, with a warning: unbounded,
    one generator log-prob near float32's smallest normal weights its token by up to e^87 (measured: an -inf log-prob
    weighted a token near 5e8)."""
    if (
        config.vllm_importance_sampling_correction
        and config.vllm_importance_sampling_mode.endswith("_truncate")
        and config.vllm_importance_sampling_clip_max is None
    ):
        warnings.warn(
            f"vllm_importance_sampling_mode={config.vllm_importance_sampling_mode!r} with "
            f"vllm_importance_sampling_clip_max=None would leave the rollout weight unbounded above; it is set to "
            f"{SPO_PP_CLIP_MAX} (SPO++'s cap). Set vllm_importance_sampling_clip_max to choose another bound.",
            UserWarning,
            stacklevel=3,
        )
        config.vllm_importance_sampling_clip_max = SPO_PP_CLIP_MAX


def check_sampling_logprobs(config, reports_processed_logprobs: bool) -> None:
    """Refuse, naming both fields, a generator whose log-probs are of a processed distribution (a worker that
    `reports_processed_logprobs`, as vLLM's `processed_logprobs` are, sampling at top_p < 1 or top_k > 0) while the
    ratio against them is corrected, flipped or clipped beyond TRL's own PPO loss: the trainer's log-probs are of the
    full softmax, so the ratio is not 1 where no parameter changed. `allow_processed_sampling_logprobs` accepts it.
    The trainer calls this once it knows its rollout worker (`LocalRolloutWorker` reports full-softmax log-probs
    unless asked otherwise; TRL's, vLLM's processed ones)."""
    processed = reports_processed_logprobs and (config.top_p < 1.0 or config.top_k > 0)
    reads_ratio = config.vllm_importance_sampling_correction or get_policy_loss(config.loss_type) is not None
    if not processed or not reads_ratio or config.allow_processed_sampling_logprobs:
        return
    acting = (
        "the rollout correction (vllm_importance_sampling_correction=True)"
        if config.vllm_importance_sampling_correction
        else f"loss_type={config.loss_type!r}, which flips and clips that ratio,"
    )
    field = "top_p" if config.top_p < 1.0 else "top_k"
    raise ValueError(
        f"{type(config).__name__}.{field}={getattr(config, field)!r} is invalid: the generator samples with "
        f"top_p={config.top_p}, top_k={config.top_k} and reports the log-probs of that truncated, renormalized "
        "distribution while the trainer's are of the full softmax, so the ratio is not 1 even where no parameter "
        f"changed, and {acting} acts on that artefact. Set top_p=1.0 and top_k=0 (or "
        "allow_processed_sampling_logprobs=True to accept it)."
    )


CORRECTION_ON = Needs(
    ("vllm_importance_sampling_correction",),
    "vllm_importance_sampling_correction=True",
    lambda c: c.vllm_importance_sampling_correction,
    "it shapes the rollout correction, which is off",
)
OFF_POLICY = Section(
    "Off-policy correction (asynchronous trainer)",
    "The decoupled objective (docs/async.md): with vllm_importance_sampling_correction=True the loss's ratio is "
    "pi_theta / pi_prox (the trainer's own log-probs at the step, no extra forward pass) and each token's loss is "
    "multiplied by a gradient-free weight c = f(pi_prox / pi_generator), truncated or masked per token or per "
    "sequence exactly as GRPOConfig's fields of the same names do for the synchronous trainer. Off (the default), "
    "the trainer computes what TRL's AsyncGRPOTrainer computes.",
    depends=(CORRECTION_ON,),
)
ROLLOUT_BATCHES = Section(
    "Rollout batches (asynchronous trainer)",
    "A rollout batch is steps_per_rollout_batch optimizer steps' worth of samples, fetched from the rollout queue "
    "(and scored, one optimizer step at a time) before its first update, then trained in that many optimizer steps, "
    "one mini-batch each (verl's ppo_mini_batch_size, AReaL's ppo_n_minibatches). With the decoupled objective the "
    "loss's ratio is against the policy at the batch start (proximal_policy), so it moves on the batch's later steps.",
)
ROLLOUT_RUNTIME = Section(
    "Rollout runtime (asynchronous trainer)",
    "SPO++'s runtime (arXiv 2608.24870, Table 3), acted on by the rollout worker's loop, TRL's or the local one "
    "(trl_aspo.infra.dispatch_control): one request in flight per prompt, and the old policy's work drained at each "
    "publish.",
)
SINGLE_STREAM = Needs(
    ("num_generations",),
    "num_generations=1",
    lambda c: c.num_generations == 1,
    "it bounds the conversations of one prompt in flight, and a group of several completions of one prompt is "
    "dispatched together",
)
PPO_LOSS = Section(
    "PPO loss (asynchronous trainer)",
    "Options of loss_type='ppo', TRL's clipped surrogate.",
)
TRL_PPO_ON = Needs(
    ("loss_type",),
    "loss_type='ppo'",
    lambda c: get_policy_loss(c.loss_type) is None,
    "it caps TRL's PPO surrogate; a registered loss has its own clips",
)


def _saves_at_batch_boundaries(config) -> bool:
    """Whether every checkpoint `save_steps` asks for falls on a rollout-batch boundary (a step that is a multiple
    of steps_per_rollout_batch): TRL's rollout state holds no fetched-but-untrained samples."""
    k = config.steps_per_rollout_batch
    if k == 1 or config.save_strategy != "steps":
        return True
    return config.save_steps >= 1 and float(config.save_steps).is_integer() and int(config.save_steps) % k == 0


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

    vllm_importance_sampling_correction: bool = OFF_POLICY.field(
        False,
        help="The decoupled objective: the loss's ratio against the trainer's own log-probs at the step "
        "(pi_prox) and a rollout importance weight c = f(pi_prox / pi_generator) on each token's loss, so "
        "staleness and the generator/trainer mismatch are corrected apart from the policy update. Works with "
        "'ppo' and every registered loss. False = the ratio against the generator's log-probs (TRL's).",
        switch=True,
        independent="switches the decoupled objective on",
    )
    vllm_importance_sampling_mode: str = OFF_POLICY.field(
        "sequence_mask",
        help="How the rollout weight is formed from rho = pi_prox / pi_generator: 'token_truncate' (per-token rho "
        "clamped to [clip_min, clip_max]; the SPO++ recipe with clip_max 2), 'token_mask' (per-token rho, 0 "
        "outside the bounds; IcePop is this mode with both bounds, e.g. [0.5, 5]), 'sequence_truncate' / "
        "'sequence_mask' (one rho per completion, exp of the summed token log-ratios). GRPOConfig's default.",
        choices=CORRECTION_MODES,
    )
    vllm_importance_sampling_clip_max: float | None = OFF_POLICY.field(
        3.0,
        help="Upper bound C_max of rho: truncated to it ('*_truncate') or masked above it ('*_mask'). None = no upper "
        "bound (then clip_min must be set); the '*_truncate' modes take 2 (SPO++'s cap) instead, with a warning. "
        "Must be > 0 and >= clip_min.",
        bound=Bound(0, 1e6, low_open=True),
        checks=(
            Check(
                lambda c: (
                    c.vllm_importance_sampling_clip_min is None
                    or c.vllm_importance_sampling_clip_max is None
                    or c.vllm_importance_sampling_clip_min <= c.vllm_importance_sampling_clip_max
                ),
                lambda c: f"must be >= vllm_importance_sampling_clip_min={c.vllm_importance_sampling_clip_min}",
            ),
            Check(
                lambda c: (
                    not c.vllm_importance_sampling_correction
                    or c.vllm_importance_sampling_clip_max is not None
                    or c.vllm_importance_sampling_clip_min is not None
                ),
                "a bound is needed (with both None the weight is the raw, unbounded ratio): set it or "
                "vllm_importance_sampling_clip_min",
            ),
        ),
    )
    vllm_importance_sampling_clip_min: float | None = OFF_POLICY.field(
        None,
        help="Lower bound C_min of rho: truncated to it ('*_truncate') or masked below it ('*_mask'). None = no lower "
        "bound. Must be >= 0 and <= clip_max.",
        bound=Bound(0, 1e6),
    )
    allow_processed_sampling_logprobs: bool = OFF_POLICY.field(
        False,
        help="Accept a generator that samples with top_p < 1 or top_k > 0 and reports the log-probs of that "
        "processed distribution (TRL's worker: vLLM's processed_logprobs) together with the rollout correction or a "
        "registered loss. The trainer's log-probs are of the full softmax, so the ratio differs from 1 at zero "
        "drift; such runs are refused when the trainer is built unless this is set (e.g. to measure that mismatch "
        "on purpose).",
        switch=True,
        independent="lifts the refusal of processed sampling, whatever else is set",
    )

    proximal_policy: str = OFF_POLICY.field(
        "recompute",
        help="The proximal policy pi_prox of the decoupled objective over a rollout batch (steps_per_rollout_batch): "
        "'recompute' (exact: the batch's log-probs under the parameters at its start, by one no-grad forward of "
        "each later mini-batch before the first update) or 'loglinear' (AReaL's and A-3PO's approximation, no extra "
        "forward: log pi_prox = log pi_b + alpha (log pi_theta - log pi_b), alpha from the optimizer steps since the "
        "sample's version was published; docs/async.md says what it approximates). With one step per batch both "
        "are the trainer's own log-probs of the step.",
        choices=PROXIMAL_POLICIES,
    )
    steps_per_rollout_batch: int = ROLLOUT_BATCHES.field(
        1,
        help="Optimizer steps per rollout batch (k). The batch (k steps' worth of samples, all their micro-batches) "
        "is fetched before its first update and trained in k optimizer steps; advantages, normalization and "
        "shaping stay per optimizer step. Checkpoints are written at batch boundaries only (save_steps must be a "
        "multiple of k), and max_staleness is checked when the batch is fetched, so a sample trained at the batch's "
        "step j is up to j steps staler. 1 = TRL's AsyncGRPOTrainer (each sample trains in the step that fetches "
        "it).",
        bound=Bound(1, 10**6),
        checks=(
            Check(
                _saves_at_batch_boundaries,
                lambda c: (
                    f"it must be a multiple of steps_per_rollout_batch={c.steps_per_rollout_batch} (checkpoints "
                    "are written at rollout-batch boundaries only: a fetched, untrained sample is in no checkpoint)"
                ),
                name="save_steps",
            ),
        ),
        independent="sets how many optimizer steps train each fetched batch, whatever else is set",
    )
    max_inflight_per_prompt: int | None = ROLLOUT_RUNTIME.field(
        None,
        help="Requests in flight per prompt (SPO++ uses 1). A prompt, keyed as the value tracker keys it "
        "(prompt_id_column, else a hash of the prompt), is in flight from its dispatch until its whole trajectory "
        "(every turn and tool call) has been scored; the worker dispatches the next eligible prompt instead (TRL's "
        "cycle passes over it; prioritized_sampling draws among eligible prompts, the priority distribution "
        "conditioned on eligibility), and when none is eligible the slot waits. Needs num_generations=1, a "
        "map-style dataset. None = unlimited (TRL's).",
        bound=Bound(1, 10**9),
        depends=SINGLE_STREAM,
    )
    drain_on_publish: bool = ROLLOUT_RUNTIME.field(
        False,
        help="At each publish (weight sync) the trainer stops new dispatches and waits until every conversation "
        "dispatched under the old weights has finished generating, every turn and tool call, before the new weights "
        "load (nothing is discarded); dispatch resumes once the worker sees the new model version, so no "
        "completion mixes two policy versions (rollout/turns_across_publish_total is 0). The publish waits for the "
        "longest conversation in flight. False = TRL's (a turn may span a publish).",
        switch=True,
        independent="makes the publish wait for the old weights' conversations, whatever else is set",
    )
    ppo_dual_clip: float | None = PPO_LOSS.field(
        None,
        help="PPO's negative dual clip c (> 1; Ye et al. 2020; verl's clip_ratio_c, AReaL's c_clip): for tokens "
        "with A < 0 the clipped surrogate max(-A r, -A clip(r)) becomes min(that, -c A), with no gradient where the "
        "cap binds; the rollout correction weight w_is multiplies the result afterwards. The SPO++ recipe uses 2, "
        "SPO 10. None = off (TRL's loss). ASPO's soft dual clip (aspo_dual_clip, a gradient weight) is another rule.",
        bound=Bound(1, 1e6, low_open=True),
        depends=TRL_PPO_ON,
    )

    def __post_init__(self):
        default_truncation_bound(self)
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
