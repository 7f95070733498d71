"""The built-in tokenizer and tiny models: offline, deterministic, TRL-compatible (the tool suffix included)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from trl.chat_template_utils import (
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)
from warmstart.calculator import TranscriptEncoder

from trl_aspo.builtin import (
    TINY_RANDOM,
    build_random_model,
    build_tokenizer,
    is_builtin,
    is_builtin_tokenizer_dir,
    load_builtin,
    load_tokenizer,
)
from trl_aspo.builtin.calculator import calculator
from trl_aspo.builtin.model import CHECKPOINT_DIR
from trl_aspo.builtin.tokenizer import MAX_NUMBER
from trl_aspo.evaluation.tool_use import tool_suffix_ids

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call><|im_end|>'
PROMPT = [{"role": "user", "content": "What is 37 * 24?"}]
CONVERSATION = [
    *PROMPT,
    {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*24"}}}],
    },
    {"role": "tool", "name": "calculator", "content": "888"},
    {"role": "assistant", "content": "The answer is 888."},
]
TEXTS = [CALL, "The answer is 9801.", "Let me compute.\n12 + 3456 = 3468\n-7.25", "x" * 5 + "\n\n  spaces  "]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _prompt_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(
        PROMPT, tools=[calculator], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _all_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    ids.append(_prompt_ids(tokenizer))
    ids.append(tokenizer.apply_chat_template(CONVERSATION, tools=[calculator], tokenize=True, return_dict=False))
    return ids


def test_tokenizer_is_deterministic(tokenizer):
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab()
    assert _all_ids(build_tokenizer()) == _all_ids(tokenizer)


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    for token in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token


def test_numbers_are_single_tokens(tokenizer):
    for number in [0, 7, 42, 408, 999, 1998, 9801, MAX_NUMBER]:
        ids = tokenizer(f"is {number}.", add_special_tokens=False)["input_ids"]
        assert tokenizer.convert_ids_to_tokens(ids).count(str(number)) == 1, number
    # Beyond the range, numbers still round-trip, in several tokens.
    assert tokenizer.decode(tokenizer("123456")["input_ids"]) == "123456"


def test_prompt_is_short(tokenizer):
    # The Qwen2.5 tools block must merge into few tokens: prompt length dominates generation speed on CPU.
    assert len(_prompt_ids(tokenizer)) <= 48


def test_generation_prompt_boundary(tokenizer):
    # Tokenizing prompt and answer separately must give the same ids as tokenizing them together.
    prompt = tokenizer.apply_chat_template(PROMPT, tools=[calculator], add_generation_prompt=True, tokenize=False)
    answer = "The answer is 888.<|im_end|>"
    joint = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
    assert joint == _prompt_ids(tokenizer) + tokenizer(answer, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("loader", ["load_tokenizer", "AutoTokenizer"])
def test_ids_survive_save_and_reload(tokenizer, tmp_path, loader):
    tokenizer.save_pretrained(tmp_path)
    assert is_builtin_tokenizer_dir(tmp_path)
    reloaded = load_tokenizer(tmp_path) if loader == "load_tokenizer" else AutoTokenizer.from_pretrained(tmp_path)
    assert _all_ids(reloaded) == _all_ids(tokenizer)
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    assert reloaded.pad_token_id == tokenizer.pad_token_id


def test_load_tokenizer_next_to_qwen2_model(tokenizer, tmp_path):
    # With a qwen2 config.json, AutoTokenizer would switch to Qwen2Tokenizer; load_tokenizer must not.
    build_random_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert _all_ids(load_tokenizer(tmp_path)) == _all_ids(tokenizer)


def test_trl_tool_calling_support(tokenizer):
    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)
    prefix = _prompt_ids(tokenizer)
    ids = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    for parsed in (
        tokenizer.parse_response(ids, prefix=prefix),
        parse_response(tokenizer, ids, prefix=prefix, tools=[calculator]),
    ):
        assert parsed["tool_calls"] == [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}
        ]
    answer = tokenizer("The answer is 408.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert parse_response(tokenizer, answer, prefix=prefix) == {"role": "assistant", "content": "The answer is 408."}


def test_is_builtin():
    assert is_builtin("builtin:tiny-random")
    assert is_builtin("builtin:tiny-calculator")
    assert not is_builtin("Qwen/Qwen2.5-0.5B-Instruct")


def test_tiny_random_is_deterministic_and_generates():
    model, tokenizer = load_builtin(TINY_RANDOM)
    other, _ = load_builtin(TINY_RANDOM)
    for (name, param), (_, other_param) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(param, other_param), name
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.response_template is not None
    ids = torch.tensor([_prompt_ids(tokenizer)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 5


def test_build_random_model_keeps_global_rng(tokenizer):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_random_model(tokenizer, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_builtin():
    with pytest.raises(ValueError, match="Unknown built-in"):
        load_builtin("builtin:nope")


@pytest.mark.skipif(not (CHECKPOINT_DIR / "model.safetensors").is_file(), reason="checkpoint not built yet")
def test_tiny_calculator_loads():
    model, tokenizer = load_builtin("builtin:tiny-calculator")
    assert model.config.vocab_size == len(tokenizer)
    assert _all_ids(tokenizer) == _all_ids(build_tokenizer())
    assert tokenizer.response_template is not None


def test_warm_start_transcripts_match_trl_rollouts(tokenizer):
    """Segments concatenate to what TRL's tool loop builds, and only assistant turns are trained."""
    encoder = TranscriptEncoder(tokenizer)
    segments = encoder.encode((37, "*", 24), call=True, preamble="Let me compute.", direct_answer=0, tool_result=888)
    ids = [token for segment in segments for token in segment.ids]
    # Rendering the whole conversation and tokenizing it once gives the same ids (minus the final newline).
    full = tokenizer.apply_chat_template(CONVERSATION, tools=[calculator], tokenize=False)
    assert ids == tokenizer(full.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    prompt, call, suffix, final = segments
    assert prompt.ids == _prompt_ids(tokenizer) and not prompt.trainable
    assert suffix.ids == tool_suffix_ids(tokenizer, [CONVERSATION[2]]) and not suffix.trainable
    assert tokenizer.decode(call.ids).startswith("Let me compute.\n<tool_call>") and call.trainable
    assert tokenizer.decode(final.ids) == "The answer is 888.<|im_end|>" and final.trainable
    direct = encoder.encode((37, "*", 24), call=False, preamble="", direct_answer=900, tool_result=888)
    assert tokenizer.decode(direct[1].ids) == "The answer is 900.<|im_end|>"


def test_tool_suffix_matches_trl_format():
    _, tokenizer = load_builtin(TINY_RANDOM)
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": "408"}])
    expected = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(suffix) == expected
    # The number is one token: the model can copy it with a single lookup.
    assert tokenizer.convert_tokens_to_ids("408") in suffix
