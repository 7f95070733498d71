"""The model's context and the completion budget: a `max_completion_length` at or beyond the positions the model has
(10^9 was accepted) made generation run past them and hang, and a prompt whose length plus the budget exceeds them
fails there too. Both trainers check the budget once the model is loaded (or the generator's `max_model_len` is
known); the synchronous trainer checks each prompt when it is tokenized.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = [
    "check_completion_budget",
    "check_prompts_fit",
    "check_turn_fits",
    "generation_context",
    "model_context_length",
]

logger = logging.getLogger(__name__)


def model_context_length(config: Any) -> int | None:
    """The positions a model config provides: `max_position_embeddings` (of the text config, for a multimodal model)
    times its RoPE scaling `factor` when one is set (`rope_parameters`, transformers 5; `rope_scaling` before); None
    when the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    return int(positions * factor) if isinstance(factor, int | float) and factor > 1 else positions


def check_completion_budget(max_completion_length: int, context: int | None, source: str) -> None:
    """Refuse a `max_completion_length` that leaves no position for the prompt in a context of `context` tokens
    (`source` says where that number comes from); warn when the context is unknown (None)."""
    if context is None:
        logger.warning(
            f"The model's context is unknown ({source} says nothing): max_completion_length={max_completion_length} "
            "cannot be checked against it."
        )
        return
    if max_completion_length >= context:
        raise ValueError(
            f"max_completion_length={max_completion_length} must be smaller than the model's context of {context} "
            f"tokens ({source}): prompt and completion share it, and generation past it does not end. Set "
            f"max_completion_length below {context}."
        )


def generation_context(max_completion_length: int, served: int | None, served_source: str, config: Any) -> int | None:
    """The generator's context, checked against `max_completion_length` (`check_completion_budget`): `served` (a
    vLLM engine's or rollout worker's `max_model_len`, named by `served_source`) when known, else the positions of
    the model `config` (`model_context_length`)."""
    if served is not None:
        context, source = served, served_source
    else:
        context = model_context_length(config)
        source = "the model config's max_position_embeddings times its RoPE scaling factor"
    check_completion_budget(max_completion_length, context, source)
    return context


def check_prompts_fit(prompt_lengths: list[int], max_completion_length: int, context: int | None, describe) -> None:
    """Refuse the first prompt whose length plus `max_completion_length` exceeds `context` (None: unknown, nothing
    checked); `describe(i)` names prompt `i` (its row)."""
    if context is None:
        return
    for index, length in enumerate(prompt_lengths):
        if length + max_completion_length > context:
            raise ValueError(
                f"{describe(index)} has {length} tokens: with max_completion_length={max_completion_length} it needs "
                f"{length + max_completion_length} positions, more than the model's context of {context}. Shorten "
                "the prompt (or filter such rows out) or lower max_completion_length."
            )


def check_turn_fits(prompt_ids: list[int], max_tokens: int, context: int | None, tokenizer: Any) -> None:
    """Refuse a rollout worker's turn whose conversation so far (`prompt_ids`) plus `max_tokens` exceeds `context`,
    naming the conversation by the text of its first 48 tokens."""

    def describe(_: int) -> str:
        return f"The conversation starting {tokenizer.decode(prompt_ids[:48], skip_special_tokens=True)!r}"

    check_prompts_fit([len(prompt_ids)], max_tokens, context, describe)
