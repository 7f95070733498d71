"""The context of a vLLM server, for the context-length checks of `trl_aspo.algorithms.context_length`.

A served model's positions are the server's `max_model_len` (`trl vllm-serve --max_model_len`), which may be
smaller than the model config's: the synchronous trainer in server mode and TRL's asynchronous rollout worker ask the
server (its OpenAI endpoint `/v1/models`, the same query TRL's asynchronous trainer makes for `token_budget`), never
the config. vLLM (0.31) refuses a prompt longer than `max_model_len` but silently shortens the completion budget of a
prompt that fits with fewer than `max_tokens` positions left, so the checks run before a request is sent.
"""

from __future__ import annotations

import asyncio

import requests

from trl_aspo.algorithms.context_length import check_completion_budget, check_turn_fits

__all__ = ["ServedContextLoop", "served_max_model_len"]


def served_max_model_len(base_url: str, timeout_s: float = 30.0) -> int:
    """The `max_model_len` the vLLM server at `base_url` reports for its (first) served model."""
    url = f"{base_url.rstrip('/')}/v1/models"
    try:
        response = requests.get(url, timeout=timeout_s)
        response.raise_for_status()
        length = response.json()["data"][0]["max_model_len"]
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as error:
        raise RuntimeError(
            f"Could not read the vLLM server's max_model_len from {url} ({type(error).__name__}: {error}); the "
            "context-length checks need it. Is the server at that address a `trl vllm-serve` (or `vllm serve`)?"
        ) from error
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise RuntimeError(f"The vLLM server at {url} reports max_model_len={length!r}, not a positive integer.")
    return length


class ServedContextLoop:
    """Mixin for TRL's `_AsyncRolloutLoop`: the server's `max_model_len` is read at the loop's first turn (the
    budget `max_tokens` checked against it), then every turn's conversation so far plus `max_tokens` must fit it,
    else the worker fails naming the conversation, as trl_aspo's local worker does."""

    _served_context: int | None = None

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        if self._served_context is None:
            context = await asyncio.to_thread(served_max_model_len, self.vllm_server_url)
            check_completion_budget(
                self.max_tokens, context, f"the vLLM server's max_model_len ({self.vllm_server_url})"
            )
            self._served_context = context

        check_turn_fits(prompt_ids, self.max_tokens, self._served_context, self.tokenizer)
        return await super()._generate_one_turn(prompt_ids)
