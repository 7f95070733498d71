"""Tool-use evaluation: generate with a tool loop that mirrors TRL's, then score and summarize tool integration.

The loop reproduces what `GRPOTrainer` does with `tools=` (TRL 1.16, `_generate` / `_tool_call_loop`), so the numbers
measured here are the ones the trainer optimizes:

- The prompt is rendered with the chat template, the tools and `add_generation_prompt=True`.
- Each turn is generated until the end-of-turn token; the turn is parsed with `trl.chat_template_utils.parse_response`.
- If it holds tool calls (and fewer than `max_tool_calls` tool rounds ran), the tools are called (an exception becomes
  `{"error": ...}`), and the tool-response suffix ids (`tool_suffix_ids`, TRL's `_get_tool_suffix_ids`) are appended
  to the token sequence by concatenation, never by re-tokenizing.
- `max_completion_length` bounds the whole completion, tool-response tokens included: a tool round whose suffix would
  exceed it is dropped (the sample ends on its call, which the reward should score 0), and a turn generated after a
  tool response is truncated to the remaining budget.
- Completion lengths and first-call positions count *action* tokens, i.e. tokens the model generated.
- A `max_completion_length` that leaves no room in the model's context, or a prompt that does not fit with it, is
  refused before anything is generated (`trl_aspo.algorithms.context_length`), naming the row.
- Calls, first-call positions and interactive turns are counted by the trainers' `ToolCallCounter` on the completion's
  tokens (action mask as its tool mask): only calls whose tool ran count, one definition for training and evaluation.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from trl.chat_template_utils import add_response_schema, parse_response

from trl_aspo.algorithms.context_length import check_completion_budget, check_prompts_fit, model_context_length
from trl_aspo.algorithms.shaping import is_correct
from trl_aspo.algorithms.tool_metrics import ToolCallCounter

__all__ = ["evaluate_tool_use", "generation_attention", "tool_suffix_ids"]

# The attention AsyncGRPOTrainer loads its policy with (trl.experimental.async_grpo.packing.TREE_ATTENTION): it needs
# the packed batch's tree indices, which generation does not have.
PACKED_TREE_ATTENTION = "tree_fa3"


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """Token ids TRL appends after a turn with tool calls: the tool messages and the next generation prompt.

    Mirrors `GRPOTrainer._get_tool_suffix_ids`: render a dummy conversation with and without the tool messages and
    keep the difference, cutting the prefix right after its last end-of-turn token (the turn's own `<|im_end|>` is
    already part of the generated ids).
    """
    dummy_call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": dummy_call}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        dummy + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    eos_positions = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if eos_positions:
        prefix = prefix[: eos_positions[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("The chat template is not prefix-preserving; cannot build the tool-response suffix.")
    return full[len(prefix) :]


def _run_tool(tool_call: dict[str, Any], tools_by_name: dict[str, Callable]) -> tuple[str, Any]:
    # Same failure handling as TRL: any problem with the call becomes an error payload the model sees.
    function = tool_call.get("function", {})
    name = function.get("name", "unknown")
    try:
        if tool_call.get("type") != "function":
            raise ValueError(f"Unsupported tool call type: {tool_call.get('type')}")
        if name not in tools_by_name:
            raise ValueError(f"Tool {name} not found.")
        return name, tools_by_name[name](**function["arguments"])
    except Exception as exc:  # noqa: BLE001 - the tool is user code; its failure is data, not a crash
        return name, {"error": str(exc)}


class _Sample:
    """The state of one rollout: token ids, action mask, parsed messages and tool rounds."""

    def __init__(self, row: int, prompt_ids: list[int]):
        self.row = row
        self.prompt_ids = prompt_ids
        self.completion_ids: list[int] = []
        self.action_mask: list[int] = []
        self.messages: list[dict[str, Any]] = []
        self.tool_rounds = 0
        self.done = False


def _generate(
    model: Any, tokenizer: Any, inputs: list[list[int]], max_new_tokens: int, temperature: float
) -> list[list[int]]:
    """Generate one turn per input (left-padded batch); return the new ids up to and including end-of-turn."""
    device = next(model.parameters()).device
    width = max(len(ids) for ids in inputs)
    input_ids = torch.full((len(inputs), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(inputs), width), dtype=torch.long)
    for i, ids in enumerate(inputs):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention_mask[i, width - len(ids) :] = 1
    # Plain sampling from the model's distribution (no top-k/top-p), as GRPOTrainer's defaults do.
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **(sampling or {"do_sample": False}),
    )
    turns = []
    for row in output[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        else:
            row = [token for token in row if token != tokenizer.pad_token_id]
        turns.append(row)
    return turns


def _rollout(
    model: Any,
    tokenizer: Any,
    samples: list[_Sample],
    tools: list[Callable],
    temperature: float,
    max_completion_length: int,
    max_tool_calls: int | None,
) -> None:
    tools_by_name = {tool.__name__: tool for tool in tools}
    active = samples
    while active:
        budgets = [max_completion_length - len(s.completion_ids) for s in active]
        turns = _generate(
            model, tokenizer, [s.prompt_ids + s.completion_ids for s in active], max(budgets), temperature
        )
        next_active = []
        for sample, turn, budget in zip(active, turns, budgets, strict=True):
            turn = turn[:budget]
            prefix = sample.prompt_ids + sample.completion_ids
            sample.completion_ids += turn
            sample.action_mask += [1] * len(turn)
            if not turn:
                continue
            message = parse_response(tokenizer, turn, prefix=prefix, tools=tools)
            sample.messages.append(message)
            calls = message.get("tool_calls") or []
            if not calls or (max_tool_calls is not None and sample.tool_rounds >= max_tool_calls):
                continue
            tool_messages = []
            for call in calls:
                name, result = _run_tool(call, tools_by_name)
                tool_messages.append({"role": "tool", "name": name, "content": str(result)})
            suffix = tool_suffix_ids(tokenizer, tool_messages)
            # TRL drops a tool round that would not fit in the completion budget; the sample ends on its call.
            if len(sample.completion_ids) + len(suffix) > max_completion_length:
                continue
            sample.tool_rounds += 1
            sample.messages.extend(tool_messages)
            sample.completion_ids += suffix
            sample.action_mask += [0] * len(suffix)
            next_active.append(sample)
        active = next_active


def _reward_kwargs(reward_fn: Callable, rows: list[dict[str, Any]]) -> dict[str, Any]:
    # Like TRL: every dataset column except the prompt is passed as a per-sample list.
    keys = [key for key in rows[0] if key not in ("prompt", "completion")]
    kwargs = {key: [row[key] for row in rows] for key in keys}
    parameters = inspect.signature(reward_fn).parameters
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        kwargs = {key: value for key, value in kwargs.items() if key in parameters}
    return kwargs


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def with_response_parser(tokenizer):
    """`tokenizer` able to parse tool calls out of generated ids (`parse_response` needs its response template, or
    the legacy schema): TRL adds it for a known chat template, as its trainers and rollout worker do when given tools.
    A tokenizer loaded by `AutoTokenizer` from a saved folder has neither."""
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        tokenizer = add_response_schema(tokenizer)
    return tokenizer


def evaluate_tool_use(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_fn: Callable[..., list[float]],
    tools: list[Callable],
    num_samples: int = 1,
    temperature: float = 1.0,
    max_completion_length: int = 64,
    max_tool_calls: int | None = None,
    batch_size: int = 64,
    success_threshold: float = 0.5,
    call_opener: str = "<tool_call>",
    seed: int | None = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Roll out `num_samples` completions per conversational prompt of `dataset` with tools, score and summarize them.

    Args:
        model: A causal LM (in eval mode during the call; its training mode is restored).
        tokenizer: Its tokenizer, with a chat template supporting tools; without a response template TRL's is added
            (`with_response_parser`).
        dataset: Rows with a conversational `prompt` column and the columns `reward_fn` needs (e.g. `answer`).
        reward_fn: A TRL-style reward function `(prompts, completions, completion_ids, **columns) -> list[float]`.
        tools: The tool functions, as passed to `GRPOTrainer(tools=...)`.
        num_samples: Completions per prompt (k of avg@k and pass@k).
        temperature: Sampling temperature; 0 means greedy.
        max_completion_length: Budget of the whole completion in tokens, tool responses included (as in TRL).
        max_tool_calls: At most this many tool rounds per completion (TRL's `max_tool_calling_iterations`).
        batch_size: Completions generated together.
        success_threshold: A completion counts as correct when its reward is at least this.
        call_opener: Text opening a tool call, to locate the first call among the action tokens.
        seed: Seeds sampling (without touching the caller's RNG state); None leaves the RNG alone.
        progress: Show a tqdm progress bar.

    Returns:
        Summary metrics (`accuracy` = avg@k, `pass_at_k`, `tool_call_rate`, `mean_first_call_position`,
        `calls_per_completion`, `interactive_turns_per_completion`, `accuracy_with_call`, `accuracy_without_call`,
        `mean_completion_length` in action tokens, `mean_reward`, `num_problems`, `num_samples`) and `records`, one
        dict per completion.
    """
    rows = [dataset[i] for i in range(len(dataset))]
    tokenizer = with_response_parser(tokenizer)
    counter = ToolCallCounter(tokenizer, call_opener)
    context = model_context_length(model.config)
    check_completion_budget(max_completion_length, context, "the model config's positions")
    samples = []
    for row_index, row in enumerate(rows):
        prompt_ids = tokenizer.apply_chat_template(
            row["prompt"], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        check_prompts_fit(
            [len(prompt_ids)], max_completion_length, context, lambda _, row=row_index: f"Row {row}'s prompt"
        )
        samples.extend(_Sample(row_index, list(prompt_ids)) for _ in range(num_samples))

    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        bar = tqdm(total=len(samples), desc="evaluate", unit="completion", disable=not progress)
        for start in range(0, len(samples), batch_size):
            chunk = samples[start : start + batch_size]
            _rollout(model, tokenizer, chunk, tools, temperature, max_completion_length, max_tool_calls)
            bar.update(len(chunk))
        bar.close()
    model.train(was_training)

    sample_rows = [rows[s.row] for s in samples]
    rewards = reward_fn(
        prompts=[row["prompt"] for row in sample_rows],
        completions=[s.messages for s in samples],
        completion_ids=[s.completion_ids for s in samples],
        **_reward_kwargs(reward_fn, sample_rows),
    )
    statistics = _tool_statistics(counter, samples)
    records = []
    for sample, reward, (position, action_tokens, num_calls, interactive) in zip(
        samples, rewards, statistics, strict=True
    ):
        records.append(
            {
                "problem": sample.row,
                "prompt": rows[sample.row]["prompt"],
                "completion": sample.messages,
                "text": tokenizer.decode(sample.completion_ids),
                "reward": float(reward),
                "correct": bool(is_correct(float(reward), success_threshold)),
                "num_calls": num_calls,
                "interactive_turns": interactive,
                "first_call_position": position if position >= 0 else None,
                "action_tokens": action_tokens,
            }
        )

    with_call = [r["correct"] for r in records if r["num_calls"]]
    without_call = [r["correct"] for r in records if not r["num_calls"]]
    positions = [r["first_call_position"] for r in records if r["first_call_position"] is not None]
    solved = [False] * len(rows)
    for record in records:
        solved[record["problem"]] |= record["correct"]
    return {
        "accuracy": _mean([r["correct"] for r in records]),
        "pass_at_k": _mean(solved),
        "mean_reward": _mean([r["reward"] for r in records]),
        "tool_call_rate": _mean([r["num_calls"] > 0 for r in records]),
        "mean_first_call_position": _mean(positions),
        "calls_per_completion": _mean([r["num_calls"] for r in records]),
        "interactive_turns_per_completion": _mean([r["interactive_turns"] for r in records]),
        "accuracy_with_call": _mean(with_call),
        "accuracy_without_call": _mean(without_call),
        "mean_completion_length": _mean([r["action_tokens"] for r in records]),
        "num_problems": len(rows),
        "num_samples": num_samples,
        "records": records,
    }


def _tool_statistics(counter: ToolCallCounter, samples: list[_Sample]) -> list[list[int]]:
    """Per sample, `[first-call position (-1: none), action tokens, calls, interactive turns]` by `counter`, the
    trainers' count, on the completions laid out as TRL's right-padded batch (tool responses: tool mask 0)."""
    width = max(1, max((len(sample.completion_ids) for sample in samples), default=0))
    completion_ids = torch.zeros(len(samples), width, dtype=torch.long)
    completion_mask = torch.zeros(len(samples), width, dtype=torch.long)
    tool_mask = torch.ones(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        size = len(sample.completion_ids)
        completion_ids[row, :size] = torch.tensor(sample.completion_ids, dtype=torch.long)
        completion_mask[row, :size] = 1
        tool_mask[row, :size] = torch.tensor(sample.action_mask, dtype=torch.long)
    return counter(completion_ids, completion_mask, tool_mask).tolist()


@contextlib.contextmanager
def generation_attention(model):
    """Run generation with standard attention ('sdpa') on a model set up for TRL's packed tree attention (the
    asynchronous trainer's policy), restoring it afterwards; any other model is used as it is."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != PACKED_TREE_ATTENTION:
        yield model
        return
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(implementation)
