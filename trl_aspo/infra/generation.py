"""Token-level sampling with transformers on CPU, scored the way `AsyncGRPOTrainer` scores it.

`sample_completion` stands in for one vLLM `/v1/completions` call: it samples `y_t ~ softmax(P(l_t / T))`, where
`l_t` are the policy's next-token logits, `T` the temperature and `P` the truncations TRL's config exposes (top-k,
top-p, min-p, repetition penalty, applied with transformers' own logits processors), and returns with each token its
log-probability `log softmax(l_t / T)[y_t]` over the full vocabulary. That is the quantity `AsyncGRPOTrainer`'s fused
LM head computes for the same token (it divides the logits by `temperature` and applies no truncation), so for a
sample generated and trained at the same weights the importance ratio is exactly 1 (GRPO: Shao et al. 2024,
arXiv:2402.03300; the ratio is PPO's, Schulman et al. 2017, arXiv:1707.06347).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def _truncations(top_k: int, top_p: float, min_p: float | None, repetition_penalty: float) -> LogitsProcessorList:
    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    if min_p:
        processors.append(MinPLogitsWarper(min_p))
    return processors


def _cache_argument(model) -> str:
    """The name of the KV-cache argument (and output) of `model.forward`: transformers renamed `past_key_values` to
    `cache` (the old name still works there, with a deprecation notice per run)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def sample_completion(
    model: PreTrainedModel,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    eos_token_ids: Iterable[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
    processed_logprobs: bool = False,
) -> tuple[list[int], list[float]]:
    """Sample up to `max_tokens` tokens after `prompt_ids`; return them (the stop token included) and their log-probs:
    of the temperature-scaled full softmax (the trainer's), or with `processed_logprobs` of the distribution actually
    sampled from (after top-p, top-k, min-p and the repetition penalty, renormalized), as vLLM reports them under
    `--logprobs-mode processed_logprobs`, which TRL's `vllm-serve` sets.

    Args:
        model: a causal LM; it is run in eval mode with its KV cache, one sequence at a time.
        prompt_ids: the prompt's token ids.
        max_tokens: most tokens to generate.
        eos_token_ids: ids that end the completion (kept as its last token, as vLLM returns them).
        temperature, top_p, top_k, min_p, repetition_penalty: as in `AsyncGRPOConfig`.
        generator: the random stream the tokens are drawn from (a seeded one makes a call reproducible).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: sampling needs temperature > 0 (its log-probs divide by it).")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: a completion needs at least one prompt token.")
    stop = set(eos_token_ids)
    truncations = _truncations(top_k, top_p, min_p, repetition_penalty)
    device = next(model.parameters()).device
    sequence = torch.tensor([prompt_ids], device=device)
    step_input, cache = sequence, None
    cache_argument = _cache_argument(model)
    token_ids, log_probs = [], []
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_tokens):
            outputs = model(input_ids=step_input, use_cache=True, **{cache_argument: cache})
            cache = outputs[cache_argument]
            scaled = outputs.logits[:, -1, :].float() / temperature
            processed = truncations(sequence, scaled.clone())
            token = torch.multinomial(torch.softmax(processed, dim=-1), 1, generator=generator)
            token_ids.append(int(token))
            reported = processed if processed_logprobs else scaled
            log_probs.append(float(torch.log_softmax(reported, dim=-1)[0, token_ids[-1]]))
            if token_ids[-1] in stop:
                break
            sequence = torch.cat([sequence, token], dim=1)
            step_input = token
    finally:
        model.train(was_training)
    return token_ids, log_probs


@torch.no_grad()
def load_named_tensors(model: PreTrainedModel, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy `(name, tensor)` pairs into `model`'s parameters of the same name; return how many were copied.

    Names are those `AsyncGRPOTrainer` streams to vLLM (the base checkpoint's `named_parameters()` names), so the
    copy's tied parameters (a tied `lm_head`) follow their owner. An unknown name or a shape mismatch is an error.
    """
    parameters = dict(model.named_parameters())
    copied = 0
    for name, tensor in named_tensors:
        if name not in parameters:
            raise KeyError(
                f"weight {name!r} has no parameter of that name in the policy copy ({type(model).__name__})."
            )
        target = parameters[name]
        if target.shape != tensor.shape:
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match {tuple(target.shape)}.")
        target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
        copied += 1
    return copied
