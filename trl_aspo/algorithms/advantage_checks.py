"""The last check on the advantages before the loss: a non-finite one would silently turn every weight into NaN."""

from __future__ import annotations

import torch


class NonFiniteAdvantageError(ValueError, ArithmeticError):
    """Raised when an advantage the loss would receive is NaN or beyond float32."""


def check_finite_advantages(advantages: torch.Tensor, sources: dict) -> torch.Tensor:
    """Return `advantages` (per sample) if every one is finite in float32, the precision of the loss; else raise.

    `sources` names what fed them: a per-sample tensor (a reward, the tool statistics) is shown at the first
    offending samples, anything else (a config field's value) as it is. A NaN advantage makes the loss NaN (logged
    as 0.0 by TRL's nan-aware means) and every weight NaN after one step, so the run stops here, where the cause is
    still known."""
    finite = torch.isfinite(advantages.detach().float())
    if bool(finite.all()):
        return advantages
    bad = (~finite).nonzero().flatten()[:3].tolist()
    shown = ", ".join(f"sample {index}: {advantages[index].item()!r}" for index in bad)
    inputs = []
    for name, value in sources.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and len(value) == len(advantages):
            inputs.append(f"{name}[{bad[0]}]={value[bad[0]].tolist()!r}")
        else:
            inputs.append(f"{name}={value!r}")
    raise NonFiniteAdvantageError(
        f"{int((~finite).sum())} of {len(advantages)} advantages are not finite in float32 ({shown}), so the loss "
        f"would be NaN. They were computed from: {'; '.join(inputs)}. Keep every reward and every custom shaping "
        "callable finite and within float32."
    )


def advantage_sources(args, rewards: dict[str, torch.Tensor]) -> dict:
    """The inputs of the advantage for `check_finite_advantages`: per-sample `rewards` (name -> (B,)) and the
    config fields that turned them into advantages."""
    names = ["advantage_estimator", "advantage_normalization"]
    if args.tool_shaping:
        names += ["tool_shaping_delta", "tool_shaping_k", "tool_shaping_interactive_bonus", "tool_shaping_penalty"]
    return {**rewards, **{f"{type(args).__name__}.{name}": getattr(args, name) for name in names}}
