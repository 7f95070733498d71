"""A non-finite optimizer step never reaches the weights (issue 43 item 4), in both trainers, every rank alike.

A step is non-finite when the loss of one of its micro-batches, on any rank, or the global gradient norm (all ranks,
after the all-reduce of DDP or the reduce-scatter of FSDP) is NaN or inf. Then, before `optimizer.step()`:

- by default the run stops with `NonFiniteStepError`, raised on every rank, naming the step, the raw loss values and
  where the value appeared: a non-finite tensor of the batch (generator log-probs, advantages: "from the batch, not
  the loss"), else a non-finite loss term (the KL term when its logged value is not finite, else the policy loss,
  named by `loss_type`), else the first parameter whose gradient is not finite (each rank checks its own shard,
  before clipping, which would spread a NaN norm over every gradient). Weights and optimizer state are untouched, so
  no later checkpoint holds non-finite weights; `trl-aspo train` prints the message and exits 1.
- with `skip_nonfinite_grad_steps`, the step is skipped, as the ASPO reference (Archer2.0, on verl) skips it: every
  gradient is set to None before `optimizer.step()`, and torch's optimizers leave a parameter without a gradient
  untouched (no moment update, no weight decay); the learning-rate schedule still advances, as verl's does. A
  warning gives the raw values; `optim/nonfinite_loss_steps` counts the skipped steps so far and
  `optim/skipped_nonfinite_step` logs their share of the logging window.

HF's `logging_nan_inf_filter` still keeps a non-finite loss out of the logged `loss`; the raw value is in the message.

DeepSpeed takes its optimizer step inside `accelerator.backward`: there the loss is checked in `compute_loss`,
before the backward pass, with the flag all-reduced across ranks, so a non-finite loss on any rank stops every rank
with the weights untouched. A non-finite gradient from a finite loss is not caught under DeepSpeed (its fp16 loss
scaler skips overflowing steps itself), and `skip_nonfinite_grad_steps` is refused there.
"""

from __future__ import annotations

import math
import warnings

import torch
from accelerate.utils import gather_object


class NonFiniteStepError(RuntimeError):
    """An optimizer step whose loss or gradient is not finite, refused before it reached the weights."""


class NonFiniteStepGuardMixin:
    """`compute_loss` (records each micro-batch's loss and whether its batch tensors are finite; under DeepSpeed,
    checks the loss before the backward pass), `_clip_grad_norm` (per-parameter gradient norms before clipping, to
    name the parameter), `_get_grad_norm` (the last hook before `optimizer.step()` in `Trainer`'s loop, and the one
    that holds the norm) and `train` (refuses the skip option under DeepSpeed before the first step), for both
    trainers."""

    def train(self, *args, **kwargs):
        if getattr(self.args, "skip_nonfinite_grad_steps", False) and self.is_deepspeed_enabled:
            raise ValueError(
                "skip_nonfinite_grad_steps=True cannot act under DeepSpeed, which steps its optimizer inside the "
                "backward pass, before the gradient norm is known: set it to False, or launch with FSDP2 "
                "(configs/accelerate/fsdp2.yaml) or DDP."
            )
        self._step_records, self._gradient_norms, self._nonfinite_steps = [], None, 0
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------------------------------- what a step holds
    def compute_loss(self, model, inputs, *args, **kwargs):
        result = super().compute_loss(model, inputs, *args, **kwargs)
        # The trainer's model, not the callable handed in (a wrapper, or a stand-in forward in a probe).
        if not self.model.training:
            return result
        loss = result[0] if isinstance(result, tuple) else result
        fields = [
            (name, value)
            for name, value in inputs.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel()
        ]
        # Flags stay on the device: read only when the step is checked, with the norm (no added synchronization).
        flags = torch.stack([~torch.isfinite(value).all() for _, value in fields]) if fields else None
        # compute_loss may be called outside train() (a test, a user's probe): the records start with it.
        records = self.__dict__.setdefault("_step_records", [])
        records.append((loss.detach().float().reshape(-1)[:1], [name for name, _ in fields], flags))
        if self.is_deepspeed_enabled:
            self._check_before_deepspeed_backward()
        return result

    def _check_before_deepspeed_backward(self) -> None:
        loss = self._step_records[-1][0]
        bad = (~torch.isfinite(loss)).float()
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        if bad.item():
            self._refuse("before DeepSpeed's backward pass, which steps the optimizer")

    def _clip_grad_norm(self, model):
        self._note_gradient_norms(model)
        return super()._clip_grad_norm(model)

    def _note_gradient_norms(self, model) -> None:
        """Each parameter's local gradient norm, on the device, before clipping rescales every gradient by the total
        norm (a NaN total makes every gradient NaN, hiding where it began)."""
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        local = [grad.to_local() if hasattr(grad, "to_local") else grad for _, grad in named]
        norms = torch._foreach_norm(local) if local else []
        self._gradient_norms = ([name for name, _ in named], torch.stack(norms) if norms else None)

    # -------------------------------------------------------------------------------------------------- the check
    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and not self.is_deepspeed_enabled:
            self._note_gradient_norms(model)
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if self.is_deepspeed_enabled:
            self._step_records = []
            return grad_norm
        device = self.accelerator.device
        records = getattr(self, "_step_records", [])
        losses = torch.cat([loss.to(device) for loss, _, _ in records]) if records else None
        bad_loss = (~torch.isfinite(losses)).any().float() if losses is not None else torch.zeros((), device=device)
        if self.accelerator.num_processes > 1:
            bad_loss = self.accelerator.reduce(bad_loss, reduction="sum")
        # One host synchronization per optimizer step reads the global norm and every rank's loss flag together.
        norm = grad_norm if isinstance(grad_norm, torch.Tensor) else torch.tensor(float(grad_norm))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2 may hand a DTensor
        norm_value, bad = torch.stack([norm.detach().float().to(device).reshape(()), bad_loss.reshape(())]).tolist()
        finite = math.isfinite(norm_value) and not bad
        skipping = getattr(self.args, "skip_nonfinite_grad_steps", False)
        if skipping:
            self._metrics["train"]["optim/skipped_nonfinite_step"].append(0.0 if finite else 1.0)
        if not finite:
            message = self._nonfinite_message(model, norm_value)
            model.zero_grad(set_to_none=True)
            if not skipping:
                self._step_records = []
                raise NonFiniteStepError(
                    f"{message} The step was not applied: weights and optimizer state are as after step "
                    f"{self.state.global_step}, and no checkpoint holds non-finite weights. Find the cause there, or "
                    "set skip_nonfinite_grad_steps=True to skip such steps."
                )
            self._nonfinite_steps += 1
            warnings.warn(
                f"{message} The step is skipped (skip_nonfinite_grad_steps=True): weights and optimizer state "
                "unchanged.",
                RuntimeWarning,
                stacklevel=2,
            )
        if skipping:
            # A running count: one value per logging window, which TRL's mean leaves as it is.
            self._metrics["train"]["optim/nonfinite_loss_steps"] = [float(self._nonfinite_steps)]
        self._step_records = []
        return grad_norm

    def _refuse(self, where: str) -> None:
        message = self._nonfinite_message(self.model, None, where)
        self._step_records = []
        raise NonFiniteStepError(
            f"{message} The step was not applied: weights and optimizer state are as after step "
            f"{self.state.global_step}, and no checkpoint holds non-finite weights."
        )

    def _nonfinite_message(self, model, grad_norm: float | None, checked: str | None = None) -> str:
        """'Optimizer step N: ...', with every rank's raw losses and where its non-finite value appeared (gathered:
        every rank is here together, as the flag and the norm they checked are global)."""
        losses = [value for loss, _, _ in self._step_records for value in loss.tolist()]
        found = {"losses": losses, "where": self._where(model, losses)}
        ranks = gather_object([found]) if self.accelerator.num_processes > 1 else [found]
        parts = []
        for rank, seen in enumerate(ranks):
            shown = ", ".join(f"{value:g}" for value in seen["losses"])
            prefix = f"rank {rank}: " if len(ranks) > 1 else ""
            parts.append(f"{prefix}loss {shown or 'not computed'} ({seen['where']})")
        norm = "" if grad_norm is None else f"; gradient norm {grad_norm:g}"
        at = f" (checked {checked})" if checked else ""
        return f"Optimizer step {self.state.global_step + 1}{at}: non-finite values: {'; '.join(parts)}{norm}."

    def _where(self, model, losses: list[float]) -> str:
        for _, names, flags in self._step_records:
            if flags is not None and flags.any():
                bad = [name for name, flag in zip(names, flags.tolist(), strict=True) if flag]
                return f"from the batch, not the loss: {', '.join(bad)} not finite"
        if any(not math.isfinite(value) for value in losses):
            kl = self._metrics["train"].get("kl") or []
            if kl and not math.isfinite(kl[-1]):
                return f"in the KL term (beta={getattr(self.args, 'beta', None)}, last logged kl {kl[-1]})"
            return f"in the policy loss (loss_type={self.args.loss_type!r})"
        if self._gradient_norms is not None and self._gradient_norms[1] is not None:
            names, norms = self._gradient_norms
            for name, norm in zip(names, norms.tolist(), strict=True):
                if not math.isfinite(norm):
                    return f"the loss is finite; first non-finite gradient on this rank's shard: {name}"
        return "the loss and this rank's gradients are finite; another rank's are not"
