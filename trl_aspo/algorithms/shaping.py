"""Tool-position advantage shaping.

Lin & Xu 2025, "Understanding Tool-Integrated Reasoning", arXiv 2508.19201, reward correct tool-using
completions that call their tool earlier than their peers. For completion ``i`` of group ``G`` with
advantage ``A_i`` (after baseline and normalization), first-call position ``p_i`` (action tokens
before the first call) and action-token length ``L_i``::

    E    = { i in G : correct_i and has a tool call }
    b_i  = delta * (p_i - mean_{j in E} p_j) / mean_{j in E} L_j        (delta < 0: earlier is better)
    A'_i = A_i + clip(b_i, -k * |A_i|, +k * |A_i|)   for i in E;   A'_i = A_i otherwise

The result is not renormalized. With one completion per prompt (single-stream training) the whole
batch is one group. The group statistics are computed on tensors gathered across ranks, because a
group can straddle ranks.

The module also defines a small hook protocol for optional extra adjustments (off by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = [
    "CallablePenalty",
    "InteractiveTurnBonus",
    "ShapingHook",
    "is_correct",
    "shaping_stats",
    "tool_position_bias",
    "tool_position_shaping",
]


def is_correct(scores: torch.Tensor | float, threshold: float) -> torch.Tensor:
    """``correct_i = score_i >= threshold``: the one comparison for tool shaping and for evaluation alike.

    An unscored completion (NaN) is never correct. Returns a bool tensor of the shape of ``scores``."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    return torch.nan_to_num(scores, nan=-math.inf) >= threshold


def _check_1d(name: str, tensor: torch.Tensor, size: int | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dim() != 1:
        raise ValueError(f"`{name}` must be 1-D (B,), got shape {tuple(tensor.shape)}.")
    if size is not None and tensor.numel() != size:
        raise ValueError(f"`{name}` has {tensor.numel()} elements, expected {size} (same as `advantages`).")


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.dtype.is_floating_point and not tensor.dtype.is_complex and tensor.dtype != torch.bool


def tool_position_bias(
    advantages: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    eligible: torch.Tensor,
    groups: torch.Tensor,
    delta: float = -2.0,
    k: float = 0.7,
) -> torch.Tensor:
    """Clipped tool-position bias ``clip(b_i, -k|A_i|, k|A_i|)``; 0 for ineligible completions.

    Args:
        advantages: (B,) float, advantages after baseline and normalization.
        positions: (B,) int, action tokens before the first tool call; -1 when there is none.
        lengths: (B,) int, action tokens of the completion (tool outputs excluded).
        eligible: (B,) bool, correct and has a tool call.
        groups: (B,) int, completions sharing an id are compared with each other.
        delta: bias scale; negative values favour earlier calls.
        k: clip factor relative to ``|A_i|``, so the bias never flips the advantage's sign when k <= 1.

    Returns:
        (B,) tensor in the dtype of ``advantages``.
    """
    _check_1d("advantages", advantages, None)
    size = advantages.numel()
    for name, tensor in (("positions", positions), ("lengths", lengths), ("eligible", eligible), ("groups", groups)):
        _check_1d(name, tensor, size)
    if not advantages.dtype.is_floating_point:
        raise TypeError(f"`advantages` must be a floating tensor, got {advantages.dtype}.")
    for name, tensor in (("positions", positions), ("lengths", lengths), ("groups", groups)):
        if not _is_integer(tensor):
            raise TypeError(f"`{name}` must be an integer tensor, got {tensor.dtype}.")
    if eligible.dtype != torch.bool:
        raise TypeError(f"`eligible` must be a bool tensor, got {eligible.dtype}.")
    if not math.isfinite(delta):
        raise ValueError(f"`delta` must be finite, got {delta}.")
    if not (math.isfinite(k) and k >= 0):
        raise ValueError(f"`k` must be finite and >= 0, got {k}.")
    if bool((lengths < 0).any()):
        raise ValueError("`lengths` must be >= 0.")
    # An eligible completion has a call, and the call's opener is itself made of action tokens.
    if bool((eligible & (positions < 0)).any()):
        raise ValueError("`positions` must be >= 0 wherever `eligible` is True (an eligible completion has a call).")
    if bool((eligible & (positions >= lengths)).any()):
        raise ValueError("`positions` must be < `lengths` wherever `eligible` is True.")

    # Low-precision advantages (bf16) would round the group means; compute in at least float32.
    work = torch.promote_types(advantages.dtype, torch.float32)
    if size == 0:
        return torch.zeros_like(advantages)
    _, group_index = torch.unique(groups, return_inverse=True)
    num_groups = int(group_index.max()) + 1
    e = eligible.to(work)
    p = positions.to(work) * e  # ineligible positions (-1 or stale) must not leak into the means
    length = lengths.to(work) * e
    count = torch.zeros(num_groups, dtype=work, device=advantages.device).index_add_(0, group_index, e)
    sum_p = torch.zeros_like(count).index_add_(0, group_index, p)
    sum_l = torch.zeros_like(count).index_add_(0, group_index, length)
    safe_count = count.clamp_min(1.0)
    mean_p = (sum_p / safe_count)[group_index]
    mean_l = (sum_l / safe_count)[group_index]
    # Validation makes mean_l >= 1 for eligible members; the guard keeps a zero-length group from producing NaN.
    raw = torch.where(
        eligible & (mean_l > 0), delta * (positions.to(work) - mean_p) / mean_l.clamp_min(1e-12), torch.zeros_like(e)
    )
    bound = k * advantages.to(work).abs()
    return torch.minimum(torch.maximum(raw, -bound), bound).to(advantages.dtype)


def tool_position_shaping(
    advantages: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    eligible: torch.Tensor,
    groups: torch.Tensor,
    delta: float = -2.0,
    k: float = 0.7,
) -> torch.Tensor:
    """Shaped advantages ``A + tool_position_bias(...)``; see the module docstring for the equation."""
    return advantages + tool_position_bias(advantages, positions, lengths, eligible, groups, delta=delta, k=k)


def shaping_stats(bias: torch.Tensor, eligible: torch.Tensor) -> dict[str, float]:
    """Logging summary of a bias from :func:`tool_position_bias`: eligible share, mean and max |bias|.

    Means are over eligible completions (NaN when none is eligible), so a batch with few eligible
    completions does not look like a weak bias.
    """
    eligible = eligible.bool()
    share = eligible.float().mean().item() if eligible.numel() else math.nan
    if not bool(eligible.any()):
        return {"eligible_frac": share, "bias_mean": math.nan, "bias_abs_mean": math.nan, "bias_abs_max": math.nan}
    selected = bias[eligible].float()
    return {
        "eligible_frac": share,
        "bias_mean": selected.mean().item(),
        "bias_abs_mean": selected.abs().mean().item(),
        "bias_abs_max": selected.abs().max().item(),
    }


class ShapingHook(Protocol):
    """Optional extra advantage adjustment, added after tool-position shaping.

    Returns a (B,) additive adjustment; all tensors are (B,) and aligned with ``completion_texts``.
    """

    def __call__(
        self,
        completion_texts: list[str],
        positions: torch.Tensor,
        lengths: torch.Tensor,
        num_calls: torch.Tensor,
        interactive_turns: torch.Tensor,
        advantages: torch.Tensor,
    ) -> torch.Tensor: ...


class InteractiveTurnBonus:
    """``bonus * min(interactive_turns, max_turns)`` for completions with positive advantage.

    Only positive-advantage completions get it, so interleaving reasoning and tool use is encouraged
    in answers that are already better than their baseline, never in failures.
    """

    def __init__(self, bonus: float = 0.1, max_turns: int = 3) -> None:
        if not math.isfinite(bonus):
            raise ValueError(f"`bonus` must be finite, got {bonus}.")
        if max_turns < 0:
            raise ValueError(f"`max_turns` must be >= 0, got {max_turns}.")
        self.bonus = bonus
        self.max_turns = max_turns

    def __call__(
        self,
        completion_texts: list[str],
        positions: torch.Tensor,
        lengths: torch.Tensor,
        num_calls: torch.Tensor,
        interactive_turns: torch.Tensor,
        advantages: torch.Tensor,
    ) -> torch.Tensor:
        turns = interactive_turns.clamp(0, self.max_turns).to(advantages.dtype)
        return torch.where(advantages > 0, self.bonus * turns, torch.zeros_like(advantages))


class CallablePenalty:
    """Wraps a user function returning a (B,) penalty; the adjustment is its negative."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn

    def __call__(
        self,
        completion_texts: list[str],
        positions: torch.Tensor,
        lengths: torch.Tensor,
        num_calls: torch.Tensor,
        interactive_turns: torch.Tensor,
        advantages: torch.Tensor,
    ) -> torch.Tensor:
        penalty = torch.as_tensor(
            self.fn(completion_texts, positions, lengths, num_calls, interactive_turns, advantages),
            dtype=advantages.dtype,
            device=advantages.device,
        )
        if penalty.shape != advantages.shape:
            raise ValueError(
                f"penalty function returned shape {tuple(penalty.shape)}, expected {tuple(advantages.shape)}."
            )
        return -penalty
