"""What more than one test module needs, in one place: the config fields of a few fast CPU steps, a dense reward, the
asynchronous trainer's pieces (built-in checkpoint, tool-calling tokenizer, scripted sample streams), experiment files
for `trl-aspo compare`, prioritized-sampling fields, and paths of the repository.

Tests import it as `helpers` (tests/conftest.py puts tests/ on sys.path); a configuration that names a reward by
dotted path uses `tests.helpers.digit_share_reward`. No test module imports another test module. Heavy imports are
inside the functions, so importing this module stays cheap."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

from trl_aspo.builtin import CHECKPOINT_DIR, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
# Scripts the integration tests run as separate processes (accelerate launch).
WORKERS_DIR = REPO_ROOT / "tests" / "integration" / "workers"
MODEL = str(CHECKPOINT_DIR)


# ---------------------------------------------------------------------------------------------- training fields
def tiny_run_fields(output_dir, **overrides) -> dict:
    """`GRPOConfig`/`AsyncGRPOConfig` fields for a short CPU run logging every step; keyword overrides replace any.
    Shared by the trainer tests (synchronous, asynchronous and multi-process); each test overrides what it is about."""
    fields = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    fields.update(overrides)
    return fields


def digit_share_reward(completions, **kwargs) -> list[float]:
    """A dense reward in [0, 1] for tests on the untrained tiny model, whose groups would otherwise rarely carry
    signal: the share of digit characters in the completion's final text."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


# ---------------------------------------------------------------------------------------- asynchronous trainer
def calculator_tokenizer():
    """The built-in tokenizer with TRL's response schema, so TRL's worker parses its tool calls."""
    from trl.chat_template_utils import add_response_schema

    return add_response_schema(load_tokenizer(CHECKPOINT_DIR))


def async_fields(tmp_path, **overrides) -> dict:
    """Config fields for a few fast CPU steps of TRL's AsyncGRPOTrainer (fixed-count batches); keyword overrides
    replace any field."""
    defaults = dict(
        output_dir=tmp_path / "out", max_steps=3, token_budget=0, max_staleness=2, max_tool_calling_iterations=1
    )
    return tiny_run_fields(**{**defaults, **overrides})


def async_grpo_config(tmp_path, **overrides):
    """TRL's plain `AsyncGRPOConfig` with `async_fields`."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(**async_fields(tmp_path, **overrides))


def async_weight_map_config(tmp_path, loss_type, **overrides):
    """An `AsyncASPOConfig` logging the weight map with `loss_type`."""
    from trl_aspo import AsyncASPOConfig

    fields = dict(per_device_train_batch_size=4, num_generations=2, max_steps=2, max_inflight_tasks=1)
    return AsyncASPOConfig(
        **async_fields(tmp_path, **{**fields, **overrides}), loss_type=loss_type, log_weight_map=True
    )


def trainer_with_local_worker(trainer_class, args, tokenizer, dataset, reward_funcs, **worker_options):
    """`trainer_class` on the built-in checkpoint with the calculator tool, generating with a `LocalRolloutWorker`
    (`worker_options`: its seed, jitter, ...) that `LocalWeightTransfer` keeps in sync."""
    from trl_aspo.builtin.task import calculator
    from trl_aspo.infra import LocalRolloutWorker, LocalWeightTransfer, install_cpu_fallbacks

    install_cpu_fallbacks()
    worker = LocalRolloutWorker(MODEL, tokenizer, dataset, reward_funcs, args, tools=[calculator], **worker_options)
    return trainer_class(
        MODEL,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
        rollout_worker=worker,
        weight_transfer=LocalWeightTransfer(worker),
    )


def base_fields(tmp_path, **overrides):
    """`async_fields` for the scripted asynchronous runs: 4 samples per step in groups of 2, two steps."""
    defaults = dict(per_device_train_batch_size=4, num_generations=2, max_steps=2, max_inflight_tasks=1)
    return async_fields(tmp_path, **{**defaults, **overrides})


def losses(trainer):
    """The logged loss of each optimizer step."""
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def parameters(model):
    """A detached copy of every named parameter."""
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def scripted_samples(tokenizer, versions, groups_of=2, seed=0, prompt_rows=None):
    """One `fake_rollout_sample` per entry of `versions` (its model version), `groups_of` consecutive samples per
    prompt: built-in task prompts, completions of 3 to 8 tokens, rewards in [0, 1]. `prompt_rows` picks each
    sample's dataset row."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_aspo.builtin.task import make_dataset

    policy = AutoModelForCausalLM.from_pretrained(MODEL)
    generator = torch.Generator().manual_seed(seed)
    dataset = make_dataset("train", len(versions), seed=seed)
    samples = []
    for index, version in enumerate(versions):
        prompt = dataset[index // groups_of if prompt_rows is None else prompt_rows[index]]["prompt"]
        length = int(torch.randint(3, 9, (1,), generator=generator))
        samples.append(
            fake_rollout_sample(
                policy, tokenizer, prompt, length, generator, model_version=version, group_id=index // groups_of
            )
        )
    return samples


def scripted_trainer(trainer_class, args, tokenizer, samples):
    """`trainer_class` on the built-in checkpoint, trained on `samples` handed out once each, in order, by a
    `ReplayRolloutWorker`: both trainers of a comparison see exactly the same stream."""
    from trl_aspo.builtin.task import correctness_reward, make_dataset
    from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker, install_cpu_fallbacks

    install_cpu_fallbacks()
    return trainer_class(
        MODEL,
        reward_funcs=correctness_reward,
        args=args,
        train_dataset=make_dataset("train", 8, seed=0),
        processing_class=tokenizer,
        rollout_worker=ReplayRolloutWorker(samples),
        weight_transfer=NoOpWeightTransfer(),
    )


def fake_rollout_sample(policy, tokenizer, prompt, length, generator, *, model_version, group_id, reward=None):
    """A `RolloutSample` of `prompt` with a random completion of `length` tokens, as if TRL's worker had sampled it:
    generator log-probs are `policy`'s plus N(0, 0.3^2) noise (the ratio is off 1, so the flip and the clips act), the
    advantage is N(0, 1), the logged reward `reward` (None: U(0, 1)). Draws from `generator` in that order."""
    import numpy as np
    import torch
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    prompt_ids = list(
        tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    completion = torch.randint(5, tokenizer.vocab_size - 5, (length,), generator=generator).tolist()
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logps = policy(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    noise = 0.3 * torch.randn(length, generator=generator)
    advantage = float(torch.randn(1, generator=generator))
    if reward is None:
        reward = float(torch.rand(1, generator=generator))
    return RolloutSample(
        prompt=prompt,
        completion=[{"role": "assistant", "content": tokenizer.decode(completion)}],
        input_ids=ids[0].numpy(),
        completion_mask=np.asarray([0] * len(prompt_ids) + [1] * length, dtype=np.int64),
        old_log_probs=np.asarray([0.0] * len(prompt_ids) + (logps[-length:] + noise).tolist(), dtype=np.float32),
        advantage=advantage,
        model_version=model_version,
        group_id=group_id,
        metrics={"reward": reward, "reward_std": 0.25},
    )


# Per micro-batch: (samples, completion length) of its two groups; one group per rank.
STEP_GROUPS = [[(1, 12), (7, 2)], [(3, 9), (5, 3)]]


def step_samples(tokenizer) -> list:
    """The `RolloutSample`s of one optimizer step of the two-process asynchronous test, in queue order (the groups of
    `STEP_GROUPS`, model version 0, reward 0.5), each a `fake_rollout_sample`."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_aspo.builtin.task import make_dataset

    policy = AutoModelForCausalLM.from_pretrained(MODEL)
    generator = torch.Generator().manual_seed(0)
    dataset = make_dataset("train", 4, seed=0)
    groups = [group for step in STEP_GROUPS for group in step]
    return [
        fake_rollout_sample(
            policy,
            tokenizer,
            dataset[group_id]["prompt"],
            length,
            generator,
            model_version=0,
            group_id=group_id,
            reward=0.5,
        )
        for group_id, (count, length) in enumerate(groups)
        for _ in range(count)
    ]


# ------------------------------------------------------------------------------------ prioritized sampling (async)
def certain_half_init_file(tmp_path, dataset) -> tuple[str, set[str]]:
    """A value_init_file putting every even row at value 1 - 1e-12 (Beta(1e6, 1e-6)): weight ~2e-6 at
    priority_epsilon=1e-6, against >= ~0.1 for a prompt whose value is anywhere in [0.01, 0.99]."""
    from trl_aspo.values.prompt_ids import prompt_key

    keys = [prompt_key(prompt) for prompt in dataset["prompt"]]
    certain = set(keys[0::2])
    path = tmp_path / "init.json"
    path.write_text(json.dumps([{"prompt_id": key, "alpha": 1e6, "beta": 1e-6} for key in sorted(certain)]))
    return str(path), certain


def prioritized_fields(tmp_path, init_file, **overrides):
    fields = dict(per_device_train_batch_size=4, num_generations=1, max_steps=3, max_inflight_tasks=1)
    return dict(
        **async_fields(tmp_path, **{**fields, **overrides}),
        advantage_estimator="spo++",
        loss_type="aspo",
        prioritized_sampling=True,
        priority_epsilon=1e-6,
        value_init_file=init_file,
    )


def recording_scores(trainer) -> list:
    """Patches `trainer._score_step` to record every sample it scores; returns the (growing) list."""
    samples, score_step = [], trainer._score_step

    def recording_score_step(step_samples, context=()):
        samples.extend(step_samples)
        return score_step(step_samples, context)

    trainer._score_step = recording_score_step
    return samples


def recording_batches(trainer) -> list[dict]:
    """Patches `trainer._generate_and_score_completions` to keep every generation batch it returns (after the
    trainer's own advantage rewrite); returns the (growing) list."""
    batches, generate = [], trainer._generate_and_score_completions

    def recording(inputs):
        batches.append(generate(inputs))
        return batches[-1]

    trainer._generate_and_score_completions = recording
    return batches


def recording_rounds(trainer) -> list:
    """Patches `trainer._generate_and_score_completions` to record, per generation round, the rank's advantages and
    the gathered rewards of the first reward function (lists, for a worker's JSON); returns the (growing) list."""
    rounds, generate = [], trainer._generate_and_score_completions

    def recording(inputs):
        output = generate(inputs)
        rounds.append(
            {
                "local_advantages": output["advantages"].tolist(),
                "gathered_rewards": trainer._gathered_rewards_per_func[:, 0].tolist(),
            }
        )
        return output

    trainer._generate_and_score_completions = recording
    return rounds


# --------------------------------------------------------------------------------- `trl-aspo compare` experiments
BASE = """
base:
  model_name_or_path: builtin:tiny-random
  dataset_name: builtin:calculator
  builtin_train_size: 16
  builtin_test_size: 2
  reward_funcs: [builtin:correctness]
  tools: [builtin:calculator]
  max_steps: 2
  per_device_train_batch_size: 4
  num_generations: 2
  max_completion_length: 12
  max_tool_calling_iterations: 1
  learning_rate: 1.0e-3
  logging_steps: 1
  save_strategy: "no"
  report_to: none
  use_cpu: true
  bf16: false
"""
BASE_THREE_STEPS = BASE.replace("max_steps: 2", "max_steps: 3")
ASYNC_BASE = """
base:
  trainer: async
  rollout_worker: local
  rollout_jitter_s: 0.02
  model_name_or_path: builtin:tiny-calculator
  dataset_name: builtin:calculator
  builtin_train_size: 16
  builtin_test_size: 2
  reward_funcs: [builtin:correctness]
  tools: [builtin:calculator]
  max_steps: 2
  per_device_train_batch_size: 4
  max_completion_length: 12
  max_tool_calling_iterations: 1
  token_budget: 0
  max_staleness: 2
  learning_rate: 1.0e-3
  logging_steps: 1
  save_strategy: "no"
  report_to: none
  use_cpu: true
  bf16: false
"""


def write_experiment(tmp_path, body: str, base: str = BASE) -> str:
    path = tmp_path / "experiment.yaml"
    path.write_text(textwrap.dedent(body) + textwrap.dedent(base))
    return str(path)


def write_async_experiment(tmp_path, body: str) -> str:
    return write_experiment(tmp_path, body, base=ASYNC_BASE)


def two_by_two(tmp_path) -> tuple[str, object]:
    """An experiment of variants dapo and aspo over seeds 0 and 1, three steps each; (its file, its output_dir)."""
    output = tmp_path / "cmp"
    body = f"""
        output_dir: {output}
        seeds: [0, 1]
        variants:
          dapo: {{loss_type: dapo}}
          aspo: {{loss_type: aspo}}
        """
    return write_experiment(tmp_path, body, base=BASE_THREE_STEPS), output


def packed_inputs(old_probs: list[float], advantages: list[float], segments: list[int]) -> dict:
    """One packed row as AsyncGRPOTrainer's collator lays it out for `compute_loss` (one rank): every position a loss
    target, with the generator's probabilities `old_probs`, per-token `advantages` and each token's sample."""
    import torch

    n = len(old_probs)
    unused = torch.full((1, 1), -1)
    return {
        "attention_mask": torch.ones(1, n, dtype=torch.long),
        "input_ids": torch.zeros(1, n, dtype=torch.long),
        "position_ids": torch.arange(n)[None],
        "shift_labels": torch.zeros(1, n, dtype=torch.long),
        "token_index": torch.arange(n)[None],
        "old_log_probs": torch.tensor(old_probs).log()[None],
        "advantages": torch.tensor(advantages)[None],
        "segment_id": torch.tensor(segments)[None],
        "tree_kv_index": unused,
        "tree_cu_seqlens_q": unused,
        "tree_cu_seqlens_k": unused,
        "tree_max_seqlens": torch.tensor([[n, n]]),
        "global_n_tokens": torch.tensor([float(n)]),
        "global_n_forward_tokens": torch.tensor([float(n)]),
        "mean_seq_len": torch.tensor([n / (max(segments) + 1)]),
    }


def fixed_policy(log_probs):
    """A stand-in for the model in `compute_loss`: its packed forward returns `log_probs` (1, M)."""
    from types import SimpleNamespace

    import torch

    def forward(**_):
        return SimpleNamespace(log_probs=log_probs, entropy=torch.zeros_like(log_probs), aux_loss=None)

    return forward


# --------------------------------------------------------------------------------------------------- evaluation
# What `evaluate_tool_use` reports besides the per-sample `records`: the summary `trl-aspo evaluate` writes.
TOOL_USE_METRICS = {
    "accuracy",
    "pass_at_k",
    "mean_reward",
    "tool_call_rate",
    "mean_first_call_position",
    "calls_per_completion",
    "interactive_turns_per_completion",
    "accuracy_with_call",
    "accuracy_without_call",
    "mean_completion_length",
    "num_problems",
    "num_samples",
}


# ------------------------------------------------------------------------------------------------------- misc
def stepped_learning_rates(lr_lambda, base_lr: float, steps: int) -> list[float]:
    """The learning rate of each of `steps` optimizer steps under `LambdaLR(lr_lambda)`."""
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def load_script(name: str):
    """scripts/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is being executed
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ child processes
def die_with_parent() -> None:
    """`preexec_fn` of a server a test starts in its own session: the kernel sends it SIGTERM when the process that
    started it dies (PR_SET_PDEATHSIG), so a test run killed by a timeout, even by SIGKILL, leaves no server behind."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
