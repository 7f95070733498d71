"""Checks on the rollout samples that reach `AsyncASPOTrainer`, applied where the trainer reads the rollout queue
(TRL's and the local worker alike), before TRL's dataset, the scoring and the batcher see them.

The generator's log-probs are the old policy of the asynchronous loss (bypass mode: the ratio `pi_theta / pi_b`) and
the denominator of the decoupled correction (`rho = pi_prox / pi_b`). One bad value poisons a whole step: with the
correction off, one NaN, -inf or -1e30 log-prob made every weight NaN while the logged loss read 0.0; with
`token_truncate` and no upper bound one -inf weighted a token near 5e8; a positive log-prob (a probability above 1) was
accepted; a list shorter than `input_ids` ended in a raw `IndexError` in TRL's packing and a longer one was truncated
silently (issue 45). So, per sample (:func:`logprob_problem`):

- `len(old_log_probs) == len(input_ids)` (and `len(completion_mask) == len(input_ids)`);
- on completion tokens (`completion_mask` 1): finite, <= 0 and >= log of float32's smallest normal (about -87.34),
  below which `exp` leaves float32's normal range and the ratio's denominator is no longer a probability the trainer
  can represent.

A failing sample drops its whole group, since the other members' baseline (group mean and standard deviation) depends
on it (:class:`CheckedRolloutQueue`).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable

import torch

__all__ = ["MIN_LOG_PROB", "CheckedRolloutQueue", "logprob_problem"]

logger = logging.getLogger(__name__)

# log of float32's smallest normal number, 2**-126: about -87.3365.
MIN_LOG_PROB = math.log(torch.finfo(torch.float32).tiny)


def logprob_problem(input_ids, completion_mask, old_log_probs) -> tuple[int, str] | None:
    """The first position at which a sample's generator log-probs break the rule of the module docstring, with what is
    wrong there, or None when they keep it.

    Args:
        input_ids: (T,) the sample's token ids (prompt and completion).
        completion_mask: (T,) 1 on completion tokens the loss trains on, 0 on the prompt and on tool output.
        old_log_probs: (T,) the generator's log-prob of each token (read on completion tokens only).

    Returns:
        `(position, description)`: the index into `input_ids` (for a length mismatch, the first index one of the two
        lacks) and a sentence naming the value and the rule it breaks.
    """
    size, count = len(input_ids), len(old_log_probs)
    if len(completion_mask) != size:
        return min(size, len(completion_mask)), f"{len(completion_mask)} completion_mask entries for {size} input_ids"
    if count != size:
        return min(size, count), f"{count} generator log-probs (old_log_probs) for {size} input_ids"
    values = torch.as_tensor(old_log_probs, dtype=torch.float64).reshape(-1)
    completion = torch.as_tensor(completion_mask).reshape(-1).bool()
    bad = completion & ~(torch.isfinite(values) & (values <= 0) & (values >= MIN_LOG_PROB))
    if not bool(bad.any()):
        return None
    position = int(bad.nonzero()[0])
    value = float(values[position])
    if not math.isfinite(value):
        rule = "must be finite"
    elif value > 0:
        rule = "must be <= 0 (a log-probability; this is a probability above 1)"
    else:
        rule = f"must be >= {MIN_LOG_PROB:.2f} (log of float32's smallest normal)"
    return position, f"generator log-prob {value:.6g} at completion token {position} {rule}"


class CheckedRolloutQueue:
    """The rollout queue as the trainer reads it: `get` returns the samples of groups whose every sample passes
    :func:`logprob_problem`, in queue order, and drops the others whole.

    A rollout worker puts a group's samples into the queue one after another, so a group is held until it is complete
    (it holds `group_size` conversations, `conversation(sample)` naming a sample's, or a sample of another group
    arrives) and then released or dropped. A row that arrives for a group closed by its count (a conversation TRL split
    into several rows, arriving after the count was reached) follows its group when the group was dropped, and is
    otherwise checked alone and dropped alone.

    `drop_group(group_id)` is called once per dropped group (the trainer counts it and marks it consumed, so a resume
    does not regenerate it); the first drop is warned, naming the sample and the position, later ones are not.
    Anything else (`qsize`, ...) is the underlying queue's.
    """

    def __init__(
        self,
        queue,
        drop_group: Callable[[int], None],
        group_size: int = 1,
        conversation: Callable[[object], object] | None = None,
    ):
        self.queue = queue
        self.drop_group = drop_group
        self.group_size = group_size
        self.conversation = conversation if conversation is not None else id
        self._ready: collections.deque = collections.deque()
        self._held: list = []  # the samples of the group not complete yet
        self._problem: tuple | None = None  # (sample, position, description) of the held group's first bad sample
        self._counted: tuple | None = None  # (group_id, dropped) of the group last closed by its count
        self._warned = False

    def __getattr__(self, name):
        if name == "queue":  # not set yet (e.g. while unpickling): no underlying queue to delegate to
            raise AttributeError(name)
        return getattr(self.queue, name)

    def get(self, *args, **kwargs):
        """The next sample of a group that passed; blocks (and times out) as the underlying queue's `get`."""
        while not self._ready:
            self._take(self.queue.get(*args, **kwargs))
        return self._ready.popleft()

    def _take(self, sample) -> None:
        problem = logprob_problem(sample.input_ids, sample.completion_mask, sample.old_log_probs)
        if not self._held and self._counted is not None and sample.group_id == self._counted[0]:
            if self._counted[1]:
                return  # its group was dropped (and counted) already
            if problem is None:
                self._ready.append(sample)
            else:
                self._drop(sample.group_id, (sample, *problem), 1)
            return
        if self._held and sample.group_id != self._held[0].group_id:
            self._close()
        self._held.append(sample)
        if problem is not None and self._problem is None:
            self._problem = (sample, *problem)
        if len({self.conversation(member) for member in self._held}) >= self.group_size:
            self._counted = (sample.group_id, self._close())

    def _close(self) -> bool:
        """Release or drop the held group; whether it was dropped."""
        held, problem = self._held, self._problem
        self._held, self._problem = [], None
        if problem is None:
            self._ready.extend(held)
            return False
        self._drop(held[0].group_id, problem, len(held))
        return True

    def _drop(self, group_id, problem: tuple, size: int) -> None:
        sample, _, description = problem
        if not self._warned:
            logger.warning(
                f"Rollout sample of group {group_id} (model version {sample.model_version}, {len(sample.input_ids)} "
                f"tokens): {description}. Its group ({size} sample(s)) is dropped, since the others' baseline depends "
                "on it, and counted as consumed; further drops are counted in offpolicy/dropped_groups without a "
                "warning. The rollout worker's generator reports log-probs that are not those of a probability "
                "distribution in float32."
            )
            self._warned = True
        self.drop_group(group_id)
