"""A small offline tokenizer for the built-in tiny models.

The tokenizer is trained locally with the `tokenizers` library in well under a second, deterministically, so tests and
the quickstart never need a model hub. Design choices, each driven by what a tiny model can learn:

- Byte-level BPE **without** a word-splitting regex: the fixed Qwen2.5 tool boilerplate merges into a few long tokens,
  which keeps prompts short (prompt length dominates generation speed on CPU).
- Pre-tokens are split after every newline, so no merge crosses the generation-prompt boundary
  (`<|im_start|>assistant\\n` + generated text) or the tool-response suffix TRL concatenates by ids. Text tokenized in
  one piece and text tokenized segment by segment therefore agree at those boundaries.
- Every integer `0..MAX_NUMBER` is a dedicated vocabulary entry (an added token matched leftmost-longest), so a number
  is exactly one token and copying it (operands into a call, a tool result into the answer) is a single lookup.
- The chat template is TRL's exact Qwen2.5 template, so `trl.chat_template_utils.add_response_schema` recognizes it and
  `tokenizer.parse_response` extracts `<tool_call>` blocks.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template
from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

from trl_aspo.builtin.calculator import calculator
from trl_aspo.builtin.task import ANSWER_TEMPLATE, QUESTION_TEMPLATE

# Largest integer with its own token. 2-digit x 2-digit products (<= 9801) and 3-digit sums (<= 1998) fit.
MAX_NUMBER = 9999
BPE_VOCAB_SIZE = 1024

BUILTIN_MARKER = "trl_aspo_builtin"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
CONTROL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Not "special": like Qwen's own tokenizers, so decoding with skip_special_tokens=True keeps tool markup visible.
TOOL_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE]


def _corpus() -> list[str]:
    """The text the tokenizer sees most: rendered tool conversations of the built-in task, markup and numbers removed.

    Rendering with the real template and tool keeps the merges in sync with what prompts look like; repetition makes
    BPE merge whole lines of the boilerplate into single tokens.
    """
    texts = []
    # The preambles stay out of the corpus on purpose: left unmerged they cost several tokens each, so a call after
    # some text is measurably later than a call opening the turn (what tool-position shaping acts on).
    for op in ("*", "+", "-"):
        question = QUESTION_TEMPLATE.format(a=12, op=op, b=34)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"12{op}34"}}}
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": "408"},
            {"role": "assistant", "content": ANSWER_TEMPLATE.format(answer=408)},
        ]
        rendered, _ = render_jinja_template(
            [messages], tools=[calculator], chat_template=qwen2_5_chat_template, add_generation_prompt=True
        )
        texts.extend(rendered * 8)
    markup = "|".join(re.escape(t) for t in CONTROL_TOKENS + TOOL_TOKENS)
    return [piece for text in texts for piece in re.split(rf"{markup}|\d+", text) if piece]


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # Keep the newline with the text before it: "assistant\n" is one pre-token, generated text starts fresh.
            pre_tokenizers.Split(Regex(r"\n"), behavior="merged_with_previous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=CONTROL_TOKENS + TOOL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.add_tokens([AddedToken(str(n), special=False, normalized=False) for n in range(MAX_NUMBER + 1)])
    return tokenizer


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the built-in tokenizer (deterministic, offline, < 1 s) with the Qwen2.5 template and response schema."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        model_max_length=2048,
        padding_side="left",
        # Saved into tokenizer_config.json and kept across reloads: lets loaders recognize this tokenizer.
        **{BUILTIN_MARKER: True},
    )
    tokenizer.chat_template = qwen2_5_chat_template
    return add_response_schema(tokenizer)


def is_builtin_tokenizer_dir(path: str | os.PathLike) -> bool:
    """Whether `path` holds a tokenizer saved from `build_tokenizer` (e.g. a trained built-in model's output dir)."""
    config_file = Path(path) / "tokenizer_config.json"
    if not config_file.is_file():
        return False
    return bool(json.loads(config_file.read_text(encoding="utf-8")).get(BUILTIN_MARKER, False))


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Reload a tokenizer saved from `build_tokenizer`, keeping its exact pipeline.

    Never use `AutoTokenizer` on a directory whose config.json says qwen2: transformers 5 forces `Qwen2Tokenizer` for
    that model type, which rebuilds the pre-tokenizer with Qwen's word regex and silently changes the ids. Loading the
    generic class keeps the saved `tokenizer.json` as is.
    """
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.chat_template = qwen2_5_chat_template
    return add_response_schema(tokenizer)
