"""Tool-call detection and tool-integration metrics for tool-position shaping.

Tool-position shaping (Lin & Xu 2025, "Understanding Tool-Integrated Reasoning", arXiv 2508.19201)
needs, per completion, ``p_i`` = action tokens before the first tool call and ``L_i`` = action tokens
of the completion, where action tokens are those the model generated (``completion_mask == 1`` and
``tool_mask == 1``; TRL's tool loop marks inserted tool-response tokens with ``tool_mask == 0``)::

    b_i = delta * (p_i - mean_{j in E} p_j) / mean_{j in E} L_j

Two detectors are provided:

* :func:`first_tool_call_positions` for TRL's native ``tools=``/``environment_factory=`` loop: it
  finds the call opener (e.g. the ``<tool_call>`` token sequence of Qwen2.5-style templates) among
  the action tokens of a padded TRL batch.
* :func:`regex_tool_call_positions` for tools embedded in text (e.g. fenced code blocks run by a
  custom rollout): a regex on the decoded completion, whose character offsets are mapped back to
  token indices.

Both also count calls and *interactive turns* (a call preceded by model text rather than opening
its turn), which :func:`tool_call_metrics` summarizes for logging.

**A call counts only when its tool ran** (``executed_only``, the one definition for shaping, the ``tools/*`` metrics
of both trainers and ``trl-aspo evaluate``): an opener counts when the next non-action tokens after it, with no other
opener between, are a tool-response span (real tokens with ``tool_mask`` 0; :func:`tool_response_follows`). Its
position is that opener's index among the action tokens. A bare opener the tool loop never executed (no parsable call,
a call cut off by the length limit, a tool round TRL rolled back as overlong, a call past
``max_tool_calling_iterations``) is model text, not a call; a call whose tool raised counts (its error is the
response). Parallel calls of one turn share one response span, so they count as one call.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Collection, Sequence
from typing import Any

import torch

__all__ = [
    "ToolCallCounter",
    "first_tool_call_positions",
    "regex_tool_call_positions",
    "resolve_call_token_ids",
    "is_model_text",
    "resolve_whitespace_token_ids",
    "tool_call_metrics",
    "tool_response_follows",
]

DetectionResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def resolve_call_token_ids(tokenizer: Any, opener: str = "<tool_call>") -> list[int]:
    """Token ids of the tool-call opener, without special tokens added by the tokenizer.

    Qwen2.5 registers ``<tool_call>`` as one added token, so the result is a single id there. With a
    plain BPE the opener may be several tokens; those must also be how the model emits it in context.
    """
    ids = list(tokenizer.encode(opener, add_special_tokens=False))
    if not ids:
        raise ValueError(f"`opener` {opener!r} encodes to no tokens.")
    return ids


def is_model_text(text: str) -> bool:
    """Whether text the model wrote before a call makes the call interactive: anything but whitespace.

    The one rule for interactive turns in training (token ids via :func:`resolve_whitespace_token_ids`, the regex
    path via its decoded text) and in evaluation (the parsed turn's content)."""
    return bool(text.strip())


def resolve_whitespace_token_ids(tokenizer: Any) -> set[int]:
    """Ids of vocabulary tokens that decode to whitespace only (or nothing), for interactive-turn detection."""
    size = len(tokenizer)
    pieces = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
    return {i for i, piece in enumerate(pieces) if not is_model_text(piece)}


def tool_response_follows(action: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: whether the first non-action token after each position is a tool-response token.

    ``action`` (B, T) bool marks the tokens the model generated, ``response`` (B, T) bool the tool-response tokens the
    tool loop inserted (real tokens with ``tool_mask`` 0); every other token (padding, the end of the row) ends the
    completion. A call written at a position ran exactly when this is True there (module docstring)."""
    batch, width = action.shape
    index = torch.arange(width, device=action.device).expand(batch, width)
    # The next non-action column at or after each column: a reverse running minimum of the non-action columns.
    non_action = torch.where(action, torch.full_like(index, width), index)
    following = non_action.flip(1).cummin(dim=1).values.flip(1)
    padded = torch.cat([response.bool(), torch.zeros(batch, 1, dtype=torch.bool, device=action.device)], dim=1)
    return padded.gather(1, following)


def first_tool_call_positions(
    completion_ids: torch.Tensor,
    tool_mask: torch.Tensor | None,
    completion_mask: torch.Tensor,
    call_token_ids: Sequence[int],
    whitespace_token_ids: Collection[int] = (),
    *,
    executed_only: bool = True,
) -> DetectionResult:
    """Locate tool calls in a padded TRL batch by the opener's token sequence.

    Args:
        completion_ids: (B, T) completion token ids (right-padded), as in TRL's batch dict.
        tool_mask: (B, T) 1 for model tokens, 0 for inserted tool-response tokens; None without tools.
        completion_mask: (B, T) 1 for real completion tokens, 0 for padding.
        call_token_ids: the opener's token ids (see :func:`resolve_call_token_ids`); matched as a
            contiguous run of action tokens within one assistant turn.
        whitespace_token_ids: tokens that do not count as model text for interactive turns.
        executed_only: count only openers whose tool ran (module docstring): the last opener of a turn
            followed by a tool response. False, or no ``tool_mask`` (nothing marks tool output, so nothing
            tells whether a call ran), counts every opener as written.

    Returns:
        ``(positions, lengths, num_calls, interactive_turns)``, each (B,) long:

        * positions: action tokens before the first counted opener; -1 when there is none.
        * lengths: action tokens in the completion.
        * num_calls: counted openers among action tokens (openers are assumed not to overlap
          themselves, which holds for tag-like openers).
        * interactive_turns: assistant turns with a counted call whose first opener is preceded by
          non-whitespace model text in the same turn. A turn starts at the beginning of the completion
          or after a tool response (a ``tool_mask`` 0 -> 1 transition). Parallel calls of one turn
          count once, because the body of the first call is not reasoning text.
    """
    if completion_ids.dim() != 2:
        raise ValueError(f"`completion_ids` must be 2-D (B, T), got shape {tuple(completion_ids.shape)}.")
    if completion_mask.shape != completion_ids.shape:
        raise ValueError(
            f"`completion_mask` shape {tuple(completion_mask.shape)} != `completion_ids` shape "
            f"{tuple(completion_ids.shape)}."
        )
    if tool_mask is not None and tool_mask.shape != completion_ids.shape:
        raise ValueError(
            f"`tool_mask` shape {tuple(tool_mask.shape)} != `completion_ids` shape {tuple(completion_ids.shape)}."
        )
    call = [int(i) for i in call_token_ids]
    if not call:
        raise ValueError("`call_token_ids` must not be empty.")

    device = completion_ids.device
    batch, width = completion_ids.shape
    tools = torch.ones_like(completion_mask, dtype=torch.bool) if tool_mask is None else tool_mask.bool()
    action = completion_mask.bool() & tools
    lengths = action.sum(dim=1)

    # A turn starts after every tool response: number the turns by counting 0 -> 1 transitions.
    previous = torch.cat([tools[:, :1], tools[:, :-1]], dim=1)
    turn = (tools & ~previous).long().cumsum(dim=1)
    ws = torch.tensor(sorted(int(i) for i in whitespace_token_ids), dtype=completion_ids.dtype, device=device)
    is_text = action & ~torch.isin(completion_ids, ws)

    # Compact each row's action tokens to the left (stable order) so that an index in the compacted row
    # is exactly the number of action tokens before it.
    order = torch.sort((~action).to(torch.uint8), dim=1, stable=True).indices
    ids_c = completion_ids.gather(1, order)
    turn_c = turn.gather(1, order)
    text_c = is_text.gather(1, order).long()
    index = torch.arange(width, device=device).expand(batch, width)
    valid_c = index < lengths.unsqueeze(1)

    n = len(call)
    match = torch.zeros(batch, width, dtype=torch.bool, device=device)
    if width >= n:
        pattern = torch.tensor(call, dtype=completion_ids.dtype, device=device)
        windows = ids_c.unfold(1, n, 1)  # (B, T - n + 1, n)
        # Compaction puts valid tokens first, so a valid last token means the whole window is valid; a
        # window across a tool response (different turns) is not a call the model wrote.
        match[:, : width - n + 1] = (
            (windows == pattern).all(dim=-1) & valid_c[:, n - 1 :] & (turn_c[:, : width - n + 1] == turn_c[:, n - 1 :])
        )
    counted = match
    ran = torch.ones_like(match)
    if executed_only and tool_mask is not None:
        response = completion_mask.bool() & ~tools
        ran = tool_response_follows(action, response).gather(1, order)
        # Openers of one turn have no tool response between them: only the turn's last one can have run.
        later = match.flip(1).long().cumsum(dim=1).flip(1) - match.long()
        turn_end = torch.where(
            torch.cat([turn_c[:, 1:] != turn_c[:, :-1], torch.ones_like(turn_c[:, :1], dtype=torch.bool)], dim=1),
            index,
            torch.full_like(index, width),
        )
        end_index = turn_end.flip(1).cummin(dim=1).values.flip(1).clamp_max(width - 1)
        later_in_turn = later - later.gather(1, end_index)
        counted = match & ran & (later_in_turn == 0)
    num_calls = counted.sum(dim=1)
    positions = torch.where(counted.any(dim=1), counted.long().argmax(dim=1), torch.full_like(lengths, -1))

    # Turn ids are non-decreasing along the compacted row; the running max of turn-start indices gives
    # each token its turn's first index, where exclusive cumulative counts are read as offsets.
    turn_start = (index == 0) | (turn_c != torch.cat([turn_c[:, :1], turn_c[:, :-1]], dim=1))
    start_index = torch.where(turn_start, index, torch.zeros_like(index)).cummax(dim=1).values
    text_before = text_c.cumsum(dim=1) - text_c
    calls_before = match.long().cumsum(dim=1) - match.long()
    first_in_turn = match & (calls_before == calls_before.gather(1, start_index))
    after_text = text_before > text_before.gather(1, start_index)
    interactive_turns = (first_in_turn & after_text & ran).sum(dim=1)
    return positions, lengths, num_calls, interactive_turns


def _token_char_ends(ids: list[int], tokenizer: Any, skip_special_tokens: bool) -> tuple[str, list[int]]:
    """Decoded text of ``ids`` and, per token, the end offset of its characters in that text.

    Fast path: decode every token on its own and accumulate lengths; valid when the pieces concatenate
    to the full decode (true for byte-level BPE on whole characters). Otherwise (a character split over
    byte tokens, or a decoder that strips a leading space at the start) decode incrementally with a few
    tokens of left context, as streaming detokenizers do, and attribute a character spread over several
    tokens to the first of them: a call starting at that character starts at that token.
    """
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    ends: list[int] = []
    pieces = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=skip_special_tokens)
    if "".join(pieces) == text:
        total = 0
        for piece in pieces:
            total += len(piece)
            ends.append(total)
        return text, ends

    # Left context in whole-character runs: enough for decoders whose output for a token depends on the
    # tokens before it (a sentencepiece space stripped only at the start), while staying linear in T.
    context = 4
    ends = []
    out = ""
    run_start = 0  # first token whose characters are not emitted yet
    clean: list[int] = [0]  # token indices where the emitted text ends on a whole character
    for t in range(len(ids)):
        left = clean[max(0, len(clean) - 1 - context)]
        prefix = tokenizer.decode(ids[left:run_start], skip_special_tokens=skip_special_tokens)
        full = tokenizer.decode(ids[left : t + 1], skip_special_tokens=skip_special_tokens)
        if full.endswith("\ufffd") and t + 1 < len(ids):
            continue  # incomplete character: keep accumulating bytes
        out += full[len(prefix) :]
        ends.extend([len(out)] * (t + 1 - run_start))
        run_start = t + 1
        clean.append(run_start)
    if out != text:
        raise ValueError("Could not align the decoded completion with its tokens; offsets cannot be mapped.")
    return text, ends


def regex_tool_call_positions(
    completion_texts: Sequence[str] | None,
    completion_ids: torch.Tensor | Sequence[Sequence[int]],
    tokenizer: Any,
    pattern: str | re.Pattern[str],
    tool_mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
    *,
    completion_mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
    skip_special_tokens: bool = True,
    executed_only: bool = True,
) -> DetectionResult:
    """Locate text-embedded tool calls (e.g. fenced ```python blocks) with a regex on the decoded text.

    Each regex match that starts in a model-generated token is a call; its start character is mapped
    back to the token that contains it (see :func:`_token_char_ends`).

    Args:
        completion_texts: the decoded completions to match on, or None to decode ``completion_ids``.
            When given, each must equal ``tokenizer.decode(ids, skip_special_tokens=...)`` of its row
            (what TRL's ``batch_decode`` produces), otherwise offsets cannot be mapped (ValueError).
        completion_ids: (B, T) tensor (with ``completion_mask`` for padding) or a list of id lists.
        tokenizer: the tokenizer that produced the ids.
        pattern: regex for a call; the match start is the call's first character.
        tool_mask: like ``completion_ids``; 0 marks inserted tool output (not counted, never a call).
        completion_mask: like ``completion_ids``; 0 marks padding, which is dropped before decoding.
        skip_special_tokens: decoding option; TRL decodes completions with True.
        executed_only: count only matches whose tool ran, by the rule of :func:`first_tool_call_positions`
            on the match's first token (tool output, ``tool_mask`` 0, must follow before the next match).
            False, or no ``tool_mask``, counts every match as written: text-embedded tools run by a reward
            function after the rollout leave no tool output in the completion to tell by.

    Returns:
        ``(positions, lengths, num_calls, interactive_turns)`` like :func:`first_tool_call_positions`;
        here a counted call is interactive when non-whitespace model text lies between the end of the
        previous match (or the start of the completion) and its start.
    """
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern
    rows = completion_ids.tolist() if isinstance(completion_ids, torch.Tensor) else [list(r) for r in completion_ids]
    masks = _rows_like(completion_mask, rows, "completion_mask")
    tools = _rows_like(tool_mask, rows, "tool_mask")
    if completion_texts is not None and len(completion_texts) != len(rows):
        raise ValueError(f"`completion_texts` has {len(completion_texts)} entries, expected {len(rows)}.")

    out = torch.zeros(4, len(rows), dtype=torch.long)
    for b, row in enumerate(rows):
        keep = [t for t in range(len(row)) if masks[b][t]]
        ids = [int(row[t]) for t in keep]
        action = [bool(tools[b][t]) for t in keep]
        text, ends = _token_char_ends(ids, tokenizer, skip_special_tokens)
        if completion_texts is not None and completion_texts[b] != text:
            raise ValueError(
                f"`completion_texts[{b}]` differs from the decoded `completion_ids[{b}]`; pass the text decoded "
                f"with skip_special_tokens={skip_special_tokens} or None."
            )
        found_calls = []  # (token, start, end) of each match starting in a model-generated token
        for found in regex.finditer(text):
            token = bisect.bisect_right(ends, found.start())
            if token < len(ids) and action[token]:  # not an empty match at the very end, nor inside tool output
                found_calls.append((token, found.start(), found.end()))
        # Tool output is every kept token outside the action tokens (padding was dropped above).
        output_tokens = [t for t in range(len(ids)) if not action[t]]
        position, calls, interactive, previous_end = -1, 0, 0, 0
        for index, (token, start, end) in enumerate(found_calls):
            if executed_only and tool_mask is not None and not _ran(token, output_tokens, found_calls[index + 1 :]):
                previous_end = end
                continue
            if position < 0:
                position = sum(action[:token])
            calls += 1
            interactive += _has_model_text(text, ends, action, previous_end, start)
            previous_end = end
        out[:, b] = torch.tensor([position, sum(action), calls, interactive])
    positions, lengths, num_calls, interactive_turns = out.unbind(0)
    return positions, lengths, num_calls, interactive_turns


def _ran(token: int, output_tokens: list[int], later_calls: list[tuple[int, int, int]]) -> bool:
    """Whether tool output follows the call starting in `token` before the next call (`later_calls`, in order)."""
    following = bisect.bisect_right(output_tokens, token)
    if following == len(output_tokens):
        return False
    return not later_calls or later_calls[0][0] > output_tokens[following]


def _rows_like(
    mask: torch.Tensor | Sequence[Sequence[int]] | None, rows: list[list[int]], name: str
) -> list[list[int]]:
    if mask is None:
        return [[1] * len(r) for r in rows]
    values = mask.tolist() if isinstance(mask, torch.Tensor) else [list(m) for m in mask]
    if len(values) != len(rows) or any(len(m) != len(r) for m, r in zip(values, rows, strict=True)):
        raise ValueError(f"`{name}` must have the same shape as `completion_ids`.")
    return values


def _has_model_text(text: str, ends: list[int], action: list[bool], begin: int, end: int) -> bool:
    """Whether characters ``text[begin:end]`` of model-generated tokens include non-whitespace."""
    token = bisect.bisect_right(ends, begin)
    while token < len(ends) and begin < end:
        chunk_end = min(ends[token], end)
        if action[token] and is_model_text(text[begin:chunk_end]):
            return True
        begin = max(begin, chunk_end)
        token += 1
    return False


def tool_call_metrics(
    positions: torch.Tensor, lengths: torch.Tensor, num_calls: torch.Tensor, interactive_turns: torch.Tensor
) -> dict[str, float]:
    """Tool-integration metrics over a (gathered) batch.

    Keys: ``tool_call_frac`` (completions with a call), ``calls_per_completion``,
    ``first_call_position`` and ``first_call_rel_position`` (position / length; both over completions
    with a call, NaN when none has one), ``interactive_turns`` (per completion).
    """
    if positions.numel() == 0:
        return dict.fromkeys(
            (
                "tool_call_frac",
                "calls_per_completion",
                "first_call_position",
                "first_call_rel_position",
                "interactive_turns",
            ),
            math.nan,
        )
    has_call = positions >= 0
    if bool(has_call.any()):
        first = positions[has_call].double()
        mean_position = first.mean().item()
        mean_relative = (first / lengths[has_call].double().clamp_min(1.0)).mean().item()
    else:
        mean_position = mean_relative = math.nan
    return {
        "tool_call_frac": has_call.double().mean().item(),
        "calls_per_completion": num_calls.double().mean().item(),
        "first_call_position": mean_position,
        "first_call_rel_position": mean_relative,
        "interactive_turns": interactive_turns.double().mean().item(),
    }


class ToolCallCounter:
    """Per completion of a padded batch, (B, 4) long: action tokens before the first tool call (-1 for none), action
    tokens, calls and interactive turns; by `pattern` on the decoded text when given
    (:func:`regex_tool_call_positions`), else by the `opener`'s tokens (:func:`first_tool_call_positions`). Both
    trainers and `trl-aspo evaluate` count with it: the synchronous trainer on TRL's batch, the asynchronous one on
    its samples laid out from their first completion token, evaluation on its own tool loop's completions.

    `tools_run`: whether the rollouts run tools and insert their output (TRL's `tools=`, `environment_factory=`, a
    `rollout_func` with an `env_mask`). Then only calls whose tool ran count (module docstring); otherwise, and for a
    batch without a `tool_mask`, nothing tells whether a call ran and every call written counts (the asynchronous
    layout always has one, so there `tools_run` decides)."""

    def __init__(self, tokenizer: Any, opener: str, pattern: str | None = None, tools_run: bool = True) -> None:
        self.tokenizer = tokenizer
        self.pattern = pattern
        self.tools_run = tools_run
        self.call_token_ids = resolve_call_token_ids(tokenizer, opener) if pattern is None else []
        # Whitespace-only text before a call is not model text (as in evaluation): resolved on first use.
        self._whitespace_token_ids: set[int] | None = None

    def __call__(
        self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tool_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`completion_ids`, `completion_mask` (0: padding) and `tool_mask` (0: inserted tool output; None without
        tools): (B, T), right-padded, as in TRL's batch."""
        if self.pattern is not None:
            stats = regex_tool_call_positions(
                None,
                completion_ids,
                self.tokenizer,
                self.pattern,
                tool_mask,
                completion_mask=completion_mask,
                executed_only=self.tools_run,
            )
        else:
            if self._whitespace_token_ids is None:
                self._whitespace_token_ids = resolve_whitespace_token_ids(self.tokenizer)
            stats = first_tool_call_positions(
                completion_ids,
                tool_mask,
                completion_mask,
                self.call_token_ids,
                self._whitespace_token_ids,
                executed_only=self.tools_run,
            )
        return torch.stack(stats, dim=1)
