"""What sits between TRL's asynchronous `RolloutQueueDataset` (after its staleness drop) and its fixed-count batcher
when `AsyncASPOTrainer` scores on the trainer side: the samples of one optimizer step taken together, so TRL's
staleness check sees them all at the same model version, and handed to the trainer's scoring as one batch.

The trainer passes what these call (`drop`, `score`, `log_dropped_share`, `log_step`); nothing here reads a trainer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class RecordingQueue:
    """The rollout queue, remembering the last sample taken: TRL's dataset yields each kept sample right after
    taking it, so the sample behind a yielded item (its prompt, reward, `model_version`) is the last one taken."""

    def __init__(self, queue):
        self.queue = queue
        self.last = None

    def get(self, *args, **kwargs):
        self.last = self.queue.get(*args, **kwargs)
        return self.last

    def qsize(self) -> int:
        return self.queue.qsize()


class StepScoringDataset(torch.utils.data.IterableDataset):
    """Yields TRL's rollout items one optimizer step (`step_size` samples) at a time, each with the advantage
    `score(samples, context)` gives it. `drop(sample)`: whether the sample leaves before it counts (e.g. a group whose
    rewards are all equal under `filter_zero_variance_groups`, so the step fills with samples that carry a signal,
    DAPO's dynamic sampling); `log_dropped_share(share)` then receives each step's share of dropped samples.

    Whole groups. TRL's rollout worker puts a group's samples into the queue one after another, so a step of a fixed
    count may hold only part of a group, and group statistics over the step's members alone would differ from the
    whole group's (docs/design.md section 2). `context` therefore holds the step's groups' members outside the step:
    those of the step's first group yielded in earlier steps, and those of its last group read ahead (until the group
    holds `group_size` conversations, `conversation(sample)` naming a sample's, or another group begins), which are
    yielded in the next step. With `group_size` 1 there is no context (a group of one is complete)."""

    def __init__(
        self,
        dataset,
        recorder: RecordingQueue,
        step_size: int,
        score: Callable[[list, list], torch.Tensor],
        drop: Callable[[object], bool],
        log_dropped_share: Callable[[float], None] | None = None,
        group_size: int = 1,
        conversation: Callable[[object], object] | None = None,
    ):
        self.dataset = dataset
        self.recorder = recorder
        self.step_size = step_size
        self.score = score
        self.drop = drop
        self.log_dropped_share = log_dropped_share
        self.group_size = group_size
        self.conversation = conversation if conversation is not None else id
        self._dropped = 0

    def _kept(self):
        """`(item, sample)` of every sample `drop` keeps, counting the dropped ones."""
        for item in self.dataset:
            sample = self.recorder.last
            if self.drop(sample):
                self._dropped += 1
                continue
            yield item, sample

    def _read_ahead(self, kept, earlier: list, step: list, pending: list) -> list:
        """The pairs to read beyond the step so that its last group is whole: until the group holds `group_size`
        conversations (counting its members in `earlier`, the step and the already pending pairs), or another group
        begins."""
        group = step[-1][1].group_id
        if self.group_size <= 1 or any(sample.group_id != group for _, sample in pending):
            return []
        members = [*earlier, *(sample for _, sample in [*step, *pending])]
        conversations = {self.conversation(sample) for sample in members if sample.group_id == group}
        pulled = []
        while len(conversations) < self.group_size:
            pair = next(kept, None)
            if pair is None:
                break
            pulled.append(pair)
            if pair[1].group_id != group:
                break
            conversations.add(self.conversation(pair[1]))
        return pulled

    def __iter__(self):
        kept = self._kept()
        pending: list[tuple] = []  # (item, sample) read but not yet yielded, in queue order
        earlier: list = []  # the samples yielded so far of the last yielded step's last group
        while True:
            while len(pending) < self.step_size:
                pair = next(kept, None)
                if pair is None:
                    return
                pending.append(pair)
            step, pending = pending[: self.step_size], pending[self.step_size :]
            pending += self._read_ahead(kept, earlier, step, pending)
            samples = [sample for _, sample in step]
            first, last = samples[0].group_id, samples[-1].group_id
            context = []
            if self.group_size > 1:
                context = [sample for sample in earlier if sample.group_id == first]
                context += [sample for _, sample in leading_run(pending, last)]
            if self.log_dropped_share is not None:
                self.log_dropped_share(self._dropped / (self._dropped + self.step_size))
            self._dropped = 0
            advantages = self.score(samples, context)
            for (item, _), advantage in zip(step, advantages.tolist(), strict=True):
                yield {**item, "advantage": advantage}
            # A group spanning several steps keeps its members of every earlier step.
            earlier = [sample for sample in [*earlier, *samples] if sample.group_id == last]


def leading_run(pairs: list[tuple], group) -> list[tuple]:
    """The `(item, sample)` pairs at the start of `pairs` whose sample belongs to `group`."""
    run = []
    for pair in pairs:
        if pair[1].group_id != group:
            break
        run.append(pair)
    return run


class StepCallbackDataset(torch.utils.data.IterableDataset):
    """Yields the rollout items unchanged and calls `log_step(items)` on every `step_size` of them (one optimizer
    step's, with fixed-count batches): the asynchronous trainer's `tools/*` metrics, per step as the synchronous
    trainer logs them per round."""

    def __init__(self, dataset, step_size: int, log_step: Callable[[list[dict]], None]):
        self.dataset = dataset
        self.step_size = step_size
        self.log_step = log_step

    def __iter__(self):
        pending = []
        for item in self.dataset:
            pending.append(item)
            if len(pending) == self.step_size:
                self.log_step(pending)
                pending = []
            yield item


def completion_tokens(input_ids, completion_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout row from its first completion token: its ids and its completion mask (0 on tool outputs)."""
    mask = torch.as_tensor(completion_mask)
    start = int(mask.nonzero()[0]) if bool(mask.any()) else mask.numel()
    return torch.as_tensor(input_ids)[start:].long(), mask[start:].long()


def completion_batch(rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids, completion_mask)` rows as a right-padded batch laid out like TRL's synchronous one: completion
    ids, completion mask (1 on every real token, tool outputs included) and tool mask (0 on tool outputs)."""
    completions = [completion_tokens(input_ids, completion_mask) for input_ids, completion_mask in rows]
    width = max(1, max((len(ids) for ids, _ in completions), default=0))
    completion_ids = torch.zeros(len(rows), width, dtype=torch.long)
    real = torch.zeros(len(rows), width, dtype=torch.long)
    tool_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, (ids, action) in enumerate(completions):
        completion_ids[row, : len(ids)] = ids
        real[row, : len(ids)] = 1
        tool_mask[row, : len(ids)] = action
    return completion_ids, real, tool_mask


def completion_texts(tokenizer, samples) -> list[str]:
    """The decoded completions of rollout samples (tool outputs included), as TRL decodes completions."""
    rows = [completion_tokens(sample.input_ids, sample.completion_mask)[0] for sample in samples]
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in rows]
