"""SPO++'s rollout runtime (arXiv 2608.24870, Table 3; docs/design.md section 5): one request in flight per prompt,
and old-policy work drained at publish. The rollout worker's loop (`TrackedRolloutLoop` in
trl_aspo.infra.prompt_stream) asks a `DispatchControl` before each dispatch; the trainer holds and drains it around
a publish (`AsyncASPOTrainer._sync_weight`).

- **In flight per prompt** (`limit`): a prompt, keyed as the value tracker keys it (`dataset_prompt_keys`), is in
  flight from its dispatch until its whole trajectory (every turn and tool call) has been scored. A row whose key has
  `limit` requests in flight is not eligible; the loop dispatches the next eligible one.
- **Hold and drain**: while the trainer holds dispatch, the loop dispatches nothing; `drain` waits until every
  conversation already dispatched has finished generating, every turn included.

When no row may be dispatched, the loop parks the free slot in a *hold* (no request, no sample) that ends as soon as
one may (`may_dispatch` turns true), so the asyncio loop never blocks.

The state lives in shared-memory tensors, written by one side each (the loop: the in-flight counts and `active`;
the trainer: `held`), as `PromptPriorities` does. A dispatch announces itself (`active += n`) before it checks the
hold and backs off if held, while the trainer sets the hold before it reads `active`: whichever comes first, the
drain sees the dispatch or the dispatch sees the hold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


class DispatchControl:
    """What may be dispatched next, shared by the rollout worker's loop and the trainer.

    Args:
        row_keys: the value tracker's key of every dataset row, in dataset order (rows sharing a key share a count).
        limit: requests in flight per key (None: unlimited).
    """

    _HELD, _ACTIVE = 0, 1

    def __init__(self, row_keys: Sequence[str], limit: int | None = None):
        if len(row_keys) == 0:
            raise ValueError("`row_keys` must hold one tracker key per dataset row, got none.")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"`limit` must be an integer >= 1 or None, got {limit!r}.")
        self.limit = limit
        self.keys = list(dict.fromkeys(row_keys))
        index = {key: position for position, key in enumerate(self.keys)}
        self.key_of_row = torch.tensor([index[key] for key in row_keys], dtype=torch.long)
        self.inflight = torch.zeros(len(self.keys), dtype=torch.long).share_memory_()
        self._saturated = 0  # keys at the limit (the loop's own count: `may_dispatch` is polled by every hold)
        self._flags = torch.zeros(2, dtype=torch.long).share_memory_()

    def __len__(self) -> int:
        return len(self.key_of_row)

    # ---------------------------------------------------------------- the loop's side
    def eligible_rows(self) -> torch.Tensor:
        """A boolean mask of the rows that may be dispatched now by the per-prompt limit."""
        if self.limit is None:
            return torch.ones(len(self), dtype=torch.bool)
        return self.inflight[self.key_of_row] < self.limit

    def row_eligible(self, row: int) -> bool:
        """Whether dataset row `row` may be dispatched now by the per-prompt limit."""
        return self.limit is None or int(self.inflight[self.key_of_row[row]]) < self.limit

    def may_dispatch(self) -> bool:
        """Whether a row may be dispatched now: dispatch is not held and some prompt is below the limit."""
        return not self.held and self._saturated < len(self.keys)

    def try_dispatch(self, row: int, conversations: int) -> bool:
        """Announce `conversations` requests of dataset row `row`; False (and nothing recorded) if dispatch is held."""
        self._flags[self._ACTIVE] += conversations
        if self.held:
            self._flags[self._ACTIVE] -= conversations
            return False
        self._add(int(self.key_of_row[row]), conversations)
        return True

    def finished(self) -> None:
        """One announced conversation has finished generating (every turn and tool call)."""
        self._flags[self._ACTIVE] -= 1

    def scored(self, row: int, conversations: int) -> None:
        """The conversations of row `row` have been scored: they no longer count as in flight."""
        self._add(int(self.key_of_row[row]), -conversations)

    def _add(self, key: int, conversations: int) -> None:
        """Count `conversations` more (fewer) in flight for `key`, keeping the count of keys at the limit."""
        before = int(self.inflight[key])
        self.inflight[key] = before + conversations
        if self.limit is not None:
            self._saturated += (before + conversations >= self.limit) - (before >= self.limit)

    # ---------------------------------------------------------------- the trainer's side
    @property
    def held(self) -> bool:
        return bool(self._flags[self._HELD])

    @property
    def active(self) -> int:
        """Conversations dispatched and still generating."""
        return int(self._flags[self._ACTIVE])

    def hold(self) -> None:
        """Stop new dispatches (those already announced still run)."""
        self._flags[self._HELD] = 1

    def release(self) -> None:
        """Let dispatch go on."""
        self._flags[self._HELD] = 0

    def drain(self, timeout_s: float, poll_s: float = 0.005) -> None:
        """Wait until every dispatched conversation has finished generating (call it while holding). Raises
        `RuntimeError` after `timeout_s` seconds, naming `drain_on_publish`."""
        deadline = time.monotonic() + timeout_s
        while self.active > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"drain_on_publish=True: {self.active} conversation(s) dispatched under the old weights were "
                    f"still generating after {timeout_s:g}s, so the publish cannot wait for them; check the rollout "
                    "worker's health, or set drain_on_publish=False."
                )
            time.sleep(poll_s)
