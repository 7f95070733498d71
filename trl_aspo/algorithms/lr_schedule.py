"""Learning-rate schedules stepped once per generation round, as verl steps its scheduler once per rollout."""

from __future__ import annotations

from collections.abc import Callable


def per_generation_lr_lambda(lr_lambda: Callable[[int], float], steps_per_round: int) -> Callable[[int], float]:
    """The multiplier at optimizer step s: lr_lambda(s - s mod n), n = `steps_per_round` optimizer steps per round.

    Every step of round k = floor(s / n) takes the schedule's value at the round's first step k n. With
    `constant_with_warmup` over W = 10 n steps this is verl's constant warmup over 10 rollouts: multiplier k / 10 for
    round k < 10 (0 for the whole of round 0), 1 from step 10 n on."""
    if steps_per_round < 1:
        raise ValueError(f"`steps_per_round` must be a positive integer, got {steps_per_round}.")

    def stepped(step: int) -> float:
        return lr_lambda(step - step % steps_per_round)

    return stepped
