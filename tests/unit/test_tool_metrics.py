"""Tests for tool-call detection and tool-integration metrics (synthetic batches, a tiny local BPE)."""

import math
import re

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from trl_aspo.algorithms.shaping import tool_position_bias
from trl_aspo.algorithms.tool_metrics import (
    ToolCallCounter,
    _token_char_ends,
    first_tool_call_positions,
    regex_tool_call_positions,
    resolve_call_token_ids,
    resolve_whitespace_token_ids,
    tool_call_metrics,
)
from trl_aspo.infra.step_batches import completion_batch

OPENER = [7, 8]  # a two-token call opener
WS = {3}  # a whitespace token


def _batch(rows):
    """Right-pad (ids, tool_mask) rows like TRL: pad id 0, tool_mask padded with 1, completion_mask 0."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    tool_mask = torch.ones(len(rows), width, dtype=torch.long)
    completion_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (row_ids, row_tools) in enumerate(rows):
        ids[b, : len(row_ids)] = torch.tensor(row_ids)
        tool_mask[b, : len(row_ids)] = torch.tensor(row_tools)
        completion_mask[b, : len(row_ids)] = 1
    return {"completion_ids": ids, "tool_mask": tool_mask, "completion_mask": completion_mask}


SYNTHETIC = [
    # text 5 6, call, tool output 20-22, new turn: whitespace then a second call.
    ([5, 6, 7, 8, 9, 10, 20, 21, 22, 3, 7, 8, 11], [1] * 6 + [0] * 3 + [1] * 4),
    # 7 not followed by 8, and 8 alone: no call.
    ([5, 7, 9, 8, 6], [1] * 5),
    # call opening the completion; then an opener split by a tool response is not a call.
    ([7, 8, 9, 7, 30, 31, 8, 9], [1, 1, 1, 1, 0, 0, 1, 1]),
    # two parallel calls in one turn after text: one interactive turn.
    ([9, 7, 8, 1, 7, 8, 2], [1] * 7),
    # openers inside tool output (tool_mask 0) are not calls; padding follows.
    ([5, 7, 8, 8, 7, 8], [1, 0, 0, 1, 1, 1]),
]
# positions, lengths, num_calls, interactive_turns, worked out by hand.
EXPECTED = [(2, 10, 2, 1), (-1, 5, 0, 0), (0, 6, 1, 0), (1, 7, 2, 1), (2, 4, 1, 1)]


def test_first_tool_call_positions_synthetic():
    batch = _batch(SYNTHETIC)
    result = first_tool_call_positions(**batch, call_token_ids=OPENER, whitespace_token_ids=WS, executed_only=False)
    for got, column in zip(result, zip(*EXPECTED, strict=True), strict=True):
        assert got.dtype == torch.long
        assert got.tolist() == list(column)


def test_whitespace_default_counts_every_token_as_text():
    # Row 0's second turn starts with the whitespace token 3: without WS it makes the call interactive.
    batch = _batch(SYNTHETIC[:1])
    *_, interactive = first_tool_call_positions(**batch, call_token_ids=OPENER, executed_only=False)
    assert interactive.tolist() == [2]


def test_padding_equal_to_opener_is_ignored():
    batch = _batch([([5, 6], [1, 1]), ([5, 6, 9, 9], [1] * 4)])
    batch["completion_ids"][0, 2:] = torch.tensor(OPENER)  # garbage under completion_mask 0
    positions, lengths, num_calls, _ = first_tool_call_positions(**batch, call_token_ids=OPENER)
    assert positions.tolist() == [-1, -1] and lengths.tolist() == [2, 4] and num_calls.tolist() == [0, 0]


def test_tool_mask_none_and_single_token_opener():
    ids = torch.tensor([[4, 4, 9, 4], [1, 2, 3, 5]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    positions, lengths, num_calls, interactive = first_tool_call_positions(ids, None, mask, [4], executed_only=False)
    assert positions.tolist() == [0, -1]
    assert lengths.tolist() == [4, 3]
    assert num_calls.tolist() == [3, 0]
    assert interactive.tolist() == [0, 0]  # one turn, whose first call opens it


def test_opener_longer_than_completion():
    positions, lengths, num_calls, _ = first_tool_call_positions(
        torch.tensor([[7]]), torch.tensor([[1]]), torch.tensor([[1]]), [7, 8, 9]
    )
    assert (positions.item(), lengths.item(), num_calls.item()) == (-1, 1, 0)


def _reference_detection(ids, tools, mask, opener, ws, executed_only):
    """Per-sample loop: action tokens with their turn ids and columns, then a scan for the opener; with
    `executed_only`, a match counts when the first non-action column after it is a tool response (a real token with
    tool_mask 0) and no other match starts before that column."""
    tokens, turn, previous = [], 0, tools[0]
    for column, (token, tool, keep) in enumerate(zip(ids, tools, mask, strict=True)):
        turn += int(tool == 1 and previous == 0)
        previous = tool
        if keep and tool:
            tokens.append((token, turn, column))
    n, matches = len(opener), []
    for j in range(len(tokens) - n + 1):
        window = tokens[j : j + n]
        if [t for t, _, _ in window] == opener and len({u for _, u, _ in window}) == 1:
            matches.append(j)
    calls = matches
    if executed_only:
        calls = []
        for k, j in enumerate(matches):
            column = tokens[j][2]
            after = next((c for c in range(column + 1, len(ids)) if not (mask[c] and tools[c])), len(ids))
            response = after < len(ids) and mask[after] and not tools[after]
            if response and not any(tokens[m][2] < after for m in matches[k + 1 :]):
                calls.append(j)
    seen_turns, interactive = set(), 0
    for j in matches:
        turn_id = tokens[j][1]
        if turn_id not in seen_turns:
            seen_turns.add(turn_id)
            has_call = any(tokens[c][1] == turn_id for c in calls)
            interactive += has_call and any(u == turn_id and t not in ws for t, u, _ in tokens[:j])
    return (calls[0] if calls else -1), len(tokens), len(calls), interactive


@pytest.mark.parametrize("executed_only", [True, False])
def test_first_tool_call_positions_matches_reference_on_random_batches(executed_only):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (64, 40), generator=generator)
    tool_mask = (torch.rand(64, 40, generator=generator) < 0.8).long()
    lengths = torch.randint(0, 41, (64,), generator=generator)
    completion_mask = (torch.arange(40) < lengths.unsqueeze(1)).long()
    # Dense enough that rows have calls, calls followed by tool output and calls that are not.
    ids[:, ::5] = OPENER[0]
    ids[:, 1::5] = OPENER[1]
    result = first_tool_call_positions(ids, tool_mask, completion_mask, OPENER, WS, executed_only=executed_only)
    for b in range(64):
        expected = _reference_detection(
            ids[b].tolist(), tool_mask[b].tolist(), completion_mask[b].tolist(), OPENER, WS, executed_only
        )
        assert tuple(r[b].item() for r in result) == expected, b
    assert int(result[2].sum()) > 0, "no counted call: the comparison would be vacuous"


def test_first_tool_call_positions_bad_input():
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="completion_mask"):
        first_tool_call_positions(ids, None, torch.ones(2, 4), OPENER)
    with pytest.raises(ValueError, match="tool_mask"):
        first_tool_call_positions(ids, torch.ones(3, 3), torch.ones(2, 3), OPENER)
    with pytest.raises(ValueError, match="completion_ids"):
        first_tool_call_positions(ids[0], None, torch.ones(3), OPENER)
    with pytest.raises(ValueError, match="call_token_ids"):
        first_tool_call_positions(ids, None, torch.ones(2, 3), [])


def test_tool_call_metrics():
    metrics = tool_call_metrics(_l([2, -1, 0, 5]), _l([10, 8, 4, 20]), _l([2, 0, 1, 3]), _l([1, 0, 0, 2]))
    assert metrics["tool_call_frac"] == pytest.approx(0.75)
    assert metrics["calls_per_completion"] == pytest.approx(1.5)
    assert metrics["first_call_position"] == pytest.approx(7 / 3)
    assert metrics["first_call_rel_position"] == pytest.approx((0.2 + 0.0 + 0.25) / 3)
    assert metrics["interactive_turns"] == pytest.approx(0.75)
    none = tool_call_metrics(_l([-1, -1]), _l([3, 4]), _l([0, 0]), _l([0, 0]))
    assert none["tool_call_frac"] == 0.0 and math.isnan(none["first_call_position"])


def _l(values):
    return torch.tensor(values, dtype=torch.long)


# --- text-embedded tools on a real (tiny, locally trained) byte-level BPE tokenizer ---

CORPUS = [
    "Let me compute this.\n```python\nprint(2 + 3)\n```\n",
    "```output\n5\n```\nSo the answer is 5.",
    "Plan first. Next step. Hi there.\n<tool_call>\n{}\n</tool_call>",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    model.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>")


CODE = re.compile(r"```python\n.*?```", re.DOTALL)


def _segments(tokenizer, parts):
    """Encode (text, is_model) segments separately, as a rollout concatenates them, into ids and tool mask."""
    ids, tools = [], []
    for text, is_model in parts:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        ids += encoded
        tools += [int(is_model)] * len(encoded)
    return ids, tools


def test_regex_positions_with_tool_output(tokenizer):
    prefix = tokenizer.encode("Let me compute this.\n", add_special_tokens=False)
    parts = [
        ("Let me compute this.\n", True),
        ("```python\nprint(2 + 3)\n```\n", True),
        ("```output\n5\n```\n", False),
        ("So the answer is 5.", True),
    ]
    ids, tools = _segments(tokenizer, parts)
    texts = tokenizer.batch_decode([ids], skip_special_tokens=True)
    positions, lengths, num_calls, interactive = regex_tool_call_positions(texts, [ids], tokenizer, CODE, [tools])
    assert positions.tolist() == [len(prefix)]
    assert lengths.tolist() == [sum(tools)]
    assert num_calls.tolist() == [1] and interactive.tolist() == [1]


def test_regex_interactive_turns_and_matches_in_tool_output(tokenizer):
    parts = [
        ("Plan first.\n", True),
        ("```python\na\n```\n", True),
        ("```output\n```python\nfake\n```\n```\n", False),  # a pattern match inside tool output: ignored
        ("\n", True),
        ("```python\nb\n```\n", True),  # only whitespace model text since the previous call
        ("```output\n1\n```\n", False),
        ("Next step.\n", True),
        ("```python\nc\n```", True),
    ]
    ids, tools = _segments(tokenizer, parts)
    positions, lengths, num_calls, interactive = regex_tool_call_positions(
        None, [ids], tokenizer, CODE, [tools], executed_only=False
    )
    assert positions.tolist() == [len(tokenizer.encode("Plan first.\n", add_special_tokens=False))]
    assert lengths.tolist() == [sum(tools)]
    assert num_calls.tolist() == [3]
    assert interactive.tolist() == [2]


def test_regex_padded_tensor_batch_and_no_call(tokenizer):
    rows = [
        _segments(tokenizer, [("Hi there.\n", True), ("```python\nx\n```", True)]),
        _segments(tokenizer, [("So the answer is 5.", True)]),
    ]
    batch = _batch(rows)
    batch["completion_ids"][batch["completion_mask"] == 0] = tokenizer.pad_token_id
    texts = tokenizer.batch_decode([ids for ids, _ in rows], skip_special_tokens=True)
    positions, lengths, num_calls, interactive = regex_tool_call_positions(
        texts,
        batch["completion_ids"],
        tokenizer,
        r"```python",
        batch["tool_mask"],
        completion_mask=batch["completion_mask"],
        executed_only=False,
    )
    assert positions.tolist() == [len(tokenizer.encode("Hi there.\n", add_special_tokens=False)), -1]
    assert lengths.tolist() == [len(rows[0][0]), len(rows[1][0])]
    assert num_calls.tolist() == [1, 0] and interactive.tolist() == [1, 0]


def test_regex_characters_split_over_byte_tokens(tokenizer):
    # Emoji and accented letters are not in the tiny vocabulary: each is several byte tokens that decode
    # to U+FFFD one by one, so the per-token fast path cannot be used.
    prefix = "Hi 🙂 café\n"
    ids, tools = _segments(tokenizer, [(prefix, True), ("```python\nprint(2 + 3)\n```", True)])
    text = tokenizer.decode(ids)
    assert "".join(tokenizer.batch_decode([[i] for i in ids])) != text
    decoded, ends = _token_char_ends(ids, tokenizer, True)
    assert decoded == text and ends[-1] == len(text) and ends == sorted(ends)
    positions, _, num_calls, _ = regex_tool_call_positions([text], [ids], tokenizer, CODE, executed_only=False)
    assert positions.tolist() == [len(tokenizer.encode(prefix, add_special_tokens=False))]
    assert num_calls.tolist() == [1]
    # A match starting at a multi-token character starts at that character's first token.
    head = len(tokenizer.encode("Hi ", add_special_tokens=False))
    positions, *_ = regex_tool_call_positions(None, [ids], tokenizer, "🙂", executed_only=False)
    assert positions.tolist() == [head]


def test_regex_bad_input(tokenizer):
    ids = tokenizer.encode("Hi there.", add_special_tokens=False)
    with pytest.raises(ValueError, match="completion_texts"):
        regex_tool_call_positions(["something else"], [ids], tokenizer, CODE)
    with pytest.raises(ValueError, match="completion_texts"):
        regex_tool_call_positions(["a", "b"], [ids], tokenizer, CODE)
    with pytest.raises(ValueError, match="tool_mask"):
        regex_tool_call_positions(None, [ids], tokenizer, CODE, [[1]])


def test_resolve_token_ids(tokenizer):
    opener = resolve_call_token_ids(tokenizer, "<tool_call>")
    assert tokenizer.decode(opener) == "<tool_call>"
    with pytest.raises(ValueError, match="opener"):
        resolve_call_token_ids(tokenizer, "")
    whitespace = resolve_whitespace_token_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("Ċ") in whitespace  # byte-level "\n"
    assert not whitespace & set(tokenizer.encode("Plan", add_special_tokens=False))


def test_detection_on_a_tokenized_tool_turn(tokenizer):
    # The TRL layout with a multi-token opener: model turn, tool response (tool_mask 0), next model turn.
    parts = [
        ("Plan first.\n", True),
        ("<tool_call>\n{}\n</tool_call>", True),
        ("\n<tool_response>\n5\n</tool_response>\n", False),
        ("<tool_call>\n{}\n</tool_call>", True),
    ]
    ids, tools = _segments(tokenizer, parts)
    batch = _batch([(ids, tools)])
    opener = resolve_call_token_ids(tokenizer)
    result = first_tool_call_positions(
        **batch,
        call_token_ids=opener,
        whitespace_token_ids=resolve_whitespace_token_ids(tokenizer),
        executed_only=False,
    )
    assert len(opener) > 1
    head = len(tokenizer.encode("Plan first.\n", add_special_tokens=False))
    assert [r.item() for r in result] == [head, sum(tools), 2, 1]


def test_regex_with_a_decoder_that_strips_leading_spaces():
    # Sentencepiece-style Metaspace: single tokens decode without their leading space, so the per-token
    # pieces do not concatenate to the text and offsets come from decoding with left context.
    model = Tokenizer(models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"])
    model.train_from_iterator(["Let me compute this now. ```python print``` ok"] * 10, trainer=trainer)
    metaspace = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    ids = metaspace.encode("Let me compute ```python print``` ok", add_special_tokens=False)
    text, ends = _token_char_ends(ids, metaspace, True)
    assert text == "Let me compute ```python print``` ok" and ends[-1] == len(text)
    assert "".join(metaspace.batch_decode([[i] for i in ids])) != text
    expected = next(t for t, token in enumerate(metaspace.convert_ids_to_tokens(ids)) if "```" in token)
    positions, lengths, num_calls, interactive = regex_tool_call_positions(
        [text], [ids], metaspace, r"```python", executed_only=False
    )
    assert positions.tolist() == [expected] and num_calls.tolist() == [1] and interactive.tolist() == [1]


# --- issue 45 item 5: only calls whose tool ran count (OPENER 7 8; tool responses 20-22 under tool_mask 0) ---

RAN = {
    # A bare opener the tool loop never executed: the completion ends after it.
    "bare opener": (([5, 7, 8, 6], [1] * 4), (-1, 4, 0, 0)),
    # A bare opener, then a real call in the same turn: only the turn's last opener ran (at action index 3).
    "bare then real, one turn": (([7, 8, 5, 7, 8, 9, 20, 21, 6], [1] * 6 + [0, 0] + [1]), (3, 7, 1, 0)),
    # A bare opener before the real call of each of two turns: the calls at action indices 4 and 7 + 3.
    "bare then real, two turns": (
        ([5, 7, 8, 6, 7, 8, 9, 20, 21, 7, 8, 5, 7, 8, 9, 22, 6], [1] * 7 + [0, 0] + [1] * 6 + [0] + [1]),
        (4, 14, 2, 1),
    ),
    # A real call, then a bare opener in the next turn, which ends the completion.
    "real then bare": (([7, 8, 9, 20, 5, 7, 8, 6], [1, 1, 1, 0, 1, 1, 1, 1]), (0, 7, 1, 0)),
    # A call cut off by the length limit: padding follows, no response.
    "truncated call": (([5, 7, 8, 9, 9], [1] * 5), (-1, 5, 0, 0)),
    # A second call whose tool round TRL rolled back as overlong: the completion ends on it.
    "overlong rollback": (([7, 8, 9, 20, 21, 5, 7, 8, 9], [1, 1, 1, 0, 0, 1, 1, 1, 1]), (0, 7, 1, 0)),
    # A tool that raised: its error is the response, so the call ran.
    "raising tool": (([7, 8, 9, 22, 6], [1, 1, 1, 0, 1]), (0, 4, 1, 0)),
    # Two calls in two turns, the first after model text (interactive).
    "two calls": (([5, 7, 8, 9, 20, 7, 8, 9, 21, 6], [1, 1, 1, 1, 0, 1, 1, 1, 0, 1]), (1, 8, 2, 1)),
    # Parallel calls of one turn share one response span: one call, at the turn's last opener.
    "parallel calls": (([7, 8, 9, 7, 8, 9, 20, 21, 6], [1] * 6 + [0, 0] + [1]), (3, 7, 1, 0)),
}


def test_only_calls_whose_tool_ran_count():
    batch = _batch([rows for rows, _ in RAN.values()])
    result = first_tool_call_positions(**batch, call_token_ids=OPENER, whitespace_token_ids=WS)
    got = list(zip(*(r.tolist() for r in result), strict=True))
    assert dict(zip(RAN, got, strict=True)) == {name: expected for name, (_, expected) in RAN.items()}


def test_counter_counts_the_asynchronous_layout_like_the_synchronous_one():
    """The asynchronous trainer's samples (prompt, then completion_mask 0 on tool responses) give the same counts."""
    rows = [([1, 2, 3, *ids], [0, 0, 0, *tools]) for (ids, tools), _ in RAN.values()]
    counter = ToolCallCounter(_OpenerTokenizer(), "<open>")
    counter._whitespace_token_ids = WS
    stats = counter(*completion_batch(rows))
    assert [tuple(row) for row in stats.tolist()] == [expected for _, expected in RAN.values()]


class _OpenerTokenizer:
    """Encodes the opener as OPENER; enough for ToolCallCounter's opener path."""

    def encode(self, text, add_special_tokens=False):
        return list(OPENER)


def test_tools_run_false_or_no_tool_mask_counts_calls_as_written():
    (ids, tools), _ = RAN["bare opener"]
    batch = _batch([(ids, tools)])
    counter = ToolCallCounter(_OpenerTokenizer(), "<open>", tools_run=False)
    counter._whitespace_token_ids = WS
    assert counter(**batch).tolist() == [[1, 4, 1, 1]]
    running = ToolCallCounter(_OpenerTokenizer(), "<open>")
    running._whitespace_token_ids = WS
    assert running(batch["completion_ids"], batch["completion_mask"], None).tolist() == [[1, 4, 1, 1]]
    assert running(**batch).tolist() == [[-1, 4, 0, 0]]


def test_bare_opener_gets_no_early_call_bonus():
    """The issue's hack: a correct completion writing a bare opener first was 'calling' at position 0 and got the
    largest early-call bonus against a real call at position 6 (delta -2, k 0.7). Counted by the tool that ran, only
    the real call is eligible, alone in its group, so neither gets a bias (on main: +0.7 |A| and -0.7 |A|)."""
    bare = [7, 8, *[5] * 7, 3]  # opener at 0, no call ran: 10 action tokens
    real = [5] * 6 + [7, 8, 9, 20, 21, 6]  # opener at action index 6, response, answer: 10 action tokens
    batch = _batch([(bare, [1] * 10), (real, [1] * 9 + [0, 0] + [1])])
    positions, lengths, _, _ = first_tool_call_positions(**batch, call_token_ids=OPENER)
    assert positions.tolist() == [-1, 6] and lengths.tolist() == [10, 10]
    advantages = torch.tensor([0.816, 0.816])
    eligible = torch.tensor([True, True]) & (positions >= 0)
    bias = tool_position_bias(advantages, positions, lengths, eligible, torch.zeros(2, dtype=torch.long))
    assert bias.tolist() == [0.0, 0.0]
    # What main did (both "called"): mean position 3, mean length 10, b = -2 (p - 3) / 10 = +-0.6, clipped to
    # 0.7 * 0.816 = 0.5712.
    as_written = first_tool_call_positions(**batch, call_token_ids=OPENER, executed_only=False)[0]
    old = tool_position_bias(advantages, as_written, lengths, torch.ones(2, dtype=torch.bool), torch.zeros(2).long())
    torch.testing.assert_close(old, torch.tensor([0.5712, -0.5712]))


def test_regex_counts_only_matches_followed_by_tool_output(tokenizer):
    parts = [
        ("Plan first.\n", True),
        ("```python\na\n```\n", True),  # no output before the next match: not run
        ("```python\nb\n```\n", True),
        ("```output\n1\n```\n", False),
        ("Next step.\n", True),
        ("```python\nc\n```", True),  # the completion ends: not run
    ]
    ids, tools = _segments(tokenizer, parts)
    positions, lengths, num_calls, interactive = regex_tool_call_positions(None, [ids], tokenizer, CODE, [tools])
    before = _segments(tokenizer, parts[:2])[0]
    assert positions.tolist() == [len(before)]
    assert lengths.tolist() == [sum(tools)] and num_calls.tolist() == [1]
    assert interactive.tolist() == [0]  # only whitespace since the previous (unexecuted) match ended
