"""Prioritized prompt sampling for single-stream training (SPO++, arXiv 2608.24870; cf. SPO, arXiv 2509.13232).

Each prompt's priority is its Bernoulli standard deviation under the tracker value plus a floor::

    w_x = sqrt(v_x * (1 - v_x)) + epsilon          (epsilon = 0.05)

so prompts the policy always or never solves (no learning signal) are drawn rarely but never starved. Each
round draws its ``batch_size`` prompts *without replacement* with probability proportional to ``w``.
:func:`effective_num_prompts` (``(sum w)^2 / sum w^2``) summarizes how concentrated the priorities are.

:class:`PrioritizedRepeatSampler` is a drop-in for TRL's ``RepeatSampler``: same output layout (each index
repeated ``mini_repeat_count`` times consecutively, ``batch_size`` unique indices per batch, each batch
repeated ``repeat_count`` times, ``len(data) // batch_size`` batches per epoch), only the choice of indices
differs. Every rank must yield the same indices: the draw for round ``r`` uses a fresh ``torch.Generator``
seeded from ``(seed, r)``, so ranks that hold the same weights draw the same batch. The trainer must
therefore set identical weights on every rank (computed from the gathered tracker state).

Deferred draws. Used as a plain sampler, a round is drawn when the data loader pulls its first index. Data
loaders read ahead (accelerate prefetches one batch, the Trainer gathers a whole accumulation window, worker
processes prefetch ``prefetch_factor`` batches each), so such a draw would miss the outcomes of the last rounds.
With ``deferred=True`` the sampler only yields placeholder slots in the same layout (round positions
``0 .. batch_size - 1``) and the caller draws each round with :meth:`draw` when it dispatches that round: the
draw of round ``r`` is then a pure function of ``(seed, r, weights at dispatch)``, whatever the loader read
ahead or skipped, so a run resumed at round ``r`` draws what the uninterrupted run drew (as TRL's
``RepeatSampler``, a pure function of seed and position). :class:`trl_aspo.trainers.aspo_trainer.ASPOTrainer` draws
this way.

Incremental weights. :meth:`update_values` recomputes the weights of the given rows only; under both trackers a
prompt's value changes only when an outcome of it is observed (SPO++ ages the prior and every outcome of a prompt
by the same factor ``rho^(q - e)``, which cancels in ``alpha / (alpha + beta)``), so a round costs O(rows
observed) instead of O(dataset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


def priority_weights(values: torch.Tensor, epsilon: float = 0.05) -> torch.Tensor:
    """``sqrt(v (1 - v)) + epsilon`` per prompt, for values ``v`` in [0, 1]."""
    values = torch.as_tensor(values)
    if not values.is_floating_point():
        values = values.to(torch.float64)
    if not torch.isfinite(values).all() or (values < 0).any() or (values > 1).any():
        raise ValueError("`values` must be finite and lie in [0, 1].")
    if not epsilon >= 0:
        raise ValueError(f"`epsilon` must be non-negative, got {epsilon!r}.")
    # clamp: v*(1-v) can round to a tiny negative number for v within an ulp of 0 or 1.
    return (values * (1 - values)).clamp(min=0).sqrt() + epsilon


def effective_num_prompts(weights: torch.Tensor) -> torch.Tensor:
    """Kish effective sample size ``(sum w)^2 / sum w^2``: N for uniform weights, 1 when one prompt dominates."""
    weights = torch.as_tensor(weights, dtype=torch.float64)
    if (weights < 0).any() or not (weights > 0).any():
        raise ValueError("`weights` must be non-negative with at least one positive entry.")
    return weights.sum().square() / weights.square().sum()


def _round_seed(seed: int, round_index: int) -> int:
    """Mix (seed, round) into one 63-bit generator seed; identical on every rank and across restarts."""
    return (seed * 0x9E3779B97F4A7C15 + round_index * 0xBF58476D1CE4E5B9 + 1) % (2**63)


class PrioritizedRepeatSampler(Sampler[int]):
    """TRL ``RepeatSampler`` layout with batches drawn without replacement in proportion to priority weights.

    Args:
        data_source_len: number of prompts in the dataset.
        mini_repeat_count: consecutive repeats of each index (TRL: ``num_generations``).
        batch_size: unique indices per batch (round).
        repeat_count: repeats of each whole batch (TRL: iterations over one generation batch).
        seed: base seed; the draw of round ``r`` depends only on ``(seed, r)`` and the weights.
        epsilon: priority floor used by :meth:`set_values`.
        weights: initial weights, a tensor of length ``data_source_len`` or a zero-argument callable returning one
            (read at each draw); uniform when omitted.
        deferred: yield placeholder slots (positions within the round) instead of drawing while iterating; the
            caller draws each round with ``draw(round_index)`` when it dispatches it.

    Without ``deferred``, weights are read when a batch is drawn, i.e. when the data loader pulls that batch's first
    index; the round counter persists across epochs and is saved by :meth:`state_dict`.
    """

    def __init__(
        self,
        data_source_len: int,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        seed: int = 0,
        epsilon: float = 0.05,
        weights: torch.Tensor | Callable[[], torch.Tensor] | None = None,
        deferred: bool = False,
    ) -> None:
        for name, value in (
            ("data_source_len", data_source_len),
            ("mini_repeat_count", mini_repeat_count),
            ("batch_size", batch_size),
            ("repeat_count", repeat_count),
        ):
            if not value >= 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if batch_size > data_source_len:
            raise ValueError(f"`batch_size` ({batch_size}) exceeds the dataset size ({data_source_len}).")
        self.num_samples = data_source_len
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.seed = seed
        self.epsilon = epsilon
        self.deferred = deferred
        self.round = 0
        self.weights = torch.ones(data_source_len, dtype=torch.float64) if weights is None else weights

    @property
    def weights(self) -> torch.Tensor | Callable[[], torch.Tensor]:
        """Priority weights (length = dataset size), or the callable that supplies them at each draw."""
        return self._weights

    @weights.setter
    def weights(self, weights: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        self._weights = weights if callable(weights) else self._check_weights(weights)

    def set_values(self, values: torch.Tensor) -> None:
        """Set the weights from tracker values (length = dataset size) via :func:`priority_weights`."""
        self.weights = priority_weights(values, self.epsilon)

    def update_values(self, rows: list[int] | torch.Tensor, values: torch.Tensor) -> None:
        """Set the weights of ``rows`` only from their tracker values (the other rows keep theirs)."""
        if callable(self._weights):
            raise ValueError("`update_values` needs stored weights, not a weights callable.")
        rows = torch.as_tensor(rows, dtype=torch.long)
        if rows.dim() != 1 or len(rows) != len(values):
            raise ValueError(f"`rows` ({tuple(rows.shape)}) and `values` ({len(values)}) must match one to one.")
        if len(rows) and not (int(rows.min()) >= 0 and int(rows.max()) < self.num_samples):
            raise ValueError(f"`rows` must lie in [0, {self.num_samples}).")
        # In place, without re-checking the other rows: new weights are finite and >= epsilon, so the weights stay
        # valid unless a zero epsilon leaves fewer than batch_size positive entries.
        self._weights[rows] = priority_weights(values, self.epsilon).to(self._weights)
        if self.epsilon == 0:
            self._check_weights(self._weights)

    def _check_weights(self, weights: torch.Tensor) -> torch.Tensor:
        weights = torch.as_tensor(weights, dtype=torch.float64).detach().cpu().clone()
        if weights.shape != (self.num_samples,):
            raise ValueError(f"`weights` must have shape ({self.num_samples},), got {tuple(weights.shape)}.")
        if not torch.isfinite(weights).all() or (weights < 0).any():
            raise ValueError("`weights` must be finite and non-negative.")
        # Drawing without replacement needs at least batch_size prompts with positive probability.
        if int((weights > 0).sum()) < self.batch_size:
            raise ValueError(f"`weights` need at least batch_size={self.batch_size} positive entries.")
        return weights

    def draw(self, round_index: int | None = None) -> list[int]:
        """Draw the ``batch_size`` distinct indices of round ``round_index`` with the current weights.

        The result depends only on ``(seed, round_index, weights)``. Without ``round_index`` the sampler's own
        counter gives the round; either way the counter moves past the drawn round."""
        if round_index is None:
            round_index = self.round
        if isinstance(round_index, bool) or int(round_index) != round_index or round_index < 0:
            raise ValueError(f"`round_index` must be a non-negative integer, got {round_index!r}.")
        weights = self._check_weights(self._weights()) if callable(self._weights) else self._weights
        generator = torch.Generator().manual_seed(_round_seed(self.seed, int(round_index)))
        self.round = int(round_index) + 1
        return torch.multinomial(weights, self.batch_size, replacement=False, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.num_samples // self.batch_size):
            chunk = list(range(self.batch_size)) if self.deferred else self.draw()
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        return (self.num_samples // self.batch_size) * self.batch_size * self.mini_repeat_count * self.repeat_count

    def state_dict(self) -> dict[str, Any]:
        """Round counter (the round after the last drawn), seed and (unless supplied by a callable) the weights."""
        weights = None if callable(self._weights) else self._weights.tolist()
        return {"round": self.round, "seed": self.seed, "weights": weights}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the round counter, seed and stored weights (a weights callable in use is kept)."""
        self.round = int(state_dict["round"])
        self.seed = int(state_dict["seed"])
        if state_dict["weights"] is not None:
            self.weights = torch.tensor(state_dict["weights"], dtype=torch.float64)
