"""`first_tool_call_positions` (every opener written) on random batches against a plain Python reference written
from its documented rules (issue 43 item 2): many seeds and shapes, openers of 1 to 3 tokens, with and without a
tool mask, random whitespace sets, rows shorter than the opener, all-padding rows."""

from __future__ import annotations

import random

import pytest
import torch

from trl_aspo.algorithms.tool_metrics import first_tool_call_positions


def reference(ids: list[int], tools: list[int] | None, mask: list[int], opener: list[int], ws: set[int]):
    """The documented rules, one row at a time in plain Python:

    - action tokens: mask 1 and tool 1; a turn begins at the start and at every tool 0 -> 1 transition;
    - a call: the opener as consecutive action tokens, all in one turn;
    - position: action tokens before the first call (-1 without one); calls: every occurrence;
    - interactive turns: turns whose first call has a non-whitespace action token of its turn before it."""
    tools = [1] * len(ids) if tools is None else tools
    action: list[tuple[int, int]] = []  # (token, turn) of each action token, in order
    turn = 0
    for index, (token, tool, keep) in enumerate(zip(ids, tools, mask, strict=True)):
        if index > 0 and tool == 1 and tools[index - 1] == 0:
            turn += 1
        if keep == 1 and tool == 1:
            action.append((token, turn))
    starts = [
        start
        for start in range(len(action) - len(opener) + 1)
        if [token for token, _ in action[start : start + len(opener)]] == opener
        and len({turn for _, turn in action[start : start + len(opener)]}) == 1
    ]
    interactive = 0
    for turn_id in sorted({action[start][1] for start in starts}):
        first = min(start for start in starts if action[start][1] == turn_id)
        interactive += any(t == turn_id and token not in ws for token, t in action[:first])
    return (starts[0] if starts else -1), len(action), len(starts), interactive


@pytest.mark.parametrize("seed", range(12))
def test_detection_equals_the_python_reference_on_random_batches(seed):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    rows, width = rng.randint(1, 24), rng.randint(1, 48)
    vocabulary = rng.randint(2, 6)  # a small vocabulary: openers occur often, also back to back
    opener = [rng.randrange(vocabulary) for _ in range(rng.randint(1, 3))]
    ws = set(rng.sample(range(vocabulary), rng.randint(0, vocabulary - 1)))
    ids = torch.randint(0, vocabulary, (rows, width), generator=generator)
    tool_mask = None if seed % 3 == 0 else (torch.rand(rows, width, generator=generator) < 0.75).long()
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    completion_mask = (torch.arange(width) < lengths.unsqueeze(1)).long()

    # Every opener written (executed_only=False): which of them ran is tests/unit/test_tool_metrics.py's subject.
    result = first_tool_call_positions(ids, tool_mask, completion_mask, opener, ws, executed_only=False)
    for row in range(rows):
        expected = reference(
            ids[row].tolist(),
            None if tool_mask is None else tool_mask[row].tolist(),
            completion_mask[row].tolist(),
            opener,
            ws,
        )
        assert tuple(part[row].item() for part in result) == expected, (row, opener, ws)
