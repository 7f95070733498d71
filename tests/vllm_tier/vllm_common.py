"""Shared pieces of the vLLM tier: log-probs of one fixed completion under the policy and under a vLLM engine."""

from __future__ import annotations

import torch

from trl_aspo.builtin.task import make_dataset

LOGPROB_TOLERANCE = 1e-4  # float32 on both sides; measured agreement after a sync is about 1e-5


def fixed_prompt_ids(tokenizer) -> list[int]:
    """The chat-templated ids of the first held-out problem, as TRL's trainers build a generation prompt."""
    prompt = make_dataset("test", 1, seed=0)[0]["prompt"]
    encoded = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def policy_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """log pi(completion token | prefix) under `model`, at temperature 1 (standard attention, also for the
    asynchronous trainer's packed-attention policy)."""
    from trl_aspo.evaluation.report import generation_attention

    ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    with torch.no_grad(), generation_attention(model):
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    targets = torch.tensor(completion_ids, device=model.device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0].cpu()


def server_logprobs(base_url: str, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The same log-probs as the vLLM server computes them (TRL's client, scoring without generating)."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=base_url, connection_timeout=60)
    scored = client.get_sequence_logprobs([prompt_ids + completion_ids], [len(prompt_ids)], top_logprobs=1)
    return torch.tensor([row[0] if isinstance(row, list) else row for row in scored["actual_logprobs"][0]])


def server_completion(base_url: str, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:
    """One sampled completion of `prompt_ids` from the server."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=base_url, connection_timeout=60)
    return client.generate([prompt_ids], n=1, max_tokens=max_tokens, temperature=1.0, logprobs=0)["completion_ids"][0]


def moved(model, reference_state: dict) -> bool:
    """Whether any parameter of `model` differs from `reference_state`."""
    return any(
        not torch.equal(param.detach().cpu(), reference_state[name]) for name, param in model.named_parameters()
    )
