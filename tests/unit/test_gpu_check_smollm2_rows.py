"""scripts/gpu_check.py's SmolLM2 case: the carried assets are the conversion's tokenizer, and the pre-made rows write
real tool calls in its ids (the case's runs: tests/integration/test_gpu_check.py)."""

from __future__ import annotations

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


@pytest.fixture(scope="module")
def tokenizer(gpu_check):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gpu_check.SMOLLM2_ASSETS)


def test_the_assets_are_the_converted_tokenizer(tokenizer, gpu_check):
    from trl.chat_template_utils import qwen2_5_chat_template

    from trl_aspo.builtin.smollm2 import PAD_TOKEN, TOOL_TOKENS

    # TRL recognizes its template by exact string; each tool marker is one added token, as the conversion makes it.
    assert tokenizer.chat_template == qwen2_5_chat_template
    assert len(tokenizer) == gpu_check.smollm2_config(small=False).vocab_size == 49156
    for token in TOOL_TOKENS:
        assert tokenizer(token, add_special_tokens=False).input_ids == [tokenizer.convert_tokens_to_ids(token)]
    assert (tokenizer.pad_token, tokenizer.eos_token) == (PAD_TOKEN, "<|im_end|>")


def test_even_rows_write_one_call_followed_by_the_tools_turn(tokenizer, gpu_check):
    rows = gpu_check.smollm2_rows(tokenizer, batch=4, completion_length=96)
    opener, closer = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    for index, row in enumerate(rows):
        completion, env_mask = row["completion_ids"], row["env_mask"]
        assert len(completion) == len(env_mask) == 96 and completion[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(row["prompt_ids"]).count('"name": "calculator"') == 1  # the tool is offered
        if index % 2:
            assert opener not in completion and set(env_mask) == {1}
            continue
        assert completion.count(opener) == completion.count(closer) == 1
        start = env_mask.index(0)
        end = start + env_mask.count(0)
        assert set(env_mask[end:]) == {1} and completion.index(closer) < start
        assert tokenizer.decode(completion[start:end]).startswith("\n<|im_start|>user\n<tool_response>")
        assert '"expression"' in tokenizer.decode(completion[completion.index(opener) : start])
    # The call moves later with the row, so tool shaping has positions to compare.
    assert rows[0]["completion_ids"].index(opener) < rows[2]["completion_ids"].index(opener)


def test_samples_train_only_the_generated_tokens(tokenizer, gpu_check):
    rows = gpu_check.smollm2_rows(tokenizer, batch=2, completion_length=96)
    sample = gpu_check.smollm2_samples(tokenizer, rows)[0]
    prompt = len(rows[0]["prompt_ids"])
    assert list(sample.input_ids) == rows[0]["prompt_ids"] + rows[0]["completion_ids"]
    assert list(sample.completion_mask) == [0] * prompt + rows[0]["env_mask"]
    assert all(
        (logp < 0) == bool(keep) for logp, keep in zip(sample.old_log_probs, sample.completion_mask, strict=True)
    )
    assert sample.metrics["reward"] == gpu_check.REWARD_PATTERN[0]


def test_a_completion_too_short_for_the_call_is_refused(tokenizer, gpu_check):
    with pytest.raises(ValueError, match="raise --completion-length"):
        gpu_check.smollm2_rows(tokenizer, batch=2, completion_length=40)
