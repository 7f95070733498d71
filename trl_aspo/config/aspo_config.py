"""`ASPOConfig`: TRL's `GRPOConfig` plus the switches of the three methods trl-aspo adds.

Every field has a help text (shown by `trl-aspo train --help` and in the README's configuration reference) and is
validated in `__post_init__`; an invalid value raises a `ValueError` that names the field and what is allowed.
With every new switch at its default, the configuration means exactly what the same `GRPOConfig` means.
"""

from __future__ import annotations

import math
import types as types_module
import typing
import warnings
from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from trl_aspo.algorithms.weight_map import WEIGHT_MAP_LOSS_TYPES
from trl_aspo.values.tracker import default_prior_strength

ADVANTAGE_ESTIMATORS = ("group", "spo", "spo++")
ADVANTAGE_NORMALIZATIONS = ("group", "batch", "token")
ASPO_AGGREGATIONS = ("token", "sequence")
VALUE_RHO_MODES = ("constant", "kl")
SINGLE_STREAM_ESTIMATORS = ("spo", "spo++")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# Annotation -> (accepts the value, what is allowed): the type checks of every field ASPOConfig adds.
_TYPE_CHECKS = {
    "bool": (lambda value: isinstance(value, bool), "true or false"),
    "int": (lambda value: isinstance(value, int) and not isinstance(value, bool), "an integer"),
    "float": (_is_number, "a finite number"),
    "str": (lambda value: isinstance(value, str), "a string"),
    "list[float]": (
        lambda value: isinstance(value, list | tuple) and all(_is_number(item) for item in value),
        "a list of finite numbers",
    ),
}


def _type_name(hint) -> str:
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is list:
        return f"list[{', '.join(_type_name(arg) for arg in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def aspo_field_types() -> dict[str, list[str]]:
    """For each field trl-aspo adds (the fields of `ASPOFieldsMixin`, shared by `ASPOConfig` and `AsyncASPOConfig`),
    the names of the types its annotation allows ('float', 'None', 'list[float]', ...), read with
    `typing.get_type_hints` (dataclass annotations are strings here, and `HfArgumentParser` rewrites `Field.type`)."""
    hints = typing.get_type_hints(ASPOFieldsMixin)
    types = {}
    for config_field in fields(ASPOFieldsMixin):
        hint = hints[config_field.name]
        union = typing.get_origin(hint) in (typing.Union, types_module.UnionType)
        types[config_field.name] = [_type_name(arg) for arg in (typing.get_args(hint) if union else (hint,))]
    return types


@dataclass(frozen=True)
class Bound:
    """The range a numeric field accepts: [low, high], with either end open. Every number a config accepts is bounded,
    so no combination of accepted values overflows float32 in the advantage or the loss (1e308 is finite, but a bonus
    of 1e308 makes every advantage it touches infinite and the weights NaN after one step)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


# The allowed range of every numeric field trl-aspo adds (a list field: of each element). Generous beyond every value
# the papers use; tests/test_config.py checks that no numeric field is missing.
FIELD_BOUNDS = {
    "aspo_dual_clip": Bound(1, 100, low_open=True),
    "aspo_dual_clip_pos": Bound(1, 100, low_open=True),
    "aspo_dual_clip_neg": Bound(1, 100, low_open=True),
    "aspo_entropy_quantile": Bound(0, 1, low_open=True, high_open=True),
    "aspo_epsilon_high_entropy": Bound(0, 10, low_open=True),
    "aspo_flip_threshold_start": Bound(0, 100),
    "aspo_flip_decay_steps": Bound(0, 10**9),
    "aspo_unflipped_fraction": Bound(0, 1),
    "aspo_adaptive_kl_beta": Bound(0, 100, low_open=True),
    "aspo_adaptive_kl_entropy_target": Bound(0, 100, low_open=True),
    "kl_clamp": Bound(0, 1000, low_open=True),
    "overlong_buffer_length": Bound(1, 10**9),
    "overlong_penalty_factor": Bound(0, 1000, low_open=True),
    "tool_shaping_delta": Bound(-100, 100),
    "tool_shaping_k": Bound(0, 100),
    "tool_shaping_correct_threshold": Bound(-1e9, 1e9),
    "tool_shaping_interactive_bonus": Bound(0, 100),
    "value_rho": Bound(0, 1, low_open=True),
    "value_kl_half": Bound(0, 100, low_open=True),
    "value_rho_min": Bound(0, 1, low_open=True),
    "value_rho_max": Bound(0, 1, low_open=True),
    "value_prior_strength": Bound(0, 1e9, low_open=True),
    "value_init_samples": Bound(0, 10**6),
    "value_reward_range": Bound(-1e9, 1e9),
    "priority_epsilon": Bound(0, 100, low_open=True),
}


@dataclass(frozen=True)
class Dependency:
    """`option`, set away from its default, acts only while `holds(config)`; otherwise it is refused with a
    `ValueError` (it would do nothing or be wrong) or, where the combination can be intentional, warned about. Both
    messages name `option` and the `switches` the condition reads, with their values."""

    option: str
    switches: tuple[str, ...]
    needs: str
    holds: typing.Callable[[typing.Any], bool]
    why: str
    refuse: bool = True


def _single_stream(config) -> bool:
    return config.advantage_estimator in SINGLE_STREAM_ESTIMATORS


def _tracker_initialized(config) -> bool:
    return config.value_init_samples > 0 or config.value_init_file is not None


def _derived_prior_strength(config) -> float | None:
    rho = config.value_rho_min if config.value_rho_mode == "kl" else config.value_rho
    return default_prior_strength(rho) if rho < 1 else None


def _needs_tool_shaping(name: str) -> Dependency:
    return Dependency(
        name, ("tool_shaping",), "tool_shaping=True", lambda c: c.tool_shaping, "it only acts in tool-position shaping"
    )


def _needs_tracker(name: str, why: str = "it configures the value tracker") -> Dependency:
    return Dependency(name, ("advantage_estimator",), "advantage_estimator='spo' or 'spo++'", _single_stream, why)


def _needs_kl_rho(name: str) -> Dependency:
    return Dependency(
        name,
        ("value_rho_mode",),
        "value_rho_mode='kl'",
        lambda c: c.value_rho_mode == "kl",
        "it shapes the KL-adaptive rho, and constant mode uses value_rho",
    )


# Options that act only together with another switch, for both configs (each config adds its own in
# `_config_dependencies`; every field starting with `aspo_` also needs loss_type='aspo', see `field_dependencies`).
# A field not listed here is declared in INDEPENDENT_FIELDS: tests/test_config.py fails on a field in neither.
FIELD_DEPENDENCIES = (
    Dependency(
        "aspo_dual_clip",
        ("aspo_dual_clip_pos", "aspo_dual_clip_neg"),
        "aspo_dual_clip_pos or aspo_dual_clip_neg left at None",
        lambda c: c.aspo_dual_clip_pos is None or c.aspo_dual_clip_neg is None,
        "it is the fallback of both sign-specific constants, and both are set",
    ),
    Dependency(
        "aspo_epsilon_high_entropy",
        ("aspo_entropy_quantile",),
        "aspo_entropy_quantile set",
        lambda c: c.aspo_entropy_quantile is not None,
        "it is the offset of the high-entropy tokens that aspo_entropy_quantile selects",
    ),
    Dependency(
        "aspo_flip_threshold_start",
        ("aspo_flip_decay_steps",),
        "aspo_flip_decay_steps > 0",
        lambda c: c.aspo_flip_decay_steps > 0,
        "with aspo_flip_decay_steps=0 the threshold is 0 at every step (every positive token flips from the start)",
    ),
    Dependency(
        "aspo_flip_decay_steps",
        ("aspo_flip_threshold_start",),
        "aspo_flip_threshold_start > 0",
        lambda c: c.aspo_flip_threshold_start > 0,
        "it decays the flip threshold from aspo_flip_threshold_start, which is 0",
    ),
    Dependency(
        "aspo_adaptive_kl_entropy_target",
        ("aspo_adaptive_kl_beta",),
        "aspo_adaptive_kl_beta set",
        lambda c: c.aspo_adaptive_kl_beta is not None,
        "it is the entropy under which aspo_adaptive_kl_beta applies",
    ),
    Dependency(
        "overlong_penalty_factor",
        ("overlong_buffer_length",),
        "overlong_buffer_length set",
        lambda c: c.overlong_buffer_length is not None,
        "it weights the overlong penalty, which overlong_buffer_length switches on",
    ),
    Dependency(
        "filter_zero_variance_groups",
        ("advantage_estimator",),
        "advantage_estimator='group'",
        lambda c: c.advantage_estimator == "group",
        "a group of one completion always has zero variance",
    ),
    *(
        _needs_tool_shaping(name)
        for name in (
            "tool_shaping_delta",
            "tool_shaping_k",
            "tool_shaping_correct_threshold",
            "tool_shaping_correct_reward",
            "tool_shaping_interactive_bonus",
            "tool_shaping_penalty",
        )
    ),
    Dependency(
        "tool_call_opener",
        ("tool_call_pattern",),
        "tool_call_pattern=None",
        lambda c: c.tool_call_pattern is None,
        "tool_call_pattern replaces it in training (`trl-aspo evaluate` still reads it)",
        refuse=False,
    ),
    *(
        _needs_tracker(name)
        for name in (
            "value_rho",
            "value_kl_half",
            "value_rho_min",
            "value_rho_max",
            "value_prior_strength",
            "value_reward_range",
            "prompt_id_column",
        )
    ),
    _needs_tracker("value_init_samples", "it initializes the value tracker"),
    _needs_tracker("value_init_file", "it initializes the value tracker"),
    _needs_tracker("prioritized_sampling", "priorities come from the value tracker"),
    Dependency(
        "value_rho_mode",
        ("advantage_estimator",),
        "advantage_estimator='spo'",
        lambda c: c.advantage_estimator == "spo",
        "'kl' applies to per-visit forgetting (spo++ ages evidence by policy events)",
    ),
    Dependency(
        "value_rho",
        ("value_rho_mode",),
        "value_rho_mode='constant'",
        lambda c: c.value_rho_mode == "constant",
        "value_rho_mode='kl' sets rho per visit from the policy drift",
    ),
    *(_needs_kl_rho(name) for name in ("value_kl_half", "value_rho_min", "value_rho_max")),
    Dependency(
        "value_prior_strength",
        ("value_init_samples", "value_init_file"),
        "value_init_samples > 0 or value_init_file set",
        _tracker_initialized,
        "it is the pseudo-count of the tracker's initialization from counts",
    ),
    Dependency(
        "priority_epsilon",
        ("prioritized_sampling",),
        "prioritized_sampling=True",
        lambda c: c.prioritized_sampling,
        "it is the floor of the prioritized sampling weights",
    ),
)

# Fields whose default None is replaced in `__post_init__`: the derived value counts as the default.
DERIVED_DEFAULTS = {"value_prior_strength": _derived_prior_strength}

# Fields that act on their own (switches, or options whose every value means something whatever else is set).
INDEPENDENT_FIELDS = {
    "loss_type": "AsyncASPOConfig's loss switch",
    "overlong_buffer_length": "switches the overlong penalty on",
    "tool_shaping": "switches tool-position shaping on",
    "tool_call_pattern": "marks tool calls for the tool metrics as well as for shaping",
    "advantage_estimator": "the baseline switch",
    "advantage_normalization": "every normalization applies to every estimator ('group' is checked as a value)",
    "value_reset_on_resume": "also lets a run resume a tracker checkpoint under the group estimator",
}


def _lr_schedule_type(config) -> str:
    return getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)


class _SingleCompletion(int):
    """The integer 1, except that it does not compare below 2 (used only during `GRPOConfig.__post_init__`)."""

    def __lt__(self, other):
        return False if other == 2 else int(self) < other


@dataclass
class ASPOFieldsMixin:
    """The fields trl-aspo adds and their validation, defined once for both trainers: [`ASPOConfig`] (on TRL's
    `GRPOConfig`) and [`AsyncASPOConfig`] (on TRL's experimental `AsyncGRPOConfig`).

    A config class lists in `_unsupported_fields` the fields its trainer cannot honour yet (name -> why); setting
    one away from its default is refused with a message naming it. `_validate_loss_coupling` and
    `_validate_reward_aggregation` check the couplings with fields of the TRL base config, which differ between
    the two.
    """

    _unsupported_fields = {}

    # --- Asymmetric IS loss -------------------------------------------------------------------------------------
    aspo_dual_clip: float = field(
        default=3.0,
        metadata={
            "help": "Soft dual-clip constant C (> 1) of the aspo loss: a positive-advantage token whose ratio falls "
            "below 1/C, or a negative-advantage token whose ratio rises above C, keeps a constant gradient weight C "
            "instead of an unbounded one."
        },
    )
    aspo_dual_clip_pos: float | None = field(
        default=None,
        metadata={
            "help": "Soft dual-clip constant for positive-advantage (flipped) tokens only, as the reference's "
            "`positive_clip_ratio_c`. None = `aspo_dual_clip`. Must be > 1."
        },
    )
    aspo_dual_clip_neg: float | None = field(
        default=None,
        metadata={
            "help": "Soft dual-clip constant for negative-advantage tokens only, as the reference's "
            "`negative_clip_ratio_c`. None = `aspo_dual_clip`. Must be > 1."
        },
    )
    aspo_aggregation: str = field(
        default="token",
        metadata={
            "help": "How the aspo loss turns per-token terms into one number per optimizer step, over all its "
            "micro-batches and ranks: 'token' = every action token weighs the same (the summed token losses divided "
            "by the step's action tokens; the synchronous trainer uses TRL's 'dapo' normalizer, the generation "
            "batch's action tokens per optimizer step, which is the step's own count when steps_per_generation = "
            "gradient_accumulation_steps), 'sequence' = every completion weighs the same (the sum of each "
            "completion's token mean divided by the step's completions, TRL's 'grpo').",
            "choices": list(ASPO_AGGREGATIONS),
        },
    )
    aspo_entropy_quantile: float | None = field(
        default=None,
        metadata={
            "help": "Entropy-split clipping: tokens whose entropy is above this quantile of their completion's token "
            "entropies use the wider offsets `aspo_epsilon_high_entropy`. None = off; the reference uses 0.8. "
            "Must lie in (0, 1)."
        },
    )
    aspo_epsilon_high_entropy: float = field(
        default=0.4,
        metadata={
            "help": "Hard-clip offset (both sides) for high-entropy tokens when `aspo_entropy_quantile` is set. "
            "Must be > 0."
        },
    )
    aspo_flip_threshold_start: float = field(
        default=0.0,
        metadata={
            "help": "Progressive flip: a positive-advantage token gets the flipped ratio only where its advantage "
            "exceeds a threshold that falls linearly from this value to 0 over `aspo_flip_decay_steps` steps; the "
            "others use the standard clipped ratio. 0 = flip every positive token from the start. Must be >= 0."
        },
    )
    aspo_flip_decay_steps: int = field(
        default=0,
        metadata={"help": "Optimizer steps over which the progressive-flip threshold decays to 0. Must be >= 0."},
    )
    aspo_unflipped_fraction: float = field(
        default=0.0,
        metadata={
            "help": "Share of positive-advantage completions (drawn among them each generation round) whose tokens "
            "keep the standard clipped ratio instead of the flip. Must lie in [0, 1]."
        },
    )
    aspo_adaptive_kl_beta: float | None = field(
        default=None,
        metadata={
            "help": "Adaptive KL: while the mean token entropy of the last optimizer step is below "
            "`aspo_adaptive_kl_entropy_target`, the KL coefficient is raised from `beta` to this value (the "
            "reference raises 0.05 to 0.1). None = off. Needs beta > 0 (so a reference model is loaded) and must be "
            ">= beta."
        },
    )
    aspo_adaptive_kl_entropy_target: float = field(
        default=0.3,
        metadata={"help": "Mean token entropy (nats) under which the adaptive KL coefficient applies. Must be > 0."},
    )
    kl_clamp: float | None = field(
        default=None,
        metadata={
            "help": "Clamp TRL's per-token k3 KL estimate to [-kl_clamp, kl_clamp], as verl's `low_var_kl` that the "
            "ASPO reference runs (clamp 10; its log-ratio is clamped to [-20, 20] first, for a finite exponential). "
            "None = TRL's unclamped k3. Needs loss_type='aspo' and beta > 0 (TRL's own losses compute the KL inline "
            "in GRPOTrainer._compute_loss, which this option does not replace)."
        },
    )
    log_weight_map: bool = field(
        default=False,
        metadata={
            "help": "Log the ASPO weight map (arXiv 2510.06062): per advantage sign, the sum of each action token's "
            "gradient weight w (the coefficient of -A * grad(log pi)) and the token count in a 10 x 10 grid of "
            "(old probability, current probability) bins, summed over each logging window and all ranks and "
            "written to weight_map.json in output_dir (and every checkpoint); `trl-aspo plot --weights` draws it. "
            "ASPOTrainer collects it on off-policy passes only (TRL passes behaviour log-probs only then) and needs "
            "loss_type 'aspo' or a clipped-ratio loss (grpo, bnpo, dr_grpo, dapo, luspo) and "
            "importance_sampling_level='token'; AsyncASPOTrainer collects every trained token (old = the "
            "generator's log-probs), with either of its loss types."
        },
    )
    lr_schedule_per_generation: bool = field(
        default=False,
        metadata={
            "help": "Step the learning-rate schedule once per generation round, as verl steps its scheduler once per "
            "rollout: every optimizer step of a round uses the schedule's value at the round's first optimizer "
            "step (warmup_steps and the schedule's length still count optimizer steps). Needs a round to span whole "
            "optimizer steps (steps_per_generation x num_iterations divisible by gradient_accumulation_steps) and a "
            "lambda schedule (not reduce_lr_on_plateau)."
        },
    )

    # --- Recipe options of the ASPO reference (Archer2.0) ---------------------------------------------------------
    filter_zero_variance_groups: bool = field(
        default=False,
        metadata={
            "help": "Group estimator only: drop from the loss every group whose rewards are all equal (all solved "
            "or all failed; the reference's rejection sampling), so they no longer count in the token mean or the KL "
            "term. Logged as `filter/zero_variance_dropped_share` (the share of completions dropped)."
        },
    )
    overlong_buffer_length: int | None = field(
        default=None,
        metadata={
            "help": "Soft overlong penalty (DAPO, arXiv 2503.14476; the reference's overlong buffer): adds TRL's "
            "`get_soft_overlong_punishment(max_completion_length, overlong_buffer_length)` as a reward function, "
            "0 up to max_completion_length - buffer tokens, then falling linearly to -1 at max_completion_length. "
            "None = off. Must lie in [1, max_completion_length]."
        },
    )
    overlong_penalty_factor: float = field(
        default=1.0,
        metadata={
            "help": "Weight of the overlong penalty in the total reward (the reference's `penalty_factor`). Must be "
            "> 0."
        },
    )

    # --- Tool-position advantage shaping ------------------------------------------------------------------------
    tool_shaping: bool = field(
        default=False,
        metadata={
            "help": "Add a clipped bonus to the advantage of correct completions that call their tool earlier than "
            "their peers (same prompt group; the whole batch with one completion per prompt). Applied last, after "
            "baseline and normalization."
        },
    )
    tool_shaping_delta: float = field(
        default=-2.0,
        metadata={
            "help": "Shaping scale delta: bias = delta * (position - mean position) / mean length. Negative means "
            "earlier calls are better (paper default -2.0; aggressive -2.5). Must be non-zero."
        },
    )
    tool_shaping_k: float = field(
        default=0.7,
        metadata={
            "help": "The bias is clipped to +-k*|advantage|, so shaping never flips the sign of a correct "
            "completion's advantage when k < 1 (paper default 0.7; aggressive 0.9). Must be >= 0."
        },
    )
    tool_shaping_correct_threshold: float = field(
        default=0.5,
        metadata={
            "help": "A completion counts as correct when its reward is at least this value (reward >= threshold, the "
            "same comparison as `trl-aspo evaluate --success_threshold`): the weighted total reward, or the reward "
            "of `tool_shaping_correct_reward` if that is set."
        },
    )
    tool_shaping_correct_reward: str | None = field(
        default=None,
        metadata={
            "help": "Name of the reward function (as in the logged `rewards/<name>` metrics) whose value decides "
            "correctness. None = the weighted total reward."
        },
    )
    tool_call_opener: str = field(
        default="<tool_call>",
        metadata={
            "help": "Text that opens a tool call in the chat template (Qwen-style `<tool_call>`); its token ids mark "
            "the first call with TRL's native `tools=` / `environment_factory=`."
        },
    )
    tool_call_pattern: str | None = field(
        default=None,
        metadata={
            "help": "Regular expression marking a tool call in the decoded completion, for tools embedded in text "
            "(for example '```python' blocks run by a custom rollout). When set, it replaces `tool_call_opener`."
        },
    )
    tool_shaping_interactive_bonus: float = field(
        default=0.0,
        metadata={
            "help": "Optional extra bonus added to the advantage of completions with positive advantage: this value "
            "per interactive turn (a tool call preceded by model text), counting at most 3 turns. 0 = off. Must be "
            ">= 0."
        },
    )
    tool_shaping_penalty: str | None = field(
        default=None,
        metadata={
            "help": "Optional dotted path to a callable penalizing inappropriate tool use: called with the "
            "completion texts and tool statistics, returns one penalty per completion, subtracted from the "
            "advantage. None = off."
        },
    )

    # --- Single-stream value tracking ---------------------------------------------------------------------------
    advantage_estimator: str = field(
        default="group",
        metadata={
            "help": "Baseline of the advantage: 'group' = TRL's mean over the completions of the same prompt; 'spo' "
            "= a persistent per-prompt Beta value tracker with per-visit forgetting; 'spo++' = the tracker with "
            "evidence aged by policy events. 'spo'/'spo++' allow num_generations=1.",
            "choices": list(ADVANTAGE_ESTIMATORS),
        },
    )
    advantage_normalization: str | None = field(
        default=None,
        metadata={
            "help": "How advantages are scaled after the baseline: 'group' = TRL's `scale_rewards` behaviour (only "
            "with the group estimator); 'batch' = (A - mean) / std over the generation batch; 'token' = the same "
            "under the action-token measure (each completion weighted by its action-token count, SPO++). None = "
            "'group' for the group estimator, 'batch' for spo, 'token' for spo++.",
            "choices": [*ADVANTAGE_NORMALIZATIONS, None],
        },
    )
    value_rho: float = field(
        default=0.875,
        metadata={"help": "Forgetting factor of the value tracker (constant mode and spo++). Must lie in (0, 1]."},
    )
    value_rho_mode: str = field(
        default="constant",
        metadata={
            "help": "spo only: 'constant' uses `value_rho` and costs nothing; 'kl' sets rho per visit from the policy "
            "drift D since the prompt's previous visit (its stored completion's log-probs then and now; D = 0 on a "
            "first visit), rho = clip(2^(-D / value_kl_half), value_rho_min, value_rho_max), as the SPO reference. "
            "Costs one extra log-prob pass per round and, per visited prompt, its last completion and log-probs in "
            "CPU memory and checkpoints.",
            "choices": list(VALUE_RHO_MODES),
        },
    )
    value_kl_half: float = field(
        default=0.06,
        metadata={"help": "KL-adaptive rho: mean |log-prob change| at which the evidence halves. Must be > 0."},
    )
    value_rho_min: float = field(
        default=0.875, metadata={"help": "KL-adaptive rho: lower bound. Must lie in (0, value_rho_max]."}
    )
    value_rho_max: float = field(default=0.96, metadata={"help": "KL-adaptive rho: upper bound. Must be <= 1."})
    value_prior_strength: float | None = field(
        default=None,
        metadata={
            "help": "Pseudo-count N0 of the tracker's initialization from counts: a prompt with s successes in n0 "
            "samples starts at Beta(N0 (s+0.5)/(n0+1), N0 (n0-s+0.5)/(n0+1)). None = follow rho: "
            "1/(1-value_rho_min) with value_rho_mode='kl', else 1/(1-value_rho) (8 at 0.875). Must be > 0; must be "
            "set when that rho is 1 and the tracker is initialized."
        },
    )
    value_init_samples: int = field(
        default=0,
        metadata={
            "help": "Completions per prompt drawn with the starting policy before training to initialize the "
            "tracker (0 = no pre-pass: unseen prompts start at Beta(0.5, 0.5)). Must be >= 0."
        },
    )
    value_init_file: str | None = field(
        default=None,
        metadata={
            "help": "JSON file of initial counts: a list of {'prompt_id' or 'prompt': ..., 'successes': s, "
            "'trials': n} records (JSON Lines when the name ends in .jsonl); a record with 'alpha' and 'beta' "
            "instead sets the prompt's pseudo-counts exactly, as `trl-aspo values` exports them. Used instead of the "
            "pre-pass."
        },
    )
    value_reward_range: list[float] | None = field(
        default=None,
        metadata={
            "help": "The tracker needs rewards in [0, 1]. For rewards in another known range [lo, hi], give "
            "`[lo, hi]` and they are mapped linearly to [0, 1] for the tracker. None = rewards outside [0, 1] are "
            "an error."
        },
    )
    prompt_id_column: str | None = field(
        default=None,
        metadata={
            "help": "Dataset column that identifies a prompt for the value tracker. None = a stable content hash of "
            "the prompt (identical across processes and restarts)."
        },
    )
    prioritized_sampling: bool = field(
        default=False,
        metadata={
            "help": "Draw each round's prompts without replacement with weight sqrt(v (1 - v)) + priority_epsilon "
            "from the tracker's values (spo/spo++ only). Each round is drawn when it is dispatched, after the "
            "tracker has taken in every earlier round (with value_rho_mode='kl' too), so priorities act on the next "
            "round whatever the data loader prefetches; a resumed run draws what the uninterrupted one drew. "
            "AsyncASPOTrainer: the rollout worker draws each prompt group (with replacement) from weights the "
            "trainer updates in shared memory after every optimizer step."
        },
    )
    priority_epsilon: float = field(
        default=0.05,
        metadata={"help": "Floor added to every prompt's sampling weight, so no prompt starves. Must be > 0."},
    )

    value_reset_on_resume: bool = field(
        default=False,
        metadata={
            "help": "Resume a checkpoint without its value tracker on purpose: the tracker starts fresh (Beta(0.5, "
            "0.5), or value_init_file) when the checkpoint holds no trl-aspo state, no tracker for this "
            "advantage_estimator, or was keyed by another prompt_id_column. False = such a resume is refused."
        },
    )

    def _check_field_types(self) -> None:
        """Type-check every field ASPOConfig adds against its annotation, before any range check compares values:
        values from YAML arrive unconverted (a number for a list, a list for a number, 1 for true)."""
        for name, alternatives in aspo_field_types().items():
            value = getattr(self, name)
            if "None" in alternatives and value is None:
                continue
            checks = [_TYPE_CHECKS[kind] for kind in alternatives if kind in _TYPE_CHECKS]
            if len(checks) + ("None" in alternatives) < len(alternatives):
                continue  # an annotation this table does not know: the field's own checks apply
            if not any(accepts(value) for accepts, _ in checks):
                allowed = " or ".join([what for _, what in checks] + (["None"] * ("None" in alternatives)))
                raise ValueError(f"{type(self).__name__}.{name}={value!r} is invalid: must be {allowed}.")

    def _validate_aspo_fields(self) -> None:
        def require(condition: bool, name: str, allowed: str) -> None:
            if not condition:
                raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)!r} is invalid: {allowed}.")

        self._check_field_types()
        for name, reason in self._unsupported_fields.items():
            require(
                getattr(self, name) == self.__dataclass_fields__[name].default,
                name,
                f"{reason}; remove it (default {self.__dataclass_fields__[name].default!r})",
            )
        require(
            self.num_generations is None
            or (isinstance(self.num_generations, int) and not isinstance(self.num_generations, bool))
            and self.num_generations >= 1,
            "num_generations",
            "must be a positive integer",
        )
        self._check_field_bounds()
        require(self.aspo_aggregation in ASPO_AGGREGATIONS, "aspo_aggregation", f"must be one of {ASPO_AGGREGATIONS}")
        if self.overlong_buffer_length is not None:
            require(
                self.overlong_buffer_length <= (self.max_completion_length or 0),
                "overlong_buffer_length",
                f"must be None or an integer in [1, max_completion_length={self.max_completion_length}]",
            )
        require(self.tool_shaping_delta != 0, "tool_shaping_delta", "must be != 0")
        require(bool(self.tool_call_opener), "tool_call_opener", "must be a non-empty string")
        if self.tool_call_pattern is not None:
            import re

            try:
                re.compile(self.tool_call_pattern)
            except re.error as error:
                raise ValueError(
                    f"{type(self).__name__}.tool_call_pattern={self.tool_call_pattern!r} is not a valid regular "
                    f"expression: {error}."
                ) from None
        self._validate_loss_coupling(require)

        require(
            self.advantage_estimator in ADVANTAGE_ESTIMATORS,
            "advantage_estimator",
            f"must be one of {ADVANTAGE_ESTIMATORS}",
        )
        if self.advantage_normalization is None:
            self.advantage_normalization = {"group": "group", "spo": "batch", "spo++": "token"}[
                self.advantage_estimator
            ]
        require(
            self.advantage_normalization in ADVANTAGE_NORMALIZATIONS,
            "advantage_normalization",
            f"must be one of {ADVANTAGE_NORMALIZATIONS}",
        )
        single_stream = self.advantage_estimator in SINGLE_STREAM_ESTIMATORS
        require(
            not (single_stream and self.advantage_normalization == "group"),
            "advantage_normalization",
            f"'group' scaling needs prompt groups; with advantage_estimator={self.advantage_estimator!r} use "
            "'batch' or 'token'",
        )
        require(
            single_stream or self.num_generations is None or self.num_generations >= 2,
            "num_generations",
            "the group baseline needs at least 2 completions per prompt; num_generations=1 requires "
            "advantage_estimator='spo' or 'spo++'",
        )
        self._validate_reward_aggregation(require, single_stream)
        require(self.value_rho_mode in VALUE_RHO_MODES, "value_rho_mode", f"must be one of {VALUE_RHO_MODES}")
        require(self.value_rho_min <= self.value_rho_max, "value_rho_min", "must lie in (0, value_rho_max]")
        if self.value_prior_strength is None:
            prior_rho = self.value_rho_min if self.value_rho_mode == "kl" else self.value_rho
            require(
                prior_rho < 1 or not _tracker_initialized(self),
                "value_prior_strength",
                f"the default 1/(1-rho) is infinite at rho={prior_rho}; set a positive value",
            )
            self.value_prior_strength = _derived_prior_strength(self)
        require(
            not (self.value_init_samples > 0 and self.value_init_file is not None),
            "value_init_file",
            "give either value_init_file or value_init_samples > 0, not both",
        )
        if self.value_reward_range is not None:
            require(
                len(self.value_reward_range) == 2 and self.value_reward_range[0] < self.value_reward_range[1],
                "value_reward_range",
                "must be two finite numbers [lo, hi] with lo < hi",
            )

    def _check_field_bounds(self) -> None:
        """Every numeric field within its `FIELD_BOUNDS` range (None passes where the annotation allows it)."""
        for name, bound in FIELD_BOUNDS.items():
            value = getattr(self, name)
            values = value if isinstance(value, list | tuple) else [value]
            if value is None or all(bound.holds(item) for item in values):
                continue
            each = " each" if isinstance(value, list | tuple) else ""
            optional = " or be None" if "None" in aspo_field_types()[name] else ""
            raise ValueError(
                f"{type(self).__name__}.{name}={value!r} is invalid: must{each} lie in {bound}{optional}."
            )

    def _config_dependencies(self) -> tuple[Dependency, ...]:
        """The dependencies of fields on switches of this config's TRL base class (added to FIELD_DEPENDENCIES)."""
        return ()

    def field_dependencies(self) -> tuple[Dependency, ...]:
        """Every dependency this config checks: loss_type='aspo' for each `aspo_` field, FIELD_DEPENDENCIES, and
        this config's own."""
        aspo_loss = tuple(
            Dependency(
                config_field.name,
                ("loss_type",),
                "loss_type='aspo'",
                lambda c: c.loss_type == "aspo",
                "it only acts in the aspo loss",
            )
            for config_field in fields(ASPOFieldsMixin)
            if config_field.name.startswith("aspo_")
        )
        return aspo_loss + FIELD_DEPENDENCIES + self._config_dependencies()

    def _check_field_dependencies(self) -> None:
        """Refuse (or warn about) every option set away from its default whose switch is off: run after the TRL base
        config's `__post_init__`, which derives the fields some conditions read (generation_batch_size)."""
        name = type(self).__name__
        for dependency in self.field_dependencies():
            value = getattr(self, dependency.option)
            derived = DERIVED_DEFAULTS.get(dependency.option)
            at_default = value == self.__dataclass_fields__[dependency.option].default or (
                derived is not None and value == derived(self)
            )
            if at_default or dependency.holds(self):
                continue
            got = ", ".join(f"{switch}={getattr(self, switch)!r}" for switch in dependency.switches)
            reason = f"{dependency.why}, so it needs {dependency.needs} (got {got})"
            if dependency.refuse:
                raise ValueError(
                    f"{name}.{dependency.option}={value!r} is invalid: {reason}. Remove {dependency.option} or change "
                    f"{', '.join(dependency.switches)}."
                )
            warnings.warn(f"{name}.{dependency.option}={value!r} may do nothing: {reason}.", UserWarning, stacklevel=4)

    def _validate_loss_coupling(self, require) -> None:
        """Checks between `loss_type='aspo'` and loss fields of the TRL base config."""
        raise NotImplementedError

    def _validate_reward_aggregation(self, require, single_stream: bool) -> None:
        """Checks between the baseline and how the TRL base config combines several reward functions."""
        raise NotImplementedError


@dataclass
class ASPOConfig(ASPOFieldsMixin, GRPOConfig):
    r"""
    Configuration for [`ASPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the fields below.

    Asymmetric importance-sampling loss (Wang et al. 2025, arXiv 2510.06062), selected with `loss_type="aspo"`;
    `epsilon` / `epsilon_high` keep their TRL meaning (hard-clip offsets below / above 1).
    Tool-position advantage shaping (Lin & Xu 2025, arXiv 2508.19201), switched on with `tool_shaping=True`.
    Single-stream value tracking (SPO, arXiv 2509.13232; SPO++, arXiv 2608.24870), selected with
    `advantage_estimator="spo"` or `"spo++"`; with these, `num_generations=1` is allowed.
    """

    # GRPOConfig's field, with a help text that lists the value trl-aspo adds.
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Loss formulation: 'aspo' = trl-aspo's asymmetric IS loss (flipped ratio for positive-advantage "
            "tokens, one-sided hard clip, soft dual clip; see the aspo_* fields), or one of TRL's: 'grpo', "
            "'dr_grpo', 'dapo' (default), 'bnpo', 'cispo', 'sapo', 'luspo', 'vespo' (see TRL's GRPOConfig)."
        },
    )

    def __post_init__(self):
        self._validate_aspo_fields()
        single_stream = self.advantage_estimator in SINGLE_STREAM_ESTIMATORS and self.num_generations == 1
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
        self._check_field_dependencies()
        self._warn_on_policy_aspo()

    def optimizer_steps_per_generation(self) -> float:
        """Optimizer steps one generation round feeds: steps_per_generation x num_iterations micro-batches, a step
        every gradient_accumulation_steps of them."""
        return self.steps_per_generation * self.num_iterations / self.gradient_accumulation_steps

    def _config_dependencies(self) -> tuple[Dependency, ...]:
        return (
            Dependency(
                "aspo_adaptive_kl_beta",
                ("beta",),
                "beta > 0",
                lambda c: c.beta > 0,
                "it raises the KL coefficient from beta, and beta=0 loads no reference model",
            ),
            Dependency(
                "kl_clamp",
                ("loss_type",),
                "loss_type='aspo'",
                lambda c: c.loss_type == "aspo",
                "TRL's own losses compute the KL inline in GRPOTrainer._compute_loss (one 250-line method, which "
                "trl-aspo replaces only for its own loss)",
            ),
            Dependency("kl_clamp", ("beta",), "beta > 0", lambda c: c.beta > 0, "with beta=0 there is no KL term"),
            Dependency(
                "aspo_unflipped_fraction",
                ("generation_batch_size",),
                "aspo_unflipped_fraction x generation_batch_size > 0.5",
                lambda c: c.aspo_unflipped_fraction * c.generation_batch_size > 0.5,
                "round(fraction x the round's positive-advantage completions) are left unflipped, 0 in every round",
            ),
            Dependency(
                "log_weight_map",
                ("loss_type",),
                f"loss_type in {WEIGHT_MAP_LOSS_TYPES}",
                lambda c: c.loss_type in WEIGHT_MAP_LOSS_TYPES,
                "the map needs each token's gradient weight, which trl_aspo.algorithms.weight_map gives for these losses",
            ),
            Dependency(
                "log_weight_map",
                ("importance_sampling_level",),
                "importance_sampling_level='token'",
                lambda c: c.importance_sampling_level == "token",
                "a sequence-level ratio weighs every token of a completion alike",
            ),
            Dependency(
                "log_weight_map",
                ("num_iterations", "steps_per_generation", "gradient_accumulation_steps"),
                "gradient_accumulation_steps not a multiple of steps_per_generation x num_iterations (or vLLM with "
                "its IS correction)",
                lambda c: (
                    c.gradient_accumulation_steps % (c.steps_per_generation * c.num_iterations) != 0
                    or (c.use_vllm and c.vllm_importance_sampling_correction)
                ),
                "the map is collected on off-policy passes, and every pass is on-policy (ratio 1, weight 1)",
                refuse=False,
            ),
            Dependency(
                "lr_schedule_per_generation",
                ("steps_per_generation", "num_iterations", "gradient_accumulation_steps"),
                "steps_per_generation x num_iterations divisible by gradient_accumulation_steps",
                lambda c: c.optimizer_steps_per_generation().is_integer(),
                "a generation round must span whole optimizer steps",
            ),
            Dependency(
                "lr_schedule_per_generation",
                ("lr_scheduler_type",),
                "a lambda schedule other than 'constant'",
                lambda c: _lr_schedule_type(c) not in ("constant", "reduce_lr_on_plateau"),
                "a constant rate is the same per round, and reduce_lr_on_plateau steps on a metric",
            ),
        )

    def _warn_on_policy_aspo(self) -> None:
        """The flip acts only where the ratio differs from 1: warn when every optimizer step is on-policy."""
        on_policy = self.num_iterations == 1 and self.steps_per_generation == self.gradient_accumulation_steps
        if self.loss_type == "aspo" and on_policy and not (self.use_vllm and self.vllm_importance_sampling_correction):
            warnings.warn(
                "ASPOConfig.loss_type='aspo' with num_iterations=1 and steps_per_generation == "
                "gradient_accumulation_steps: every optimizer step is on-policy (ratio 1), where the flip changes "
                "nothing and the loss equals TRL's. Set num_iterations > 1 or steps_per_generation > "
                "gradient_accumulation_steps (several mini-batches per rollout, as the reference) to make it act.",
                UserWarning,
                stacklevel=4,
            )

    def _validate_loss_coupling(self, require) -> None:
        if self.loss_type == "aspo":
            require(
                self.importance_sampling_level == "token",
                "importance_sampling_level",
                "must be 'token' with loss_type='aspo' (the flip acts on per-token ratios)",
            )
            require(
                self.entropy_coef == 0 and not self.use_adaptive_entropy,
                "entropy_coef",
                "the entropy bonus is not supported with loss_type='aspo'; use aspo_adaptive_kl_beta or set 0",
            )
        require(
            self.aspo_adaptive_kl_beta is None or self.aspo_adaptive_kl_beta >= self.beta,
            "aspo_adaptive_kl_beta",
            f"must be >= beta={self.beta}",
        )

    def _validate_reward_aggregation(self, require, single_stream: bool) -> None:
        require(
            not (self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_normalization != "group"),
            "multi_objective_aggregation",
            f"'normalize_then_sum' is TRL's group scaling; advantage_normalization={self.advantage_normalization!r} "
            "rescales the summed reward instead, so use 'sum_then_normalize' or advantage_normalization='group'",
        )
        require(
            not (single_stream and self.multi_objective_aggregation != "sum_then_normalize"),
            "multi_objective_aggregation",
            "the value tracker learns the weighted total reward, so it must be 'sum_then_normalize'",
        )
