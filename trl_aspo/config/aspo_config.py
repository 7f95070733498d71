"""`ASPOConfig`: TRL's `GRPOConfig` plus the switches of the three methods trl-aspo adds.

Every field is declared once, in `ASPOFieldsMixin`, with everything about it (trl_aspo.config.fields): its help text
(shown by `trl-aspo train --help` and in docs/configuration.md), its section, its range or choices, the switches it
needs and the checks between fields it takes part in. `__post_init__` applies the declarations; an invalid value
raises a `ValueError` that names the field and what is allowed. With every new switch at its default, the
configuration means exactly what the same `GRPOConfig` means. `FIELD_BOUNDS`, `FIELD_DEPENDENCIES`,
`INDEPENDENT_FIELDS`, `DERIVED_DEFAULTS` and `RESUME_FIELDS` are views of the declarations.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch
from trl import GRPOConfig

# Registers spo and spo++, whose trackers live in the values layer, before any config is checked.
import trl_aspo.values.tracker_estimators  # noqa: F401
from trl_aspo.algorithms.advantage_estimators import (
    AdvantageEstimator,
    get_advantage_estimator,
    registered_advantage_estimators,
)
from trl_aspo.algorithms.policy_losses import (
    get_policy_loss,
    loss_type_names,
    losses_reading,
    registered_policy_losses,
)
from trl_aspo.algorithms.weight_map import CLIPPED_RATIO_LOSSES
from trl_aspo.config.fields import (
    ASYNC,
    SYNC,
    Bound,
    Check,
    Dependency,
    Needs,
    Section,
    check_dependencies,
    check_values,
    config_dependencies,
    declared_field_types,
    derived_defaults,
    field_bounds,
    field_sections,
    field_types,
    fields_docstring,
    independent_fields,
    resume_fields,
    shared_dependencies,
)
from trl_aspo.values.beta_counts import default_prior_strength

ADVANTAGE_NORMALIZATIONS = ("group", "batch", "token")
ASPO_AGGREGATIONS = ("token", "sequence")
VALUE_RHO_MODES = ("constant", "kl")


def aspo_field_types() -> dict[str, list[str]]:
    """For each field trl-aspo adds (the fields of `ASPOFieldsMixin`, shared by `ASPOConfig` and `AsyncASPOConfig`),
    the names of the types its annotation allows ('float', 'None', 'list[float]', ...), read with
    `typing.get_type_hints` (dataclass annotations are strings here, and `HfArgumentParser` rewrites `Field.type`)."""
    return field_types(ASPOFieldsMixin)


# ---------------------------------------------------------------------------- what the declarations read
def _estimator(config) -> AdvantageEstimator:
    return get_advantage_estimator(config.advantage_estimator)


def _tracks_values(config) -> bool:
    return _estimator(config).tracks_values


def _tracker_initialized(config) -> bool:
    return config.value_init_samples > 0 or config.value_init_file is not None


def _prior_rho(config) -> float:
    return config.value_rho_min if config.value_rho_mode == "kl" else config.value_rho


def _derived_prior_strength(config) -> float | None:
    rho = _prior_rho(config)
    return default_prior_strength(rho) if rho < 1 else None


def _derived_normalization(config) -> str:
    return _estimator(config).default_normalization


def _lr_schedule_type(config) -> str:
    return getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)


def _positive_generations(config) -> bool:
    generations = config.num_generations
    integer = isinstance(generations, int) and not isinstance(generations, bool)
    return generations is None or (integer and generations >= 1)


def _group_scaling_for_normalize_then_sum(config) -> bool:
    return config.multi_objective_aggregation != "normalize_then_sum" or config.advantage_normalization == "group"


def _valid_tool_call_pattern(config, name: str) -> None:
    if config.tool_call_pattern is not None:
        try:
            re.compile(config.tool_call_pattern)
        except re.error as error:
            raise ValueError(
                f"{type(config).__name__}.tool_call_pattern={config.tool_call_pattern!r} is not a valid regular "
                f"expression: {error}."
            ) from None


# The signals `stop_signals` may name (catchable ones a scheduler or a user sends; KILL and STOP cannot be caught).
STOP_SIGNAL_NAMES = ("TERM", "USR1", "USR2", "INT", "HUP", "QUIT")


def _known_stop_signals(config) -> bool:
    return config.stop_signals is None or all(name in STOP_SIGNAL_NAMES for name in config.stop_signals)


def _registered_loss(config) -> bool:
    return get_policy_loss(config.loss_type) is not None


def _weight_map_loss(config) -> bool:
    registered = get_policy_loss(config.loss_type)
    return config.loss_type in CLIPPED_RATIO_LOSSES or (registered is not None and registered.weight is not None)


def _reads_fields(prefix: str) -> Needs:
    """The rule of fields named `prefix*`: they act only in a registered loss whose registration reads them."""
    names = losses_reading(prefix)
    return Needs(
        ("loss_type",),
        " or ".join(f"loss_type={name!r}" for name in names),
        lambda c: _registered_loss(c) and get_policy_loss(c.loss_type).reads_fields == prefix,
        f"it only acts in the {' or '.join(names)} loss",
    )


def _on_policy_warning(config) -> None:
    """A registered loss that only acts off-policy says so when every optimizer step is on-policy (ratio 1)."""
    registered = get_policy_loss(config.loss_type)
    if registered is None or registered.on_policy_warning is None:
        return
    vllm_corrected = config.use_vllm and config.vllm_importance_sampling_correction
    on_policy = config.num_iterations == 1 and config.steps_per_generation == config.gradient_accumulation_steps
    if on_policy and not vllm_corrected:
        warnings.warn(
            f"{type(config).__name__}.loss_type={config.loss_type!r} with num_iterations=1 and "
            f"steps_per_generation == gradient_accumulation_steps: {registered.on_policy_warning}",
            UserWarning,
            stacklevel=4,
        )


# The switches several fields need.
REGISTERED_LOSS_ON = Needs(
    ("loss_type",),
    f"a loss_type trl-aspo computes (registered: {', '.join(repr(name) for name in registered_policy_losses())})",
    _registered_loss,
    "TRL's own losses run inside TRL's code, which does not read it",
)
TOOL_SHAPING_ON = Needs(
    ("tool_shaping",), "tool_shaping=True", lambda c: c.tool_shaping, "it only acts in tool-position shaping"
)


def _needs_tracker(why: str = "it configures the value tracker") -> Needs:
    return Needs(
        ("advantage_estimator",), "a value-tracking advantage_estimator (e.g. 'spo' or 'spo++')", _tracks_values, why
    )


TRACKER_ON = _needs_tracker()
TRACKER_INITIALIZATION = _needs_tracker("it initializes the value tracker")
GROUP_ESTIMATOR_ON = Needs(
    ("advantage_estimator",),
    "a group advantage_estimator (e.g. 'group'; not a value tracker's)",
    lambda c: not _tracks_values(c),
    "a group of one completion always has zero variance",
)
PER_VISIT_FORGETTING_ON = Needs(
    ("advantage_estimator",),
    "an advantage_estimator with per-visit forgetting (e.g. 'spo')",
    lambda c: _estimator(c).per_visit_forgetting,
    "'kl' applies to per-visit forgetting (spo++ ages evidence by policy events)",
)
KL_RHO_ON = Needs(
    ("value_rho_mode",),
    "value_rho_mode='kl'",
    lambda c: c.value_rho_mode == "kl",
    "it shapes the KL-adaptive rho, and constant mode uses value_rho",
)

# Why the asynchronous trainer refuses a field (ASYNC_UNSUPPORTED_FIELDS).
_NO_KL_TERM = "AsyncGRPOTrainer has no KL term (no reference model)"
_NOT_YET = "the asynchronous trainer does not implement it yet"

# -------------------------------------------------------------------------------------------- the sections
POLICY_LOSS = Section(
    "Policy loss",
    "Which per-token loss trains: one of TRL's (computed by TRL's code) or one registered with "
    "`trl_aspo.algorithms.register_policy_loss` (computed by trl-aspo's shared assembly, with the aggregation "
    "below).",
)
ASPO_LOSS = Section(
    "Asymmetric IS loss",
    "The asymmetric importance-sampling loss (Wang et al. 2025, arXiv 2510.06062), selected with `loss_type='aspo'`: "
    "the flipped ratio for positive-advantage tokens, a one-sided hard clip and a soft dual clip; `epsilon` / "
    "`epsilon_high` keep their TRL meaning (hard-clip offsets below / above 1). Every `aspo_` field needs "
    "loss_type='aspo'.",
    depends=(_reads_fields("aspo_"),),
)
RECIPE = Section(
    "Recipe options of the ASPO reference (Archer2.0)",
    "Options of the reference's training recipe that are no part of the asymmetric loss: the KL clamp, the "
    "zero-variance group filter and the soft overlong penalty.",
)
TOOL_SHAPING = Section(
    "Tool-position advantage shaping",
    "Tool-position advantage shaping (Lin & Xu 2025, arXiv 2508.19201), switched on with `tool_shaping=True`, and how "
    "a tool call is found in a completion (also read by the tool metrics and `trl-aspo evaluate`).",
)
SINGLE_STREAM = Section(
    "Single-stream value tracking",
    "Single-stream value tracking (SPO, arXiv 2509.13232; SPO++, arXiv 2608.24870), selected with "
    "`advantage_estimator='spo'` or `'spo++'`; with these, `num_generations=1` is allowed.",
)
PRIORITIZED = Section("Prioritized sampling", "Prompts drawn by the value tracker's estimates (spo/spo++ only).")
OPTIMIZATION = Section("Optimization", "How the learning-rate schedule and the optimizer are stepped.")
LOGGING = Section("Logging", "What is logged besides TRL's metrics.")
STOPPING = Section(
    "Stopping on a signal",
    "How a run stops when its job is preempted or reaches its time limit (docs/resuming.md#stopping-on-a-signal): "
    "`trl-aspo train` installs the handlers; in the Python API they are opt-in (`trl_aspo.GracefulStop`).",
)


class _SingleCompletion(int):
    """The integer 1, except that it does not compare below 2 (used only during `GRPOConfig.__post_init__`)."""

    def __lt__(self, other):
        return False if other == 2 else int(self) < other


@dataclass
class ASPOFieldsMixin:
    """The fields trl-aspo adds and their validation, defined once for both trainers: [`ASPOConfig`] (on TRL's
    `GRPOConfig`) and [`AsyncASPOConfig`] (on TRL's experimental `AsyncGRPOConfig`).

    Each field declares, with its help text, its section, range, choices, dependencies and checks
    (trl_aspo.config.fields). A rule that reads a field of one TRL base config is declared for that trainer only
    (`only=SYNC` / `only=ASYNC`), and `unsupported={ASYNC: why}` refuses a field the asynchronous trainer cannot
    honour yet, by name, when it is set away from its default. A config class names its trainer in `_trainer`.
    """

    _trainer = None
    # `loss_type` when left at None: the TRL base trainer's own default loss.
    _default_loss_type = None

    # --- Policy loss --------------------------------------------------------------------------------------------
    loss_type: str | None = POLICY_LOSS.field(
        None,
        help="Per-token policy loss: a loss registered with trl_aspo.algorithms.register_policy_loss ('aspo' = "
        "the asymmetric IS loss: flipped ratio for positive-advantage tokens, one-sided hard clip, soft dual clip; "
        "see the aspo_* fields), or TRL's own: for ASPOTrainer GRPOConfig's 'grpo', 'dr_grpo', 'dapo', 'bnpo', "
        "'cispo', 'sapo', 'luspo', 'vespo'; for AsyncASPOTrainer 'ppo' (AsyncGRPOTrainer's fixed PPO clip on the "
        "generator's log-probs). None = the TRL trainer's default ('dapo' for ASPOTrainer, 'ppo' for "
        "AsyncASPOTrainer).",
        choices=loss_type_names,
        derived=lambda c: c._default_loss_type,
        independent="the loss switch",
        checks=(
            Check(
                lambda c: not _registered_loss(c) or getattr(c, "importance_sampling_level", "token") == "token",
                "must be 'token' with a loss trl-aspo computes (the registered loss takes per-token ratios)",
                name="importance_sampling_level",
                only=SYNC,
            ),
            Check(
                lambda c: not _registered_loss(c) or (c.entropy_coef == 0 and not c.use_adaptive_entropy),
                "the entropy bonus is TRL's own losses' (inline in GRPOTrainer._compute_loss), not supported with a "
                "registered loss_type; use aspo_adaptive_kl_beta or set 0",
                name="entropy_coef",
                only=SYNC,
            ),
        ),
        switch=True,
    )
    aspo_aggregation: str = POLICY_LOSS.field(
        "token",
        help="How a loss trl-aspo computes (a registered loss_type) turns per-token terms into one number per "
        "optimizer step, over all its micro-batches and ranks: 'token' = every action token weighs the same (the "
        "summed token losses divided by the step's action tokens; the synchronous trainer uses TRL's 'dapo' "
        "normalizer, the generation batch's action tokens per optimizer step, which is the step's own count when "
        "steps_per_generation = gradient_accumulation_steps), 'sequence' = every completion weighs the same (the "
        "sum of each completion's token mean divided by the step's completions, TRL's 'grpo').",
        choices=ASPO_AGGREGATIONS,
        depends=REGISTERED_LOSS_ON,
    )

    # --- Asymmetric IS loss -------------------------------------------------------------------------------------
    aspo_dual_clip: float = ASPO_LOSS.field(
        3.0,
        help="Soft dual-clip constant C (> 1) of the aspo loss: a positive-advantage token whose ratio falls "
        "below 1/C, or a negative-advantage token whose ratio rises above C, keeps a constant gradient weight C "
        "instead of an unbounded one.",
        bound=Bound(1, 100, low_open=True),
        depends=Needs(
            ("aspo_dual_clip_pos", "aspo_dual_clip_neg"),
            "aspo_dual_clip_pos or aspo_dual_clip_neg left at None",
            lambda c: c.aspo_dual_clip_pos is None or c.aspo_dual_clip_neg is None,
            "it is the fallback of both sign-specific constants, and both are set",
        ),
    )
    aspo_dual_clip_pos: float | None = ASPO_LOSS.field(
        None,
        help="Soft dual-clip constant for positive-advantage (flipped) tokens only, as the reference's "
        "`positive_clip_ratio_c`. None = `aspo_dual_clip`. Must be > 1.",
        bound=Bound(1, 100, low_open=True),
    )
    aspo_dual_clip_neg: float | None = ASPO_LOSS.field(
        None,
        help="Soft dual-clip constant for negative-advantage tokens only, as the reference's "
        "`negative_clip_ratio_c`. None = `aspo_dual_clip`. Must be > 1.",
        bound=Bound(1, 100, low_open=True),
    )
    aspo_entropy_quantile: float | None = ASPO_LOSS.field(
        None,
        help="Entropy-split clipping: tokens whose entropy is above this quantile of their completion's token "
        "entropies use the wider offsets `aspo_epsilon_high_entropy`. None = off; the reference uses 0.8. "
        "Must lie in (0, 1).",
        bound=Bound(0, 1, low_open=True, high_open=True),
    )
    aspo_epsilon_high_entropy: float = ASPO_LOSS.field(
        0.4,
        help="Hard-clip offset (both sides) for high-entropy tokens when `aspo_entropy_quantile` is set. Must be > 0.",
        bound=Bound(0, 10, low_open=True),
        depends=Needs(
            ("aspo_entropy_quantile",),
            "aspo_entropy_quantile set",
            lambda c: c.aspo_entropy_quantile is not None,
            "it is the offset of the high-entropy tokens that aspo_entropy_quantile selects",
        ),
    )
    aspo_flip_threshold_start: float = ASPO_LOSS.field(
        0.0,
        help="Progressive flip: a positive-advantage token gets the flipped ratio only where its advantage "
        "exceeds a threshold that falls linearly from this value to 0 over `aspo_flip_decay_steps` steps; the "
        "others use the standard clipped ratio. 0 = flip every positive token from the start. Must be >= 0.",
        bound=Bound(0, 100),
        depends=Needs(
            ("aspo_flip_decay_steps",),
            "aspo_flip_decay_steps > 0",
            lambda c: c.aspo_flip_decay_steps > 0,
            "with aspo_flip_decay_steps=0 the threshold is 0 at every step (every positive token flips from the "
            "start)",
        ),
    )
    aspo_flip_decay_steps: int = ASPO_LOSS.field(
        0,
        help="Optimizer steps over which the progressive-flip threshold decays to 0. Must be >= 0.",
        bound=Bound(0, 10**9),
        depends=Needs(
            ("aspo_flip_threshold_start",),
            "aspo_flip_threshold_start > 0",
            lambda c: c.aspo_flip_threshold_start > 0,
            "it decays the flip threshold from aspo_flip_threshold_start, which is 0",
        ),
    )
    aspo_unflipped_fraction: float = ASPO_LOSS.field(
        0.0,
        help="Share of positive-advantage completions (drawn among them each generation round) whose tokens "
        "keep the standard clipped ratio instead of the flip. Must lie in [0, 1].",
        bound=Bound(0, 1),
        depends=(
            Needs(
                ("generation_batch_size",),
                "aspo_unflipped_fraction x generation_batch_size > 0.5",
                lambda c: c.aspo_unflipped_fraction * c.generation_batch_size > 0.5,
                "round(fraction x the round's positive-advantage completions) are left unflipped, 0 in every round",
                only=SYNC,
            ),
            Needs(
                ("per_device_train_batch_size", "token_budget"),
                "aspo_unflipped_fraction x per_device_train_batch_size > 0.5 (or token_budget > 0)",
                lambda c: c.aspo_unflipped_fraction * c.per_device_train_batch_size > 0.5 or bool(c.token_budget),
                "round(fraction x a micro-batch's positive-advantage samples) are left unflipped, 0 in every "
                "micro-batch",
                only=ASYNC,
            ),
        ),
    )
    aspo_adaptive_kl_beta: float | None = ASPO_LOSS.field(
        None,
        help="Adaptive KL: while the mean token entropy of the last optimizer step is below "
        "`aspo_adaptive_kl_entropy_target`, the KL coefficient is raised from `beta` to this value (the "
        "reference raises 0.05 to 0.1). None = off. Needs beta > 0 (so a reference model is loaded) and must be "
        ">= beta.",
        bound=Bound(0, 100, low_open=True),
        depends=Needs(
            ("beta",),
            "beta > 0",
            lambda c: c.beta > 0,
            "it raises the KL coefficient from beta, and beta=0 loads no reference model",
            only=SYNC,
        ),
        checks=Check(
            lambda c: c.aspo_adaptive_kl_beta is None or c.aspo_adaptive_kl_beta >= c.beta,
            lambda c: f"must be >= beta={c.beta}",
            only=SYNC,
        ),
        unsupported={ASYNC: _NO_KL_TERM},
    )
    aspo_adaptive_kl_entropy_target: float = ASPO_LOSS.field(
        0.3,
        help="Mean token entropy (nats) under which the adaptive KL coefficient applies. Must be > 0.",
        bound=Bound(0, 100, low_open=True),
        depends=Needs(
            ("aspo_adaptive_kl_beta",),
            "aspo_adaptive_kl_beta set",
            lambda c: c.aspo_adaptive_kl_beta is not None,
            "it is the entropy under which aspo_adaptive_kl_beta applies",
        ),
        unsupported={ASYNC: _NO_KL_TERM},
    )

    # --- Recipe options of the ASPO reference (Archer2.0) ---------------------------------------------------------
    kl_clamp: float | None = RECIPE.field(
        None,
        help="Clamp TRL's per-token k3 KL estimate to [-kl_clamp, kl_clamp], as verl's `low_var_kl` that the "
        "ASPO reference runs (clamp 10; its log-ratio is clamped to [-20, 20] first, for a finite exponential). "
        "None = TRL's unclamped k3. Needs a loss trl-aspo computes (a registered loss_type, e.g. 'aspo') and beta > "
        "0 (TRL's own losses compute the KL inline in GRPOTrainer._compute_loss, which this option does not "
        "replace).",
        bound=Bound(0, 1000, low_open=True),
        depends=(
            Needs(
                REGISTERED_LOSS_ON.switches,
                REGISTERED_LOSS_ON.needs,
                _registered_loss,
                "TRL's own losses compute the KL inline in GRPOTrainer._compute_loss (one 250-line method, which "
                "trl-aspo replaces only for the losses it computes)",
                only=SYNC,
            ),
            Needs(("beta",), "beta > 0", lambda c: c.beta > 0, "with beta=0 there is no KL term", only=SYNC),
        ),
        unsupported={ASYNC: _NO_KL_TERM},
    )
    filter_zero_variance_groups: bool = RECIPE.field(
        False,
        help="Group estimator only: drop from the loss every group whose rewards are all equal (all solved "
        "or all failed; the reference's rejection sampling), so they no longer count in the token mean or the KL "
        "term. Logged as `filter/zero_variance_dropped_share` (the share of completions dropped).",
        depends=GROUP_ESTIMATOR_ON,
    )
    overlong_buffer_length: int | None = RECIPE.field(
        None,
        help="Soft overlong penalty (DAPO, arXiv 2503.14476; the reference's overlong buffer): adds TRL's "
        "`get_soft_overlong_punishment(max_completion_length, overlong_buffer_length)` as a reward function, "
        "0 up to max_completion_length - buffer tokens, then falling linearly to -1 at max_completion_length. "
        "None = off. Must lie in [1, max_completion_length].",
        bound=Bound(1, 10**9),
        checks=Check(
            lambda c: c.overlong_buffer_length is None or c.overlong_buffer_length <= (c.max_completion_length or 0),
            lambda c: f"must be None or an integer in [1, max_completion_length={c.max_completion_length}]",
        ),
        independent="switches the overlong penalty on",
        unsupported={ASYNC: f"{_NOT_YET}; add TRL's soft overlong punishment to reward_funcs instead"},
    )
    overlong_penalty_factor: float = RECIPE.field(
        1.0,
        help="Weight of the overlong penalty in the total reward (the reference's `penalty_factor`). Must be > 0.",
        bound=Bound(0, 1000, low_open=True),
        depends=Needs(
            ("overlong_buffer_length",),
            "overlong_buffer_length set",
            lambda c: c.overlong_buffer_length is not None,
            "it weights the overlong penalty, which overlong_buffer_length switches on",
        ),
        unsupported={ASYNC: _NOT_YET},
    )

    # --- Tool-position advantage shaping ------------------------------------------------------------------------
    tool_shaping: bool = TOOL_SHAPING.field(
        False,
        help="Add a clipped bonus to the advantage of correct completions that call their tool earlier than "
        "their peers (same prompt group; the whole batch with one completion per prompt). Applied last, after "
        "baseline and normalization.",
        independent="switches tool-position shaping on",
    )
    tool_shaping_delta: float = TOOL_SHAPING.field(
        -2.0,
        help="Shaping scale delta: bias = delta * (position - mean position) / mean length. Negative means "
        "earlier calls are better (paper default -2.0; aggressive -2.5). Must be non-zero.",
        bound=Bound(-100, 100),
        depends=TOOL_SHAPING_ON,
        checks=Check(lambda c: c.tool_shaping_delta != 0, "must be != 0"),
    )
    tool_shaping_k: float = TOOL_SHAPING.field(
        0.7,
        help="The bias is clipped to +-k*|advantage|, so shaping never flips the sign of a correct "
        "completion's advantage when k < 1 (paper default 0.7; aggressive 0.9). Must be >= 0.",
        bound=Bound(0, 100),
        depends=TOOL_SHAPING_ON,
    )
    tool_shaping_correct_threshold: float = TOOL_SHAPING.field(
        0.5,
        help="A completion counts as correct when its reward is at least this value (reward >= threshold, the "
        "same comparison as `trl-aspo evaluate --success_threshold`): the weighted total reward, or the reward "
        "of `tool_shaping_correct_reward` if that is set.",
        bound=Bound(-1e9, 1e9),
        depends=TOOL_SHAPING_ON,
    )
    tool_shaping_correct_reward: str | None = TOOL_SHAPING.field(
        None,
        help="Name of the reward function (as in the logged `rewards/<name>` metrics) whose value decides "
        "correctness. None = the weighted total reward.",
        depends=TOOL_SHAPING_ON,
    )
    tool_call_opener: str = TOOL_SHAPING.field(
        "<tool_call>",
        help="Text that opens a tool call in the chat template (Qwen-style `<tool_call>`); its token ids mark "
        "the first call with TRL's native `tools=` / `environment_factory=`.",
        depends=Needs(
            ("tool_call_pattern",),
            "tool_call_pattern=None",
            lambda c: c.tool_call_pattern is None,
            "tool_call_pattern replaces it in training (`trl-aspo evaluate` still reads it)",
            refuse=False,
        ),
        checks=Check(lambda c: bool(c.tool_call_opener), "must be a non-empty string"),
    )
    tool_call_pattern: str | None = TOOL_SHAPING.field(
        None,
        help="Regular expression marking a tool call in the decoded completion, for tools embedded in text "
        "(for example '```python' blocks run by a custom rollout). When set, it replaces `tool_call_opener`.",
        checks=_valid_tool_call_pattern,
        independent="marks tool calls for the tool metrics as well as for shaping",
    )
    tool_shaping_interactive_bonus: float = TOOL_SHAPING.field(
        0.0,
        help="Optional extra bonus added to the advantage of completions with positive advantage: this value "
        "per interactive turn (a tool call preceded by model text), counting at most 3 turns. 0 = off. Must be "
        ">= 0.",
        bound=Bound(0, 100),
        depends=TOOL_SHAPING_ON,
    )
    tool_shaping_penalty: str | None = TOOL_SHAPING.field(
        None,
        help="Optional dotted path to a callable penalizing inappropriate tool use: called with the "
        "completion texts and tool statistics, returns one penalty per completion, subtracted from the "
        "advantage. None = off.",
        depends=TOOL_SHAPING_ON,
    )

    # --- Single-stream value tracking ---------------------------------------------------------------------------
    advantage_estimator: str = SINGLE_STREAM.field(
        "group",
        help="Baseline of the advantage, a name registered with trl_aspo.algorithms.register_advantage_estimator: "
        "'group' = TRL's mean over the completions of the same prompt; 'spo' = a persistent per-prompt Beta value "
        "tracker with per-visit forgetting; 'spo++' = the tracker with evidence aged by policy events. "
        "'spo'/'spo++' allow num_generations=1.",
        choices=lambda trainer: registered_advantage_estimators(),
        # GRPOConfig's own num_generations >= 2 check is bypassed for the estimators that allow one completion per
        # prompt (ASPOConfig's `__post_init__`), so both checks of num_generations are the estimator's.
        checks=(
            Check(_positive_generations, "must be a positive integer", name="num_generations", alone=True),
            Check(
                lambda c: (
                    _estimator(c).allows_single_completion or c.num_generations is None or c.num_generations >= 2
                ),
                lambda c: (
                    f"advantage_estimator={c.advantage_estimator!r} needs at least 2 completions per prompt; "
                    "num_generations=1 requires an estimator that allows it (the value trackers 'spo', 'spo++')"
                ),
                name="num_generations",
            ),
        ),
        resume=True,
        independent="the baseline switch",
    )
    advantage_normalization: str | None = SINGLE_STREAM.field(
        None,
        help="How advantages are scaled after the baseline: 'group' = TRL's `scale_rewards` behaviour (only "
        "with the 'group' estimator, which TRL computes itself); 'batch' = (A - mean) / std over the generation "
        "batch; 'token' = the same under the action-token measure (each completion weighted by its action-token "
        "count, SPO++). None = the estimator's default: 'group' for the group estimator, 'batch' for spo, 'token' "
        "for spo++, as registered for any other.",
        choices=ADVANTAGE_NORMALIZATIONS,
        derived=_derived_normalization,
        checks=(
            Check(
                lambda c: c.advantage_normalization != "group" or _estimator(c).computed_by_trl,
                lambda c: (
                    "'group' is TRL's own scaling of the group-mean baseline it computes (advantage_estimator="
                    f"'group'); with advantage_estimator={c.advantage_estimator!r} use 'batch' or 'token'"
                ),
            ),
            # How the TRL base config combines several reward functions, against the scaling.
            Check(
                _group_scaling_for_normalize_then_sum,
                lambda c: (
                    "'normalize_then_sum' is TRL's group scaling; advantage_normalization="
                    f"{c.advantage_normalization!r} rescales the summed reward instead, so use "
                    "'sum_then_normalize' or advantage_normalization='group'"
                ),
                name="multi_objective_aggregation",
                only=SYNC,
            ),
            Check(
                lambda c: not (_tracks_values(c) and c.multi_objective_aggregation != "sum_then_normalize"),
                "the value tracker learns the weighted total reward, so it must be 'sum_then_normalize'",
                name="multi_objective_aggregation",
                only=SYNC,
            ),
            # AsyncGRPOTrainer sums the reward functions (weight 1 each); the trainer scores that sum itself.
            Check(
                lambda c: not (c.scores_on_trainer and c.token_budget != 0),
                "trainer-side scoring normalizes over the samples of one optimizer step, which needs TRL's "
                "fixed-count batches: set token_budget=0",
                name="token_budget",
                only=ASYNC,
            ),
        ),
        resume=True,
        independent="every normalization applies to every estimator ('group' is checked as a value)",
    )
    value_rho: float = SINGLE_STREAM.field(
        0.875,
        help="Forgetting factor of the value tracker (constant mode and spo++). Must lie in (0, 1].",
        bound=Bound(0, 1, low_open=True),
        depends=(
            TRACKER_ON,
            Needs(
                ("value_rho_mode",),
                "value_rho_mode='constant'",
                lambda c: c.value_rho_mode == "constant",
                "value_rho_mode='kl' sets rho per visit from the policy drift",
            ),
        ),
        resume=True,
    )
    value_rho_mode: str = SINGLE_STREAM.field(
        "constant",
        help="spo only: 'constant' uses `value_rho` and costs nothing; 'kl' sets rho per visit from the policy "
        "drift D since the prompt's previous visit (its stored completion's log-probs then and now; D = 0 on a "
        "first visit), rho = clip(2^(-D / value_kl_half), value_rho_min, value_rho_max), as the SPO reference. "
        "Costs one extra log-prob pass per round and, per visited prompt, its last completion and log-probs in "
        "CPU memory and checkpoints.",
        choices=VALUE_RHO_MODES,
        depends=PER_VISIT_FORGETTING_ON,
        resume=True,
        unsupported={
            ASYNC: "'kl' needs a log-prob pass on stored completions, which the asynchronous trainer does not run"
        },
    )
    value_kl_half: float = SINGLE_STREAM.field(
        0.06,
        help="KL-adaptive rho: mean |log-prob change| at which the evidence halves. Must be > 0.",
        bound=Bound(0, 100, low_open=True),
        depends=(TRACKER_ON, KL_RHO_ON),
    )
    value_rho_min: float = SINGLE_STREAM.field(
        0.875,
        help="KL-adaptive rho: lower bound. Must lie in (0, value_rho_max].",
        bound=Bound(0, 1, low_open=True),
        depends=(TRACKER_ON, KL_RHO_ON),
        checks=Check(lambda c: c.value_rho_min <= c.value_rho_max, "must lie in (0, value_rho_max]"),
    )
    value_rho_max: float = SINGLE_STREAM.field(
        0.96,
        help="KL-adaptive rho: upper bound. Must be <= 1.",
        bound=Bound(0, 1, low_open=True),
        depends=(TRACKER_ON, KL_RHO_ON),
    )
    value_prior_strength: float | None = SINGLE_STREAM.field(
        None,
        help="Pseudo-count N0 of the tracker's initialization from counts: a prompt with s successes in n0 "
        "samples starts at Beta(N0 (s+0.5)/(n0+1), N0 (n0-s+0.5)/(n0+1)). None = follow rho: "
        "1/(1-value_rho_min) with value_rho_mode='kl', else 1/(1-value_rho) (8 at 0.875). Must be > 0; must be "
        "set when that rho is 1 and the tracker is initialized.",
        bound=Bound(0, 1e9, low_open=True),
        depends=(
            TRACKER_ON,
            Needs(
                ("value_init_samples", "value_init_file"),
                "value_init_samples > 0 or value_init_file set",
                _tracker_initialized,
                "it is the pseudo-count of the tracker's initialization from counts",
            ),
        ),
        derived=_derived_prior_strength,  # None where that rho is 1
        checks=Check(
            lambda c: c.value_prior_strength is not None or not _tracker_initialized(c),
            lambda c: f"the default 1/(1-rho) is infinite at rho={_prior_rho(c)}; set a positive value",
        ),
    )
    value_init_samples: int = SINGLE_STREAM.field(
        0,
        help="Completions per prompt drawn with the starting policy before training to initialize the "
        "tracker (0 = no pre-pass: unseen prompts start at Beta(0.5, 0.5)). Must be >= 0.",
        bound=Bound(0, 10**6),
        depends=TRACKER_INITIALIZATION,
    )
    value_init_file: str | None = SINGLE_STREAM.field(
        None,
        help="JSON file of initial counts: a list of {'prompt_id' or 'prompt': ..., 'successes': s, "
        "'trials': n} records (JSON Lines when the name ends in .jsonl); a record with 'alpha' and 'beta' "
        "instead sets the prompt's pseudo-counts exactly, as `trl-aspo values` exports them. Used instead of the "
        "pre-pass.",
        depends=TRACKER_INITIALIZATION,
        checks=Check(
            lambda c: not (c.value_init_samples > 0 and c.value_init_file is not None),
            "give either value_init_file or value_init_samples > 0, not both",
        ),
    )
    value_reward_range: list[float] | None = SINGLE_STREAM.field(
        None,
        help="The tracker needs rewards in [0, 1]. For rewards in another known range [lo, hi], give "
        "`[lo, hi]` and they are mapped linearly to [0, 1] for the tracker. None = rewards outside [0, 1] are "
        "an error.",
        bound=Bound(-1e9, 1e9),
        depends=TRACKER_ON,
        checks=Check(
            lambda c: (
                c.value_reward_range is None
                or (len(c.value_reward_range) == 2 and c.value_reward_range[0] < c.value_reward_range[1])
            ),
            "must be two finite numbers [lo, hi] with lo < hi",
        ),
        resume=True,
    )
    prompt_id_column: str | None = SINGLE_STREAM.field(
        None,
        help="Dataset column that identifies a prompt for the value tracker. None = a stable content hash of "
        "the prompt (identical across processes and restarts).",
        depends=TRACKER_ON,
        resume=True,
    )
    value_reset_on_resume: bool = SINGLE_STREAM.field(
        False,
        help="Resume a checkpoint without its value tracker on purpose: the tracker starts fresh (Beta(0.5, "
        "0.5), or value_init_file) when the checkpoint holds no trl-aspo state, no tracker for this "
        "advantage_estimator, or was keyed by another prompt_id_column. False = such a resume is refused.",
        independent="also lets a run resume a tracker checkpoint under the group estimator",
    )

    # --- Prioritized sampling -----------------------------------------------------------------------------------
    prioritized_sampling: bool = PRIORITIZED.field(
        False,
        help="Draw each round's prompts without replacement with weight sqrt(v (1 - v)) + priority_epsilon "
        "from the tracker's values (spo/spo++ only). Each round is drawn when it is dispatched, after the "
        "tracker has taken in every earlier round (with value_rho_mode='kl' too), so priorities act on the next "
        "round whatever the data loader prefetches; a resumed run draws what the uninterrupted one drew. "
        "AsyncASPOTrainer: the rollout worker draws each prompt group (with replacement) from weights the "
        "trainer updates in shared memory after every optimizer step.",
        depends=_needs_tracker("priorities come from the value tracker"),
        resume=True,
    )
    priority_epsilon: float = PRIORITIZED.field(
        0.05,
        help="Floor added to every prompt's sampling weight, so no prompt starves. Must be > 0.",
        bound=Bound(0, 100, low_open=True),
        depends=Needs(
            ("prioritized_sampling",),
            "prioritized_sampling=True",
            lambda c: c.prioritized_sampling,
            "it is the floor of the prioritized sampling weights",
        ),
    )

    # --- Optimization -------------------------------------------------------------------------------------------
    lr_schedule_per_generation: bool = OPTIMIZATION.field(
        False,
        help="Step the learning-rate schedule once per generation round, as verl steps its scheduler once per "
        "rollout: every optimizer step of a round uses the schedule's value at the round's first optimizer "
        "step (warmup_steps and the schedule's length still count optimizer steps). Needs a round to span whole "
        "optimizer steps (steps_per_generation x num_iterations divisible by gradient_accumulation_steps) and a "
        "lambda schedule (not reduce_lr_on_plateau).",
        depends=(
            Needs(
                ("steps_per_generation", "num_iterations", "gradient_accumulation_steps"),
                "steps_per_generation x num_iterations divisible by gradient_accumulation_steps",
                lambda c: c.optimizer_steps_per_generation().is_integer(),
                "a generation round must span whole optimizer steps",
                only=SYNC,
            ),
            Needs(
                ("lr_scheduler_type",),
                "a lambda schedule other than 'constant'",
                lambda c: _lr_schedule_type(c) not in ("constant", "reduce_lr_on_plateau"),
                "a constant rate is the same per round, and reduce_lr_on_plateau steps on a metric",
                only=SYNC,
            ),
        ),
        unsupported={ASYNC: "the asynchronous trainer generates continuously: no rounds to step a schedule by"},
    )

    skip_nonfinite_grad_steps: bool = OPTIMIZATION.field(
        False,
        help="A step whose loss (any micro-batch, any rank) or global gradient norm is not finite never reaches the "
        "weights. False: the run stops before optimizer.step(), with weights and optimizer state untouched and a "
        "message naming the step, the raw loss values and where the value appeared (the batch, the policy loss "
        "or KL term, or the first parameter with a non-finite gradient). True: the step is skipped, as the ASPO "
        "reference (verl) does: weights and optimizer moments stay as they were, the learning-rate schedule still "
        "advances, `optim/nonfinite_loss_steps` counts the skipped steps and `optim/skipped_nonfinite_step` logs "
        "their share. Every rank decides alike. Under DeepSpeed, which steps inside the backward pass, the loss is "
        "checked before it (a non-finite gradient is not caught there) and True is refused.",
        independent="acts on every optimizer step of either trainer, whatever else is set",
    )

    # --- Stopping on a signal -------------------------------------------------------------------------------------
    stop_signals: list[str] | None = STOPPING.field(
        None,
        help="Signals that stop the run gracefully: each process finishes its optimizer step, every rank agrees on "
        "the stop at the next stop_at boundary, a checkpoint is saved there and the run exits with status 75 "
        "after printing the command that resumes it. Names without 'SIG' among "
        f"{', '.join(STOP_SIGNAL_NAMES)}. None = TERM, USR1, INT; [] = none (a signal then acts "
        "as without trl-aspo). Only a SIGINT at least 1 s after the first signal stops at once (exit 130); "
        "repeated signals are ignored.",
        checks=(
            Check(_known_stop_signals, f"each entry must be one of {STOP_SIGNAL_NAMES}", alone=True),
            Check(
                lambda c: not (c.enable_jit_checkpoint and c.stop_signals),
                "transformers' enable_jit_checkpoint=True installs its own SIGTERM handler; one handler only: set "
                "enable_jit_checkpoint=False (the stop_signals checkpoint holds what a save_steps one does) or "
                "stop_signals=[] to keep transformers'",
                alone=True,
            ),
        ),
        independent="acts only when a stop signal arrives, in either trainer",
    )
    stop_at: str = STOPPING.field(
        "round",
        help="Where a signalled run stops: 'round' = the first optimizer step that ends a generation round "
        "(steps_per_generation x num_iterations micro-batches; the asynchronous trainer: a rollout batch, "
        "steps_per_rollout_batch steps), whose checkpoint resumes exactly as the uninterrupted run continues; "
        "'step' = the end of the current optimizer step, whose checkpoint resumes as a mid-round one does (TRL "
        "starts a fresh round there, so the runs part).",
        choices=("round", "step"),
        independent="acts only when a stop signal arrives",
    )
    stop_grace_s: float = STOPPING.field(
        300.0,
        help="Seconds a signalled run may take to reach its stop boundary, save and exit; past them it exits "
        "without a new checkpoint (status 75), naming the latest complete one (`trl-aspo train`'s launcher kills "
        "processes still running then). Must lie in (0, 86400].",
        bound=Bound(0, 86400, low_open=True),
        independent="acts only when a stop signal arrives",
    )

    # --- Logging ------------------------------------------------------------------------------------------------
    log_weight_map: bool = LOGGING.field(
        False,
        help="Log the ASPO weight map (arXiv 2510.06062): per advantage sign, the sum of each action token's "
        "gradient weight w (the coefficient of -A * grad(log pi)) and the token count in a 10 x 10 grid of "
        "(old probability, current probability) bins, summed over each logging window and all ranks and "
        "written to weight_map.json in output_dir (and every checkpoint); `trl-aspo plot --weights` draws it. "
        "ASPOTrainer collects it on off-policy passes only (TRL passes behaviour log-probs only then) and needs "
        "loss_type 'aspo' or a clipped-ratio loss (grpo, bnpo, dr_grpo, dapo, luspo) and "
        "importance_sampling_level='token'; AsyncASPOTrainer collects every trained token (old = the "
        "generator's log-probs), with either of its loss types.",
        depends=(
            Needs(
                ("loss_type",),
                f"loss_type in {CLIPPED_RATIO_LOSSES} or a registered loss with a weight "
                f"(registered: {', '.join(repr(name) for name in registered_policy_losses())})",
                _weight_map_loss,
                "the map needs each token's gradient weight, which trl_aspo.algorithms.weight_map gives for these "
                "losses",
                only=SYNC,
            ),
            Needs(
                ("importance_sampling_level",),
                "importance_sampling_level='token'",
                lambda c: c.importance_sampling_level == "token",
                "a sequence-level ratio weighs every token of a completion alike",
                only=SYNC,
            ),
            Needs(
                ("num_iterations", "steps_per_generation", "gradient_accumulation_steps"),
                "gradient_accumulation_steps not a multiple of steps_per_generation x num_iterations (or vLLM "
                "with its IS correction)",
                lambda c: (
                    c.gradient_accumulation_steps % (c.steps_per_generation * c.num_iterations) != 0
                    or (c.use_vllm and c.vllm_importance_sampling_correction)
                ),
                "the map is collected on off-policy passes, and every pass is on-policy (ratio 1, weight 1)",
                refuse=False,
                only=SYNC,
            ),
        ),
        independent={
            ASYNC: "every trained token carries the generator's log-probs, and both loss types have a weight "
            "(trl_aspo.algorithms.weight_map)"
        },
    )
    log_timing: bool = LOGGING.field(
        True,
        help="Log, per optimizer step, the seconds of trl-aspo's own work, as verl logs timing_s/*: "
        "timing/advantages_s (value tracker, estimator, normalization, tool shaping), timing/policy_loss_s (the "
        "registered loss's forward beyond TRL's model forward, summed over micro-batches; forward only, its "
        "backward is TRL's), timing/offpolicy_correction_s (the off-policy mask and IS correction, the "
        "asynchronous decoupled objective), the step's wall time timing/step_s, and timing/value_prepass_s once. "
        "On CUDA by CUDA events read at the end of the optimizer step (no added synchronization), elsewhere by "
        "time.perf_counter; `trl-aspo train`'s training_curves.png and `trl-aspo plot` draw them as a share of the "
        "step. False logs none of them (the "
        "overhead benchmark, scripts/bench_step.py, compares both).",
        independent="acts on every optimizer step of either trainer, whatever else is set",
    )

    def _validate_aspo_fields(self) -> None:
        """Every declared field's type, trainer support, bound, choices and checks (trl_aspo.config.fields); and
        `dataloader_pin_memory` off where no accelerator exists, since torch's data loader warns on every run that
        pinned memory is unused there (the default stays True wherever pinning can act)."""
        check_values(self, declared_field_types(type(self)))
        if self.dataloader_pin_memory and (self.use_cpu or not torch.accelerator.is_available()):
            self.dataloader_pin_memory = False

    def field_dependencies(self) -> tuple[Dependency, ...]:
        """Every dependency this config checks, field by field: each field's section rule (loss_type='aspo' for the
        `aspo_` fields), then the field's own, for every trainer or this config's only."""
        return config_dependencies(type(self), self._trainer)


# ------------------------------------------------------------------------------ views of the declarations
# The allowed range of every numeric field trl-aspo adds (a list field: of each element). Generous beyond every value
# the papers use; tests/unit/test_config_dependencies.py checks that no numeric field is missing.
FIELD_BOUNDS = field_bounds(ASPOFieldsMixin)

# Options that act only together with another switch, for both configs, as their fields declare them (the section's
# loss_type='aspo' of every `aspo_` field, and the rules of one trainer only, are added by `field_dependencies`).
# A field with none declares why in `independent`: tests/unit/test_config_dependencies.py fails on a field with
# neither.
FIELD_DEPENDENCIES = shared_dependencies(ASPOFieldsMixin)

# Fields whose default None is replaced in `__post_init__` and that depend on a switch: the derived value counts as
# the default.
DERIVED_DEFAULTS = derived_defaults(ASPOFieldsMixin)

# Fields that act on their own (switches, or options whose every value means something whatever else is set).
# loss_type is no field of ASPOFieldsMixin: ASPOConfig's is TRL's, AsyncASPOConfig's is the switch it adds.
INDEPENDENT_FIELDS = independent_fields(ASPOFieldsMixin)

# The settings a resumed run compares with its checkpoint's (trl_aspo.trainers.project_state): the fields declared
# with resume=True, and TrainingArguments' seed (the saved random states and sampler order come from it).
RESUME_FIELDS = (*resume_fields(ASPOFieldsMixin), "seed")

# The section of each field trl-aspo adds (its group in `trl-aspo train --help`).
FIELD_SECTIONS = field_sections(ASPOFieldsMixin)


@dataclass
class ASPOConfig(ASPOFieldsMixin, GRPOConfig):
    r"""
    Configuration for [`ASPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the fields below (listed from their
    declarations in `ASPOFieldsMixin`, by section).
    """

    _trainer = SYNC

    _default_loss_type = "dapo"

    def __post_init__(self):
        self._validate_aspo_fields()
        single_stream = _estimator(self).allows_single_completion and self.num_generations == 1
        if single_stream:
            # GRPOConfig refuses num_generations < 2 because its group baseline needs two samples; the tracker
            # does not. A 1 that passes that one comparison keeps every divisibility check exact.
            self.num_generations = _SingleCompletion(1)
        try:
            super().__post_init__()
        finally:
            if single_stream:
                self.num_generations = 1
                self.num_generations_eval = self.num_generations_eval or 1
        check_dependencies(self)
        _on_policy_warning(self)

    def optimizer_steps_per_generation(self) -> float:
        """Optimizer steps one generation round feeds: steps_per_generation x num_iterations micro-batches, a step
        every gradient_accumulation_steps of them."""
        return self.steps_per_generation * self.num_iterations / self.gradient_accumulation_steps


ASPOConfig.__doc__ += fields_docstring(ASPOConfig)
