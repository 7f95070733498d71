"""`skip_nonfinite_grad_steps`: an optimizer step whose gradient norm is not finite is skipped, as the ASPO reference
(Archer2.0, on verl) skips it: one batch whose loss or gradient overflowed must not write NaN into the weights or the
optimizer's moments.

The gradient norm is the global one (all ranks, after TRL's/accelerate's all-reduce or FSDP's reduce-scatter), so every
rank takes the same decision. Skipping = every gradient set to None before `optimizer.step()`: torch's optimizers leave
a parameter without a gradient untouched (no moment update, no weight decay). The learning-rate schedule still
advances, as verl's does (it steps once per rollout whatever the step did). DeepSpeed takes its optimizer step inside
`accelerator.backward`, before the norm is known here, so the option is refused under DeepSpeed.
"""

from __future__ import annotations

import math
import warnings


class NonFiniteStepGuardMixin:
    """`_get_grad_norm` (the last hook before `optimizer.step()` in `Trainer`'s loop, and the one that holds the norm)
    and `train` (refuses the option under DeepSpeed before the first step), for both trainers."""

    def train(self, *args, **kwargs):
        if getattr(self.args, "skip_nonfinite_grad_steps", False) and self.is_deepspeed_enabled:
            raise ValueError(
                "skip_nonfinite_grad_steps=True cannot act under DeepSpeed, which steps its optimizer inside the "
                "backward pass, before the gradient norm is known: set it to False, or launch with FSDP2 "
                "(configs/accelerate/fsdp2.yaml) or DDP."
            )
        return super().train(*args, **kwargs)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if not getattr(self.args, "skip_nonfinite_grad_steps", False):
            return grad_norm
        finite = math.isfinite(float(grad_norm))
        self._metrics["train"]["optim/skipped_nonfinite_step"].append(0.0 if finite else 1.0)
        if not finite:
            model.zero_grad(set_to_none=True)
            warnings.warn(
                f"Optimizer step {self.state.global_step + 1}: the gradient norm is {float(grad_norm)}; the step is "
                "skipped (skip_nonfinite_grad_steps=True): weights and optimizer state unchanged.",
                RuntimeWarning,
                stacklevel=2,
            )
        return grad_norm
