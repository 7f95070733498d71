r"""The policy-loss registry: a per-token policy loss is one registered function, and both trainers look it up.

    @register_policy_loss("my_loss")
    def my_loss(inputs: PolicyLossInputs):
        ratio = torch.exp(inputs.log_probs - inputs.old_log_probs)
        return -inputs.advantages[:, None] * ratio        # (B, T), or ((B, T), {stat name: (B, T) tensor})

Once registered (before the config is built), `loss_type="my_loss"` is accepted by `ASPOConfig` and
`AsyncASPOConfig` and trains in `ASPOTrainer` and `AsyncASPOTrainer`. The function returns the per-token loss,
neither masked nor aggregated; the shared assembly (trl_aspo.trainers.loss_assembly) multiplies it by the trainer's
gradient-free factors (TRL's masks, the vLLM or off-policy correction weight), adds the KL term, aggregates it over
one optimizer step (`aspo_aggregation`: token or sequence mean, over every micro-batch and rank) and scales it for
gradient accumulation. A loss reads its own config fields from `inputs.args`. TRL's own loss types (`TRL_LOSS_TYPES`)
keep running through TRL's code: a registered name may not clash with one.

A registration can carry what only its method needs, so shared code never asks which loss it runs: `draw` (per-sample
random choices made once per batch, e.g. the aspo loss's unflipped mix), `weight` (each token's gradient weight for
the weight map), `metrics` (how its stats are logged), `on_policy_warning`, and `papers` (the model card's
citations). The verl model: `verl/trainer/ppo/core_algos.py`, `register_policy_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trl_aspo.algorithms.papers import Paper
from trl_aspo.algorithms.registration import is_redefinition

# GRPOTrainer's loss types (GRPOConfig.loss_type) and AsyncGRPOTrainer's one (its fixed PPO clip, which
# AsyncASPOConfig names "ppo"): computed by TRL's code, never by the registry.
TRL_SYNC_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
TRL_ASYNC_LOSS_TYPES = ("ppo",)
TRL_LOSS_TYPES = (*TRL_SYNC_LOSS_TYPES, *TRL_ASYNC_LOSS_TYPES)


@dataclass
class PolicyLossInputs:
    """What a registered loss gets for one micro-batch (B completions, T token positions).

    `log_probs` (B, T): the current policy's log-probs, the only input with a gradient. `old_log_probs` (B, T): the
    policy the ratio is taken against (the synchronous trainer's recomputed old policy, `log_probs.detach()`
    on-policy; the asynchronous trainer's generator log-probs, or its proximal policy in the decoupled mode).
    `advantages`: (B,) or (B, T). `mask` (B, T): the action tokens. `args`: the trainer's config. `step`: the
    optimizer step (for schedules). `epsilon_low`, `epsilon_high`: the trainer's clip offsets (TRL's `epsilon`,
    `epsilon_high`). `entropies` (B, T): detached token entropies. `draws`: the (B,) tensors the loss's `draw` made
    for these samples."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    args: Any
    step: int = 0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    entropies: torch.Tensor | None = None
    draws: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class RatioMetric:
    """A logged metric `name` = sum of stat `numerator` over the action tokens / sum of stat `denominator` (None:
    the action tokens), over the logging window and every rank."""

    name: str
    numerator: str
    denominator: str | None = None


@dataclass(frozen=True)
class PolicyLoss:
    """One registered loss. `fn(inputs) -> per-token loss` or `(per-token loss, stats)`. `draw(advantages (B,),
    args, generator) -> {name: (B,) tensor}`: random per-sample choices, made once per generation round (synchronous)
    or micro-batch (asynchronous) with a generator seeded alike on every rank, handed back in `inputs.draws`.
    `weight(stats, advantages, args) -> (B, T)`: each token's gradient weight `w` (`d loss / d lp = -A w`), for the
    weight map. `metrics`: how `stats` are logged (None: each stat as `<name>/<stat>_mean`, its action-token mean).
    `on_policy_warning`: said when every optimizer step is on-policy (ratio 1), where the loss may reduce to TRL's.
    `papers`: cited on the model card. `reads_fields`: the prefix of the config fields only this loss reads (the
    aspo loss's `aspo_`), which the config refuses under another loss."""

    name: str
    fn: Callable[[PolicyLossInputs], torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]]
    draw: Callable[[torch.Tensor, Any, torch.Generator], dict[str, torch.Tensor]] | None = None
    weight: Callable[[dict[str, torch.Tensor], torch.Tensor, Any], torch.Tensor] | None = None
    metrics: tuple[RatioMetric, ...] | None = None
    on_policy_warning: str | None = None
    papers: tuple[Paper, ...] = ()
    reads_fields: str | None = None

    def __call__(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token loss and its (detached) stats; checks the shape the function returned."""
        result = self.fn(inputs)
        where = f"policy loss {self.name!r}"
        origin = f"(registered from {getattr(self.fn, '__module__', '?')}.{_qualname(self.fn)})"
        if isinstance(result, tuple) and len(result) != 2:
            raise ValueError(
                f"{where} must return a per-token loss or (per-token loss, stats); got {len(result)} items {origin}."
            )
        loss, stats = result if isinstance(result, tuple) else (result, {})
        shape, device = tuple(inputs.log_probs.shape), inputs.log_probs.device
        if not isinstance(loss, torch.Tensor) or tuple(loss.shape) != shape:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"{where} must return a per-token loss of shape {shape}, got {got}.")
        # A complex or integer loss, or one on another device (e.g. "meta"), failed later in raw errors naming no loss.
        if not loss.dtype.is_floating_point or loss.device != device:
            raise ValueError(
                f"{where} must return a real floating per-token loss on the log-probs' device {device}; got dtype "
                f"{loss.dtype} on {loss.device} {origin}."
            )
        if inputs.log_probs.requires_grad and not loss.requires_grad:
            raise ValueError(
                f"{where} returned a per-token loss with no gradient: it must be computed from "
                "`inputs.log_probs` without detaching them (no .detach(), .item() or torch.no_grad() on that path)."
            )
        if not isinstance(stats, dict):
            raise ValueError(
                f"{where} must return its stats as a dict {{name: per-token tensor}}; got {type(stats).__name__} "
                f"{origin}."
            )
        for stat, value in stats.items():
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{where}: stat {stat!r} must have shape {shape}, got {got}.")
            if value.dtype.is_complex or value.device != device:
                raise ValueError(
                    f"{where}: stat {stat!r} must be a real tensor on {device} {origin}; got dtype "
                    f"{value.dtype} on {value.device}."
                )
        return loss, {stat: value.detach() for stat, value in stats.items()}

    def logged_metrics(self, stats: dict[str, torch.Tensor]) -> tuple[RatioMetric, ...]:
        if self.metrics is not None:
            return self.metrics
        return tuple(RatioMetric(f"{self.name}/{stat}_mean", stat) for stat in sorted(stats))


_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(
    name: str,
    *,
    draw: Callable | None = None,
    weight: Callable | None = None,
    metrics: tuple[RatioMetric, ...] | None = None,
    on_policy_warning: str | None = None,
    papers: tuple[Paper, ...] = (),
    reads_fields: str | None = None,
) -> Callable:
    """Decorator registering `fn` as the policy loss `name` (see the module docstring); returns `fn` unchanged.
    Refuses a name TRL's trainers own (`TRL_LOSS_TYPES`) or one another function holds; the same definition run
    again (`is_redefinition`) replaces its registration."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_policy_loss: the name must be an identifier-like string, got {name!r}.")
    if name in TRL_LOSS_TYPES:
        raise ValueError(
            f"register_policy_loss({name!r}): {name!r} is a TRL loss type (TRL's loss types: {TRL_LOSS_TYPES}), "
            "which TRL's own code computes; register the loss under another name."
        )

    def register(fn: Callable) -> Callable:
        if not callable(fn):
            raise ValueError(f"register_policy_loss({name!r}) decorates a function, got {fn!r}.")
        if name in _POLICY_LOSSES and not is_redefinition(_POLICY_LOSSES[name].fn, fn):
            raise ValueError(
                f"register_policy_loss({name!r}): a policy loss of that name is already registered "
                f"({_definition(_POLICY_LOSSES[name].fn)}); register {_definition(fn)} under another name."
            )
        _POLICY_LOSSES[name] = PolicyLoss(
            name, fn, draw, weight, metrics, on_policy_warning, tuple(papers), reads_fields
        )
        return fn

    return register


def _definition(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def get_policy_loss(name: str) -> PolicyLoss | None:
    """The registered loss `name`; None for a TRL loss type (or any unregistered name)."""
    return _POLICY_LOSSES.get(name)


def registered_policy_losses() -> tuple[str, ...]:
    return tuple(_POLICY_LOSSES)


def loss_type_names(trainer: str | None = None) -> tuple[str, ...]:
    """The values `loss_type` takes: the registered losses, then TRL's for the trainer ("sync", "async"; None:
    both)."""
    trl = {"sync": TRL_SYNC_LOSS_TYPES, "async": TRL_ASYNC_LOSS_TYPES}.get(trainer, TRL_LOSS_TYPES)
    return (*_POLICY_LOSSES, *trl)


def losses_reading(prefix: str) -> tuple[str, ...]:
    """The registered losses whose own config fields start with `prefix`."""
    return tuple(name for name, entry in _POLICY_LOSSES.items() if entry.reads_fields == prefix)


def unregister_policy_loss(name: str) -> None:
    """Remove a registration (for tests that register a loss of their own)."""
    _POLICY_LOSSES.pop(name, None)


# ---------------------------------------------------------------------------------------- metrics as ratios
def _qualname(function) -> str:
    return getattr(function, "__qualname__", type(function).__name__)


def metric_sums(metrics: tuple[RatioMetric, ...], stats: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """(2 * len(metrics),) float32: each metric's numerator and denominator summed over the action tokens (`mask`),
    for one reduction over ranks with the caller's other sums."""
    mask = mask.float()
    columns = []
    for metric in metrics:
        columns.append((stats[metric.numerator].float() * mask).sum())
        columns.append(mask.sum() if metric.denominator is None else (stats[metric.denominator].float() * mask).sum())
    return torch.stack(columns) if columns else torch.zeros(0)


def metric_pairs(metrics: tuple[RatioMetric, ...], sums: list[float]) -> dict[str, tuple[float, float]]:
    """The `(numerator, denominator)` pair of each metric from its (rank-summed) `metric_sums`; a metric whose
    denominator is 0 is left out (a window without, e.g., any flipped token logs no flipped-weight mean)."""
    pairs = {metric.name: (sums[2 * i], sums[2 * i + 1]) for i, metric in enumerate(metrics)}
    return {name: pair for name, pair in pairs.items() if pair[1] > 0}


def reduce_ratio_metrics(metrics: dict[str, list]) -> None:
    """Replace, in place, every metric logged as `(numerator, denominator)` pairs by its one window value
    ``sum(numerators) / sum(denominators)`` (the rule of TRL's async `_reduce_metric`): every token of the window
    weighs the same, where a mean of per-micro-batch ratios would weigh short micro-batches up."""
    for name, values in metrics.items():
        if values and isinstance(values[0], tuple):
            numerator, denominator = (sum(column) for column in zip(*values, strict=True))
            metrics[name] = [numerator / denominator]
