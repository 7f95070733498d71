r"""The advantage-estimator registry: an estimator is one registered entry, and both trainers look it up by name.

A stateless group estimator maps one batch's total rewards to advantages before normalization and shaping:

    @register_advantage_estimator("rloo")
    def rloo(rewards, group_ids, scorable):   # (N,) float, (N,) long, (N,) bool -> (N,) advantages
        ...

`group_ids[i]` names the prompt group of sample `i` (the completions of one prompt in one generation round);
`scorable[i]` is False where no reward function scored the sample (its reward is NaN). An estimator must not let an
unscorable reward into any statistic; what it returns there is replaced by 0. Once registered (before the config is
built), `advantage_estimator="rloo"` is accepted by `ASPOConfig` and `AsyncASPOConfig`, and both trainers call the
function on the same inputs: `ASPOTrainer` on a generation round gathered across ranks, `AsyncASPOTrainer` on each
group's raw rewards (trl_aspo.values.scoring).

The built-in `group` estimator is GRPO's baseline (Shao et al. 2024, arXiv 2402.03300), over the scorable members of
each group G:

    A_i = R_i - mean_{j in G(i), scorable_j} R_j

It is also what TRL computes itself, so `advantage_normalization='group'` (TRL's own group scaling, or its rollout
worker's z-score) keeps TRL's advantages; no other estimator has that normalization. The tracker estimators `spo` and
`spo++` (per-prompt Beta values, SPO arXiv 2509.13232, SPO++ arXiv 2608.24870) carry a tracker factory instead of a
function and are registered by trl_aspo.values, which owns the trackers. The verl model:
`verl/trainer/ppo/core_algos.py`, `register_adv_est`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trl_aspo.algorithms.papers import Paper
from trl_aspo.algorithms.registration import is_redefinition

GroupEstimator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# What `advantage_normalization=None` may mean for a registered estimator: the normalizations computed on
# trl-aspo's side ('group' is TRL's own, kept only for the estimator TRL computes).
REGISTERED_NORMALIZATIONS = ("batch", "token")


@dataclass(frozen=True)
class AdvantageEstimator:
    """One registered estimator.

    `estimate(rewards, group_ids, scorable) -> (N,)`: a stateless group estimator (None for a tracker estimator).
    `make_tracker(args, asynchronous) -> tracker`: a per-prompt value tracker's factory (None for a group estimator;
    `asynchronous`: for the asynchronous trainer, whose policy event is a sample's model version).
    `default_normalization`: what `advantage_normalization=None` means with it. `allows_single_completion`: whether
    `num_generations=1` is allowed (a group estimator needs groups of at least 2). `computed_by_trl`: TRL's trainers
    and rollout worker compute it themselves (only `group`), so `advantage_normalization='group'` keeps theirs.
    `per_visit_forgetting`: its tracker ages evidence per visit (SPO), where KL-adaptive forgetting
    (`value_rho_mode='kl'`) applies. `papers`: cited on the model card."""

    name: str
    estimate: GroupEstimator | None = None
    make_tracker: Callable[[Any, bool], Any] | None = None
    default_normalization: str = "batch"
    allows_single_completion: bool = False
    computed_by_trl: bool = False
    per_visit_forgetting: bool = False
    papers: tuple[Paper, ...] = ()

    @property
    def tracks_values(self) -> bool:
        """Whether the baseline is a per-prompt value tracker's (single-stream training)."""
        return self.make_tracker is not None

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor, scorable: torch.Tensor) -> torch.Tensor:
        """The group estimator on checked inputs; its advantages (N,) in the rewards' dtype, 0 where not scorable."""
        if self.estimate is None:
            raise ValueError(
                f"advantage estimator {self.name!r} is a value tracker's: its baseline is read from the tracker, not "
                "computed from a batch's rewards."
            )
        check_group_inputs(rewards, group_ids, scorable)
        advantages = self.estimate(rewards, group_ids, scorable)
        where, origin = f"advantage estimator {self.name!r}", f"(registered from {_defined_at(self.estimate)})"
        if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != tuple(rewards.shape):
            got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
            raise ValueError(f"{where} must return one advantage per reward, shape {tuple(rewards.shape)}; got {got}.")
        # A complex advantage would lose its imaginary part in the cast below, silently.
        if not advantages.dtype.is_floating_point or advantages.device != rewards.device:
            raise ValueError(
                f"{where} must return a real floating tensor on the rewards' device {rewards.device}; got dtype "
                f"{advantages.dtype} on {advantages.device} {origin}."
            )
        advantages = torch.where(scorable, advantages.to(rewards.dtype), torch.zeros_like(rewards))
        # Checked in float32, the loss's precision, and left in the rewards' dtype: 1e39 is finite in float64 but inf
        # there (the synchronous trainer refused it at its last check, the asynchronous one trained on it).
        finite = torch.isfinite(advantages.detach().float())
        if not bool(finite.all()):
            index = int((~finite).nonzero()[0])
            raise ValueError(
                f"{where} returned advantages that are not finite in float32, the loss's precision: "
                f"{int((~finite).sum())} of {len(advantages)}, e.g. {advantages[index].item()!r} for reward "
                f"{rewards[index].item()!r} (sample {index}) {origin}."
            )
        return advantages


def _defined_at(function) -> str:
    """Where a registered callable comes from, to name the plugin in its errors: `module.qualname`."""
    module = getattr(function, "__module__", None) or "?"
    return f"{module}.{getattr(function, '__qualname__', type(function).__name__)}"


def check_group_inputs(rewards: torch.Tensor, group_ids: torch.Tensor, scorable: torch.Tensor) -> None:
    """The inputs of a group estimator: 1-D tensors of one length, floating rewards, integer group ids, bool scorable
    flags; a scorable reward is finite."""
    for name, tensor in (("rewards", rewards), ("group_ids", group_ids), ("scorable", scorable)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"`{name}` must be a 1-D tensor (N,), got {got}.")
    if not len(rewards) == len(group_ids) == len(scorable):
        raise ValueError(
            f"`rewards`, `group_ids` and `scorable` must have one length, got {len(rewards)}, {len(group_ids)} and "
            f"{len(scorable)}."
        )
    if not rewards.dtype.is_floating_point:
        raise ValueError(f"`rewards` must be a floating tensor, got {rewards.dtype}.")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"`group_ids` must be an integer tensor, got {group_ids.dtype}.")
    if scorable.dtype != torch.bool:
        raise ValueError(f"`scorable` must be a bool tensor, got {scorable.dtype}.")
    if not bool(torch.isfinite(rewards[scorable]).all()):
        raise ValueError("`rewards` must be finite wherever `scorable` is True (an unscored reward is not scorable).")


def group_mean_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, scorable: torch.Tensor) -> torch.Tensor:
    """GRPO's group baseline: ``A_i = R_i - mean_{j in G(i), scorable_j} R_j`` (arXiv 2402.03300), 0 where not
    scorable; a group without a scorable member has no mean and all its members are unscorable."""
    if not len(rewards):
        return torch.zeros_like(rewards)
    _, group_index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group_index.max()) + 1
    scored = torch.where(scorable, rewards, torch.zeros_like(rewards))
    sums = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, group_index, scored)
    counts = torch.zeros_like(sums).index_add_(0, group_index, scorable.to(rewards.dtype))
    means = sums / counts.clamp_min(1.0)
    return torch.where(scorable, rewards - means[group_index], torch.zeros_like(rewards))


_ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def _register(entry: AdvantageEstimator) -> AdvantageEstimator:
    name = entry.name
    if not isinstance(name, str) or not name or any(char.isspace() for char in name):
        raise ValueError(
            f"register_advantage_estimator: the name must be a non-empty string without spaces, got {name!r}."
        )
    registered = _ADVANTAGE_ESTIMATORS.get(name)
    if registered is not None and not (
        entry.estimate is not None and is_redefinition(registered.estimate, entry.estimate)
    ):
        raise ValueError(
            f"register_advantage_estimator({name!r}): an advantage estimator of that name is already registered "
            f"(registered: {registered_advantage_estimators()}); register it under another name."
        )
    if entry.default_normalization not in REGISTERED_NORMALIZATIONS and not entry.computed_by_trl:
        raise ValueError(
            f"register_advantage_estimator({name!r}): default_normalization={entry.default_normalization!r} must be "
            f"one of {REGISTERED_NORMALIZATIONS} ('group' is TRL's own scaling of its group baseline)."
        )
    _ADVANTAGE_ESTIMATORS[name] = entry
    return entry


def register_advantage_estimator(
    name: str,
    *,
    default_normalization: str = "batch",
    allows_single_completion: bool = False,
    papers: tuple[Paper, ...] = (),
) -> Callable[[GroupEstimator], GroupEstimator]:
    """Decorator registering a stateless group estimator `fn(rewards, group_ids, scorable) -> (N,)` under `name`
    (see the module docstring); returns `fn` unchanged. `default_normalization`: 'batch' or 'token', what
    `advantage_normalization=None` means with it. `allows_single_completion`: whether `num_generations=1` is allowed.
    `papers`: cited on the model card. A name another function holds is refused; the same definition run again
    (`is_redefinition`) replaces its registration."""

    def register(fn: GroupEstimator) -> GroupEstimator:
        if not callable(fn):
            raise ValueError(f"register_advantage_estimator({name!r}) decorates a function, got {fn!r}.")
        _register(
            AdvantageEstimator(
                name,
                estimate=fn,
                default_normalization=default_normalization,
                allows_single_completion=allows_single_completion,
                papers=tuple(papers),
            )
        )
        return fn

    return register


def register_tracker_estimator(
    name: str,
    make_tracker: Callable[[Any, bool], Any],
    *,
    default_normalization: str,
    per_visit_forgetting: bool = False,
    papers: tuple[Paper, ...] = (),
) -> AdvantageEstimator:
    """Register a per-prompt value tracker's estimator under `name`: `make_tracker(args, asynchronous)` builds its
    tracker; `num_generations=1` is allowed (the tracker needs no group). A name already registered is refused."""
    return _register(
        AdvantageEstimator(
            name,
            make_tracker=make_tracker,
            default_normalization=default_normalization,
            allows_single_completion=True,
            per_visit_forgetting=per_visit_forgetting,
            papers=tuple(papers),
        )
    )


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator `name`; ValueError naming the registered ones for any other name."""
    entry = _ADVANTAGE_ESTIMATORS.get(name)
    if entry is None:
        raise ValueError(
            f"advantage_estimator={name!r} is not registered; registered: {registered_advantage_estimators()}."
        )
    return entry


def registered_advantage_estimators() -> tuple[str, ...]:
    """The names `advantage_estimator` takes, in registration order."""
    return tuple(_ADVANTAGE_ESTIMATORS)


def unregister_advantage_estimator(name: str) -> None:
    """Remove a registration (for tests that register an estimator of their own)."""
    _ADVANTAGE_ESTIMATORS.pop(name, None)


_register(
    AdvantageEstimator(
        "group",
        estimate=group_mean_baseline,
        default_normalization="group",
        computed_by_trl=True,
    )
)
