"""GPU check: step time and peak memory of `ASPOTrainer` against `GRPOTrainer`, a device/dtype audit, and both
trainers on SmolLM2-135M's architecture and tokenizer in bf16 and fp32.

What is measured
----------------
A randomly initialized Qwen2 of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, tied embeddings, the real vocabulary size 151,936; about 494M parameters; config built in code, no hub) in
bf16 on CUDA. Both trainers get the same `rollout_func`, which skips generation and returns the same pre-made ids
(prompt and completion ids, and an `env_mask`) for the i-th row of every round: fixed-length completions
(1024 tokens by default) that end with EOS, where every other completion holds a `<tool_call>` block followed by a
masked tool response. The rows and the reward pattern are the same for both trainers, so what differs is the
trainers' own work per optimizer step: TRL's round bookkeeping (decode, rewards, metrics), the advantage
computation, one forward and backward of the completions with per-token log-probs and entropies over the
151,936-entry vocabulary, the loss, and the optimizer step (AdamW at learning rate 0, so every repeat sees the same
weights). Generation is not measured.

- `grpo`: `GRPOTrainer`, TRL's default loss (`dapo`), `num_generations=2` (TRL refuses 1): half as many prompts,
  the same completions per step.
- `aspo`: `ASPOTrainer` with `loss_type="aspo"`, `tool_shaping=True`, `advantage_estimator="spo++"`,
  `num_generations=1`. The issue's goal: median step at most 1.02x `grpo`'s.

Both are on-policy (one optimizer step per round, no old-log-prob pass), gradient checkpointing at TRL's default.
A step is timed from `on_step_begin` to `on_step_end` with the device synchronized at both ends; the trainers run
interleaved (one `train()` of `--steps` steps each, in turn, `--repeats` times), the first step of every call is
dropped, and the median is reported. Peak memory is `torch.cuda.max_memory_allocated` over each trainer's timed
calls, reset before every call: `peak` is absolute (both models and optimizer states are resident),
`peak_over_start` subtracts what was allocated when the call began (the step's own working memory). On CUDA one
more call per trainer runs under `torch.cuda.set_sync_debug_mode("warn")` and counts host synchronizations per step,
listing the package's own lines that synchronize.

The device/dtype audit runs the package's losses, shaping, tool detection, normalization, tracker rewards and
drift on the device in the model dtype and checks the dtype and device of every output (metrics are float32 by
design, the value tracker is a host-side table of float64 by design), and checks the dtype and device of the
trainers' loss and advantages in the real step.

The SmolLM2 case
----------------
SmolLM2-135M's architecture (`LlamaForCausalLM`: hidden 576, 30 layers, 9 heads, 3 KV heads, tied embeddings) with
its real tokenizer, as `trl_aspo.builtin.smollm2` converts it (49,156 entries: `<tool_call>`, `</tool_call>`,
`<tool_response>`, `</tool_response>` added as single tokens; TRL's Qwen2.5 chat template), from the config and
tokenizer files in `scripts/gpu_assets/smollm2_135m/` (3.5 MB; scripts/gpu_assets/copy_smollm2.py copies them from
the converted folder). The weights are random (seed 0): the real ones (538 MB in float32) cannot reach the GPU machine,
which takes 64 MiB of carried files and has no network. In bf16 and in fp32, `ASPOTrainer` (through `rollout_func`,
as above) and `AsyncASPOTrainer` (through `trl_aspo.infra.replay.ReplayRolloutWorker`, which replays pre-made samples
and generates nothing) each run one `train()` of `--steps` steps with `loss_type="aspo"`, `tool_shaping=True`,
`advantage_estimator="spo++"` and one completion per prompt, one trainer at a time. The rows are chat prompts offering
a calculator tool and completions of the same length as above in the tokenizer's ids, where every other completion
writes a real `<tool_call>` JSON `</tool_call>` followed by the tool's turn (not generated), so tool detection and
shaping run on the real tokenizer's call tokens. Recorded per run: the step times (the first dropped) and their median,
peak memory, and checks that every parameter is in the run's dtype on the device, that the loss and advantages of the
real step are floating on the device, and that tool detection finds the calls (half the completions). On CUDA the
asynchronous trainer's packed tree attention uses the package's PyTorch fallback unless TRL's FA3 kernel loads from
the Hub (it cannot there); the result says which ran. The case is a dtype/device and code-path check; its timings are
not compared with anything.

`--small` (automatic without CUDA) runs both cases on CPU: the Qwen case in float32 with hidden 64, 2 layers, a
4,096-entry vocabulary and 64-token completions; the SmolLM2 case with 2 layers and hidden 64 but the real tokenizer,
in bf16 and fp32, with 96-token completions. So the script is tested without a GPU (tests/integration/
test_gpu_check.py); a CPU ratio says little about the GPU one. `--case qwen` or `--case smollm2` runs one case.

Running it on the GPU machine (Python 3.12, no network; torch, transformers, accelerate, peft, pyarrow, pandas are
preinstalled; trl, datasets, dill, multiprocess and this package are not): build the wheels here with
`scripts/build_gpu_wheels.sh` (or `make gpu-wheels`; into `build/gpu_wheels`, ignored by git), then call the device
tool with `carry=["build/gpu_wheels"]`, `timeout_s=600` and this command (one line):

    set -o pipefail; W=build/gpu_wheels; python3 -m pip install -q --no-index --find-links $W $W/trl_aspo-*.whl
    > $OUT/pip.log 2>&1 || { echo "resolver install failed (pip.log); installing without dependency checks";
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $W/trl-*.whl $W/datasets-*.whl
    $W/dill-*.whl $W/multiprocess-*.whl >> $OUT/pip.log 2>&1 && export PYTHONPATH=/tmp/site; };
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1
    python3 scripts/gpu_check.py --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

pip keeps every preinstalled package that satisfies the pins and takes the rest from the wheels; `PYTHONPATH=$PWD`
makes the working tree's `trl_aspo` the one measured (the wheel only brings its dependency list); `HF_HUB_OFFLINE=1`
keeps TRL's FA3 kernel lookup off the network, which the machine does not have. The script keeps itself to
`--time-budget` seconds (420 by default) by running fewer repeats of the Qwen case when steps are slow, leaving 90 s of
it to the SmolLM2 case that follows (an estimate, not a measurement); the JSON file is written after each case, so a
run stopped during the SmolLM2 case keeps the Qwen result. The result records the versions it ran with. Exit status 1
means a check failed (in either case).

Usage: python scripts/gpu_check.py [--out gpu_check.json] [--small] [--case all|qwen|smollm2] [--repeats 10]
       [--steps 4] [--batch 8]
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoTokenizer,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
    set_seed,
)
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import GRPOConfig, GRPOTrainer
from trl.experimental.async_grpo import packing
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

import trl_aspo
from trl_aspo import ASPOConfig, ASPOTrainer, AsyncASPOConfig, AsyncASPOTrainer
from trl_aspo.algorithms.losses import (
    aggregate_loss,
    asymmetric_policy_loss,
    entropy_split_mask,
    repetition_rate,
    unflipped_sample_mask,
)
from trl_aspo.algorithms.tool_metrics import first_tool_call_positions
from trl_aspo.infra.replay import NoOpWeightTransfer, ReplayRolloutWorker
from trl_aspo.infra.tree_attention import TORCH_VARLEN_KERNEL, install_tree_attention_fallback
from trl_aspo.values.event_tracker import EventValueTracker
from trl_aspo.values.kl_rho import kl_adaptive_rho, logprob_drift
from trl_aspo.values.scoring import normalize_advantages, tool_shaping_bias
from trl_aspo.values.single_stream import tracker_rewards

GOAL_RATIO = 1.02
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
PAD, EOS, CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE = range(len(SPECIAL_TOKENS))
SYNC_WARNING = "synchronizing"
DISTRIBUTIONS = ("torch", "transformers", "trl", "datasets", "pyarrow", "accelerate", "peft", "huggingface-hub")
# Logged by the last timed step of each trainer, kept in the result as a sanity check of what the steps did.
LOGGED = ("loss", "completions/mean_length", "tools/tool_call_frac", "shaping/eligible_frac", "zero_advantage_share")


@dataclass(frozen=True)
class Shape:
    """Model and batch sizes of one mode."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    completion_length: int
    prompt_length: int


QWEN25_05B = Shape(896, 24, 14, 2, 4864, 151_936, 1024, 64)
SMALL = Shape(64, 2, 4, 2, 128, 4096, 64, 16)


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of exactly `vocab_size` entries: the chat/tool markers, then `t6`, `t7`, ... so the
    logits have the real vocabulary dimension without a hub download."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{index}": index for index in range(len(SPECIAL_TOKENS), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[PAD]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_tokens([AddedToken(token, normalized=False) for token in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=SPECIAL_TOKENS[PAD], eos_token=SPECIAL_TOKENS[EOS]
    )


def build_model(shape: Shape, device: torch.device, dtype: torch.dtype) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    config._name_or_path = f"random-qwen2-h{shape.hidden}-l{shape.layers}"
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM._from_config(config, dtype=dtype)


def make_rows(shape: Shape, batch: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """The pre-made `rollout_func` output of each row of a round: prompt ids, completion ids and env_mask.

    Even rows call a tool at a position that grows with the row (so tool shaping has positions to compare): opener,
    8 argument tokens, closer, then a 32-token tool response that `env_mask` marks as not generated."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in range(batch):
        ids = torch.randint(
            len(SPECIAL_TOKENS), shape.vocab, (shape.prompt_length + shape.completion_length,), generator=generator
        )
        prompt, completion = ids[: shape.prompt_length].tolist(), ids[shape.prompt_length :].tolist()
        env_mask = [1] * shape.completion_length
        block = 2 + 8 + 2 + 32
        if row % 2 == 0 and shape.completion_length > block + 2:
            start = (row * shape.completion_length // (2 * batch)) % (shape.completion_length - block - 1)
            completion[start] = CALL_OPEN
            completion[start + 9] = CALL_CLOSE
            completion[start + 10] = RESPONSE_OPEN
            completion[start + block - 1] = RESPONSE_CLOSE
            env_mask[start + 10 : start + block] = [0] * (block - 10)
        completion[-1] = EOS
        rows.append({"prompt_ids": prompt, "completion_ids": completion, "env_mask": env_mask})
    return rows


def make_rollout(rows):
    def rollout(prompts, trainer):
        picked = [rows[index % len(rows)] for index in range(len(prompts))]
        return {
            "prompt_ids": [row["prompt_ids"] for row in picked],
            "completion_ids": [row["completion_ids"] for row in picked],
            "logprobs": None,
            "env_mask": [row["env_mask"] for row in picked],
        }

    return rollout


REWARD_PATTERN = (1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0)


def pattern_reward(completions, **kwargs):
    """Reward of the i-th completion of a round from a fixed 0/1 pattern: the same rewards for both trainers."""
    return [REWARD_PATTERN[index % len(REWARD_PATTERN)] for index in range(len(completions))]


class StepRecorder(TrainerCallback):
    """Wall time of every optimizer step of a `train()` call but its first, the device synchronized at both ends,
    and (when `sync_log` is a list of recorded warnings) the host synchronizations of each such step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []
        self.syncs: list[int] = []
        self.sync_log: list | None = None
        self.start = 0.0
        self.sync_start = 0

    def _synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_step_begin(self, args, state, control, **kwargs):
        self._synchronize()
        self.start = time.perf_counter()
        self.sync_start = 0 if self.sync_log is None else len(self.sync_log)

    def on_step_end(self, args, state, control, **kwargs):
        self._synchronize()
        if state.global_step > 1:
            if self.sync_log is None:
                self.times.append(time.perf_counter() - self.start)
            else:
                self.syncs.append(sum(map(is_sync_warning, self.sync_log[self.sync_start :])))


def recording(trainer_cls):
    """`trainer_cls` noting the dtype and device of its first loss and advantages (the same cheap hook on both)."""

    class Recording(trainer_cls):
        seen: dict

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.seen.setdefault("advantages", describe(output["advantages"]))
            return output

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            self.seen.setdefault("loss", describe(loss))
            return loss

    Recording.__name__ = trainer_cls.__name__
    return Recording


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(tensor: torch.Tensor) -> dict[str, str]:
    return {"dtype": dtype_name(tensor.dtype), "device": tensor.device.type}


# The three methods, on in every ASPO run of this script (both trainers).
ASPO_METHODS = {"num_generations": 1, "loss_type": "aspo", "tool_shaping": True, "advantage_estimator": "spo++"}
ROWS = {
    "grpo": (GRPOTrainer, GRPOConfig, {"num_generations": 2}),
    "aspo": (ASPOTrainer, ASPOConfig, ASPO_METHODS),
}


def build_trainer(name, model, tokenizer, rollout, args, completion_length, device, dtype, output_dir):
    trainer_cls, config_cls, extra = ROWS[name]
    config = config_cls(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch,
        max_completion_length=completion_length,
        max_steps=args.steps,
        learning_rate=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        seed=0,
        disable_tqdm=True,
        **extra,
    )
    prompts = Dataset.from_dict({"prompt": [f"prompt {index}" for index in range(max(64, 4 * args.batch))]})
    trainer = recording(trainer_cls)(
        model, [pattern_reward], config, train_dataset=prompts, processing_class=tokenizer, rollout_func=rollout
    )
    trainer.seen = {}
    for callback in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(callback)
    recorder = StepRecorder(device)
    trainer.add_callback(recorder)
    return trainer, recorder


def train_once(trainer) -> None:
    """One `train()` from the same RNG state (`Trainer.train` does not reseed)."""
    set_seed(trainer.args.seed)
    trainer.train()


def expect(name: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> dict:
    ok = tensor.dtype == dtype and tensor.device.type == device.type
    return {"name": name, **describe(tensor), "expected_dtype": dtype_name(dtype), "ok": ok}


def device_dtype_checks(device: torch.device, dtype: torch.dtype, shape: Shape, batch: int) -> list[dict]:
    """Run the package's tensor functions on `device` in `dtype`; every output keeps the input's dtype and device
    except documented metrics (float32), drift/rho (float64) and the value tracker (host float64 by design)."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    length = shape.completion_length
    logps = (-torch.rand(batch, length, generator=generator)).to(device, dtype).requires_grad_()
    old = (logps.detach() + 0.05 * torch.randn(batch, length, generator=generator).to(device, dtype)).clamp(max=0)
    advantages = torch.randn(batch, generator=generator).to(device, dtype)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[:, -3:] = 0
    checks = []

    per_token_loss, stats = asymmetric_policy_loss(logps, old, advantages, dual_clip_pos=3.0)
    checks.append(expect("asymmetric_policy_loss", per_token_loss, dtype, device))
    checks.append(expect("asymmetric_policy_loss stats (metric)", stats["flip_weight"], torch.float32, device))
    loss = aggregate_loss(per_token_loss, mask, "token")
    checks.append(expect("aggregate_loss token", loss, dtype, device))
    checks.append(expect("aggregate_loss sequence", aggregate_loss(per_token_loss, mask, "sequence"), dtype, device))
    loss.backward()
    checks.append(expect("asymmetric_policy_loss gradient", logps.grad, dtype, device))
    entropies = torch.rand(batch, length, generator=generator).to(device, dtype)
    checks.append(expect("entropy_split_mask", entropy_split_mask(entropies, mask, 0.8), torch.bool, device))
    unflipped = unflipped_sample_mask(advantages, 0.5, torch.Generator().manual_seed(0))
    checks.append(expect("unflipped_sample_mask", unflipped, torch.bool, device))

    rows = make_rows(shape, batch)
    completion_ids = torch.tensor([row["completion_ids"] for row in rows], device=device)
    tool_mask = torch.tensor([row["env_mask"] for row in rows], device=device)
    checks.append(
        expect("repetition_rate (metric)", repetition_rate(completion_ids, tool_mask), torch.float32, device)
    )
    positions, lengths, calls, turns = first_tool_call_positions(completion_ids, tool_mask, mask, [CALL_OPEN])
    checks.append(expect("first_tool_call_positions", positions, positions.dtype, device))
    scores = torch.tensor([REWARD_PATTERN[i % len(REWARD_PATTERN)] for i in range(batch)], device=device)
    config = ASPOConfig(
        output_dir=tempfile.gettempdir(),
        num_generations=1,
        advantage_estimator="spo++",
        tool_shaping=True,
        use_cpu=device.type == "cpu",
        report_to="none",
    )
    group_ids = torch.zeros(batch, dtype=torch.long, device=device)
    bias, eligible = tool_shaping_bias(advantages, scores, positions, lengths, group_ids, config)
    checks.append(expect("tool_shaping_bias", bias, dtype, device))
    checks.append(expect("tool_shaping_bias eligible", eligible, torch.bool, device))
    scorable = torch.ones(batch, dtype=torch.bool, device=device)
    for normalization in ("batch", "token"):
        normalized = normalize_advantages(advantages, lengths, scorable, normalization)
        checks.append(expect(f"normalize_advantages {normalization}", normalized, dtype, device))
    checks.append(expect("tracker_rewards", tracker_rewards(scores.to(dtype), config), dtype, device))
    drift = logprob_drift(old, logps.detach(), mask)
    checks.append(expect("logprob_drift (float64)", drift, torch.float64, device))
    checks.append(expect("kl_adaptive_rho (float64)", kl_adaptive_rho(drift), torch.float64, device))
    tracker = EventValueTracker()
    keys = [f"prompt {index}" for index in range(batch)]
    tracker.enter(keys, 0)
    tracker.observe(keys, scores.double().cpu(), [0] * batch)
    checks.append(
        expect("EventValueTracker.value (host table)", tracker.value(keys, 1), torch.float64, torch.device("cpu"))
    )
    return checks


def trainer_checks(trainers, device: torch.device) -> list[dict]:
    checks = []
    for name, (trainer, _) in trainers.items():
        for what, seen in trainer.seen.items():
            ok = seen["device"] == device.type and seen["dtype"] in ("float32", "bfloat16", "float16")
            checks.append({"name": f"{name} step {what}", **seen, "expected_dtype": "floating", "ok": ok})
    return checks


def count_syncs(trainers, package_root: Path) -> dict[str, dict]:
    """Host synchronizations per timed step of one more `train()` call per trainer, and the package's own lines
    that synchronize (file:line -> count over the call)."""
    result = {}
    for name, (trainer, recorder) in trainers.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            recorder.sync_log = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_once(trainer)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                recorder.sync_log = None
        result[name] = {
            "per_step": statistics.median(recorder.syncs) if recorder.syncs else None,
            "package_sites": package_sync_sites(caught, package_root),
        }
    return result


def is_sync_warning(record: warnings.WarningMessage) -> bool:
    """Whether a recorded warning is `torch.cuda.set_sync_debug_mode("warn")`'s report of a host synchronization."""
    return SYNC_WARNING in str(record.message)


def package_sync_sites(records: list[warnings.WarningMessage], package_root: Path) -> dict[str, int]:
    """`path:line` (relative to the package's parent) -> count, for the synchronizations raised from the package's
    own code, most frequent first."""
    sites = collections.Counter(
        f"{Path(record.filename).relative_to(package_root.parent)}:{record.lineno}"
        for record in records
        if is_sync_warning(record) and Path(record.filename).is_relative_to(package_root)
    )
    return dict(sites.most_common())


# ------------------------------------------------------------------------------------------------ the SmolLM2 case
SMOLLM2_ASSETS = Path(__file__).resolve().parent / "gpu_assets" / "smollm2_135m"
# The CPU run's model: SmolLM2's architecture at 2 layers; the tokenizer, and so the vocabulary, stay the real ones.
SMOLLM2_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
SMOLLM2_SMALL_COMPLETION = 96  # room for the call, the tool's turn and the answer (about 70 tokens)
SMOLLM2_DTYPES = (torch.bfloat16, torch.float32)
SMOLLM2_TRAINERS = ("aspo", "async_aspo")
# Seconds of --time-budget the Qwen case leaves to the SmolLM2 case after it on the GPU: an estimate (two dtypes x two
# trainers x --steps steps of a 135M model, plus building each trainer), not a measurement.
SMOLLM2_RESERVE_S = 90.0
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 12*7"}},
            "required": ["expression"],
        },
    },
}


def smollm2_config(small: bool):
    """SmolLM2-135M's `LlamaConfig` from the carried assets (30 layers, hidden 576, 49,156 entries with the four
    added tool tokens), shrunk to `SMOLLM2_SMALL` in the small mode."""
    config = AutoConfig.from_pretrained(SMOLLM2_ASSETS)
    if small:
        for name, value in SMOLLM2_SMALL.items():
            setattr(config, name, value)
    return config


def build_smollm2(config, device, dtype: torch.dtype) -> LlamaForCausalLM:
    """`LlamaForCausalLM` of `config` with random weights (seed 0): no weight file reaches the GPU machine."""
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM._from_config(config, dtype=dtype)


def smollm2_rows(tokenizer, batch: int, completion_length: int, seed: int = 0) -> list[dict]:
    """The SmolLM2 case's pre-made rows in the real tokenizer's ids: a chat prompt offering a calculator tool (the
    template the conversion sets, TRL's Qwen2.5 one) and a completion of exactly `completion_length` tokens.

    Even rows write a real call, `<tool_call>` JSON `</tool_call>` and `<|im_end|>` (the conversion makes the tool
    markers single added tokens), at a position that grows with the row, followed by the tool's turn as TRL appends
    it, which `env_mask` marks as not generated; every row ends with the answer and `<|im_end|>`. The rest is filler:
    random ids of ordinary vocabulary entries (no special or added token)."""
    generator = torch.Generator().manual_seed(seed)
    ordinary = torch.tensor(sorted(set(range(len(tokenizer))) - set(tokenizer.added_tokens_decoder)))

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    rows = []
    for row in range(batch):
        a, b = 12 + row, 7 + 3 * row
        messages = [
            {"role": "system", "content": "You are a careful assistant. Use the calculator for arithmetic."},
            {"role": "user", "content": f"What is {a}*{b}?"},
        ]
        prompt_ids = tokenizer.apply_chat_template(
            messages, tools=[CALCULATOR_TOOL], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        call, response = [], []
        if row % 2 == 0:
            arguments = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
            call = encode(f"<tool_call>\n{arguments}\n</tool_call><|im_end|>")
            response = encode(f"\n<|im_start|>user\n<tool_response>\n{a * b}\n</tool_response><|im_end|>\n")
            response += encode("<|im_start|>assistant\n")
        answer = encode(f"The answer is {a * b}.<|im_end|>")
        free = completion_length - len(call) - len(response) - len(answer)
        if free < 0:
            raise ValueError(
                f"SmolLM2 case: a completion of {completion_length} tokens cannot hold the call, the tool's turn and "
                f"the answer ({completion_length - free} tokens); raise --completion-length."
            )
        filler = ordinary[torch.randint(len(ordinary), (free,), generator=generator)].tolist()
        before = row * free // (2 * batch)
        rows.append(
            {
                "messages": messages,
                "prompt_ids": list(prompt_ids),
                "completion_ids": filler[:before] + call + response + filler[before:] + answer,
                "env_mask": [1] * (before + len(call)) + [0] * len(response) + [1] * (free - before + len(answer)),
            }
        )
    return rows


def smollm2_samples(tokenizer, rows: list[dict]) -> list[RolloutSample]:
    """One `RolloutSample` per row, as TRL's rollout worker hands a one-completion group to the trainer: prompt and
    completion ids laid end to end, `completion_mask` 1 on the generated tokens (0 on the prompt and the tool's turn),
    the row's reward from `REWARD_PATTERN`. The generator's log-probs are -log(vocabulary size) on every generated
    token: a randomly initialized model's next-token distribution is close to uniform, so the ratio stays near 1."""
    uniform = -math.log(len(tokenizer))
    samples = []
    for index, row in enumerate(rows):
        mask = [0] * len(row["prompt_ids"]) + row["env_mask"]
        samples.append(
            RolloutSample(
                prompt=row["messages"],
                completion=[{"role": "assistant", "content": tokenizer.decode(row["completion_ids"])}],
                input_ids=np.asarray(row["prompt_ids"] + row["completion_ids"], dtype=np.int64),
                completion_mask=np.asarray(mask, dtype=np.int64),
                old_log_probs=np.asarray([uniform * keep for keep in mask], dtype=np.float32),
                advantage=0.0,
                model_version=0,
                group_id=index,
                metrics={"reward": REWARD_PATTERN[index % len(REWARD_PATTERN)], "reward_std": 0.0},
            )
        )
    return samples


def recording_async(trainer_cls):
    """`trainer_cls` (asynchronous) noting the dtype and device of its first loss and of the advantages it trains on
    (TRL's `compute_loss` is the one method that sees both)."""

    class Recording(trainer_cls):
        seen: dict

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.seen.setdefault("advantages", describe(inputs["advantages"]))
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.seen.setdefault("loss", describe(loss[0] if return_outputs else loss))
            return loss

    Recording.__name__ = trainer_cls.__name__
    return Recording


def build_async_trainer(model_dir, tokenizer, rows, args, completion_length, device, dtype, output_dir):
    """`AsyncASPOTrainer` on the model saved in `model_dir` (it loads its policy from a path), the three methods on,
    trained on `rows` replayed by a `ReplayRolloutWorker`."""
    config = AsyncASPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch,
        max_completion_length=completion_length,
        max_steps=args.steps,
        learning_rate=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        dtype=dtype_name(dtype),
        token_budget=0,  # a fixed count of samples per micro-batch: without a vLLM server there is no max_model_len
        seed=0,
        disable_tqdm=True,
        **ASPO_METHODS,
    )
    trainer = recording_async(AsyncASPOTrainer)(
        model_dir,
        reward_funcs=[pattern_reward],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [row["messages"] for row in rows]}),
        processing_class=tokenizer,
        rollout_worker=ReplayRolloutWorker(
            smollm2_samples(tokenizer, rows), cycle=True, restamp_version=True, new_group_ids=True
        ),
        weight_transfer=NoOpWeightTransfer(),
    )
    trainer.seen = {}
    for callback in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(callback)
    recorder = StepRecorder(device)
    trainer.add_callback(recorder)
    return trainer, recorder


def last_log(trainer) -> dict:
    """The `LOGGED` values of the trainer's last optimizer step."""
    log = [entry for entry in trainer.state.log_history if "loss" in entry][-1]
    return {key: log.get(key) for key in LOGGED}


def release_memory(device: torch.device) -> None:
    """Collect the trainers of an earlier run, so the next run's peak memory is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_train(trainer, recorder, device: torch.device) -> dict:
    """One `train()` (`--steps` steps, the first not timed): step times and peak memory (CUDA only)."""
    start_bytes = peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    train_once(trainer)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    return {
        "median_step_s": statistics.median(recorder.times),
        "step_s": recorder.times,
        "peak_memory_bytes": peak,
        "peak_memory_over_start_bytes": None if peak is None else peak - start_bytes,
        "last_log": last_log(trainer),
    }


def smollm2_run(kind, config, tokenizer, rows, args, completion_length, device, dtype, scratch) -> tuple[dict, list]:
    """One trainer of the SmolLM2 case in one dtype: its timed `train()` and its checks (every parameter in `dtype`
    on the device, the loss and advantages floating on the device, the rows' calls found by tool detection)."""
    label = f"smollm2 {dtype_name(dtype)} {kind}"
    model = build_smollm2(config, device, dtype)
    output_dir = f"{scratch}/{label.replace(' ', '-')}"
    if kind == "aspo":
        rollout = make_rollout(rows)
        trainer, recorder = build_trainer(
            "aspo", model, tokenizer, rollout, args, completion_length, device, dtype, output_dir
        )
    else:
        model_dir = f"{output_dir}-model"
        model.save_pretrained(model_dir)
        del model
        trainer, recorder = build_async_trainer(
            model_dir, tokenizer, rows, args, completion_length, device, dtype, output_dir
        )
    try:
        record = {"trainer": kind, "dtype": dtype_name(dtype), **timed_train(trainer, recorder, device)}
        if kind == "async_aspo":
            kernel = packing._flash_attn()  # resolved (and cached) by the run's first forward
            record["tree_attention"] = "PyTorch fallback" if kernel is TORCH_VARLEN_KERNEL else "FA3 kernel"
        parameters = list(trainer.model.parameters())
        dtypes = sorted({dtype_name(p.dtype) for p in parameters})
        devices = sorted({p.device.type for p in parameters})
        checks = [
            {
                "name": f"{label} model parameters",
                "dtype": ",".join(dtypes),
                "device": ",".join(devices),
                "expected_dtype": dtype_name(dtype),
                "ok": dtypes == [dtype_name(dtype)] and devices == [device.type],
            }
        ]
        for what, seen in trainer.seen.items():
            ok = seen["device"] == device.type and seen["dtype"] in ("float32", "bfloat16", "float16")
            checks.append({"name": f"{label} step {what}", **seen, "expected_dtype": "floating", "ok": ok})
        calling = sum(0 in row["env_mask"] for row in rows) / len(rows)
        found = record["last_log"]["tools/tool_call_frac"]
        checks.append(
            {"name": f"{label} tool calls detected", "value": found, "expected": calling, "ok": found == calling}
        )
    finally:
        free_trainer(trainer)
    return record, checks


def free_trainer(trainer) -> None:
    """Drop every reference the trainer holds to its model and optimizer. TRL's asynchronous trainer outlives its
    run (the trace-logging thread of its rollout dataset holds the dataset, which holds the trainer), so without
    this the next run would start with its weights and optimizer states still allocated."""
    trainer.accelerator.free_memory()
    for holder in (trainer, trainer.callback_handler):
        holder.model = holder.optimizer = holder.lr_scheduler = None
    trainer.model_wrapped = None


def smollm2_case(args, small: bool, device: torch.device) -> dict:
    """SmolLM2-135M's architecture and real tokenizer with random weights, in bf16 and fp32, through `ASPOTrainer`
    and `AsyncASPOTrainer` (the three methods on): one `train()` of `--steps` steps each, one trainer alive at a
    time."""
    install_tree_attention_fallback()  # TRL fetches its FA3 kernel from the Hub, which the GPU machine cannot reach
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_ASSETS)
    config = smollm2_config(small)
    completion_length = args.completion_length or (SMOLLM2_SMALL_COMPLETION if small else QWEN25_05B.completion_length)
    rows = smollm2_rows(tokenizer, args.batch, completion_length)
    parameters = sum(p.numel() for p in build_smollm2(config, "meta", torch.float32).parameters())
    print(
        f"SmolLM2 case: LlamaForCausalLM {parameters / 1e6:.1f}M parameters (random weights), vocab "
        f"{config.vocab_size}, {args.batch} completions x {completion_length} tokens per step, {device}",
        flush=True,
    )
    runs, checks = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for dtype in SMOLLM2_DTYPES:
            for kind in SMOLLM2_TRAINERS:
                release_memory(device)
                # As in the Qwen case: a run that fails is a finding; the other runs still go.
                try:
                    record, run_checks = smollm2_run(
                        kind, config, tokenizer, rows, args, completion_length, device, dtype, scratch
                    )
                except Exception as error:
                    traceback.print_exc()
                    name = f"smollm2 {dtype_name(dtype)} {kind}"
                    message = f"{type(error).__name__}: {error}"
                    record = {"trainer": kind, "dtype": dtype_name(dtype), "error": message}
                    run_checks = [{"name": name, "ok": False, "error": message}]
                runs.append(record)
                checks += run_checks
    return {
        "assets": str(SMOLLM2_ASSETS.relative_to(SMOLLM2_ASSETS.parents[2])),
        "weights": "random (seed 0): the real weights cannot reach the GPU machine (64 MiB carried, no network)",
        "model": {
            "parameters": parameters,
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "intermediate": config.intermediate_size,
            "vocab": config.vocab_size,
        },
        "completions_per_step": args.batch,
        "completion_length": completion_length,
        "prompt_lengths": [len(row["prompt_ids"]) for row in rows],
        "timed_steps": args.steps - 1,
        "runs": runs,
        "checks": checks,
    }


# ------------------------------------------------------------------------------------------------------- the run
def qwen_case(args, small: bool, device: torch.device, started: float, time_budget: float) -> dict:
    """The Qwen2.5-0.5B-shape comparison of `GRPOTrainer` and `ASPOTrainer` (the module docstring); fewer repeats
    once the script's elapsed time would pass `time_budget`."""
    dtype = torch.float32 if small else torch.bfloat16
    base = SMALL if small else QWEN25_05B
    shape = Shape(
        **{
            **base.__dict__,
            **({"vocab": args.vocab} if args.vocab else {}),
            **({"completion_length": args.completion_length} if args.completion_length else {}),
        }
    )
    tokenizer = build_tokenizer(shape.vocab)
    model = build_model(shape, device, dtype)
    parameters = sum(p.numel() for p in model.parameters())
    rows = make_rows(shape, args.batch)
    print(
        f"{'small CPU' if small else 'GPU'} mode: Qwen2 {parameters / 1e6:.1f}M parameters, vocab {shape.vocab}, "
        f"{dtype}, {args.batch} completions x {shape.completion_length} tokens per step, {device}",
        flush=True,
    )

    # A check that raises is a finding, not a reason to lose the timings of a device run: record it and go on.
    try:
        checks = device_dtype_checks(device, dtype, shape, args.batch)
    except Exception as error:
        traceback.print_exc()
        checks = [{"name": "device_dtype_checks", "ok": False, "error": f"{type(error).__name__}: {error}"}]
    with tempfile.TemporaryDirectory() as scratch:
        trainers = {}
        for name in ROWS:
            copy = model if name == "aspo" else build_model(shape, device, dtype)
            trainers[name] = build_trainer(
                name,
                copy,
                tokenizer,
                make_rollout(rows),
                args,
                shape.completion_length,
                device,
                dtype,
                f"{scratch}/{name}",
            )
        del model
        for trainer, recorder in trainers.values():
            train_once(trainer)  # warm-up: kernels, optimizer states, the tokenizer's whitespace table
            recorder.times.clear()
        peaks = {name: 0 for name in trainers}
        peaks_over_start = {name: 0 for name in trainers}
        repeats_done = 0
        for _ in range(args.repeats):
            for name, (trainer, _) in trainers.items():
                start_bytes = 0
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start_bytes = torch.cuda.memory_allocated()
                train_once(trainer)
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated()
                    peaks[name] = max(peaks[name], peak)
                    peaks_over_start[name] = max(peaks_over_start[name], peak - start_bytes)
            repeats_done += 1
            elapsed = time.perf_counter() - started
            if elapsed / (repeats_done + 1) * (repeats_done + 2) > time_budget:
                print(f"time budget: stopping after {repeats_done} repeats ({elapsed:.0f} s)", flush=True)
                break
        syncs = sync_error = None
        if device.type == "cuda":
            try:
                syncs = count_syncs(trainers, Path(trl_aspo.__file__).parent)
            except Exception as error:
                traceback.print_exc()
                sync_error = f"{type(error).__name__}: {error}"
        checks += trainer_checks(trainers, device)

    medians = {name: statistics.median(recorder.times) for name, (_, recorder) in trainers.items()}
    ratio = medians["aspo"] / medians["grpo"]
    return {
        "dtype": dtype_name(dtype),
        "model": {"parameters": parameters, **shape.__dict__},
        "completions_per_step": args.batch,
        "repeats": repeats_done,
        "timed_steps_per_call": args.steps - 1,
        "trainers": {
            name: {
                "median_step_s": medians[name],
                "step_s": recorder.times,
                "peak_memory_bytes": peaks[name] if device.type == "cuda" else None,
                "peak_memory_over_start_bytes": peaks_over_start[name] if device.type == "cuda" else None,
                "syncs_per_step": None if syncs is None else syncs[name]["per_step"],
                "package_sync_sites": None if syncs is None else syncs[name]["package_sites"],
                "last_log": last_log(trainer),
            }
            for name, (trainer, recorder) in trainers.items()
        },
        "sync_count_error": sync_error,
        "ratio_aspo_over_grpo": ratio,
        "goal_ratio": GOAL_RATIO,
        "meets_goal": ratio <= GOAL_RATIO,
        "checks": checks,
    }


def all_checks(result: dict) -> list[dict]:
    """The checks of every case that ran."""
    return result.get("checks", []) + result.get("smollm2", {}).get("checks", [])


def write_result(result: dict, out: str, started: float) -> None:
    """Complete `result` (checks verdict, versions, elapsed time) and write it to `out`."""
    result["all_checks_ok"] = all(check["ok"] for check in all_checks(result))
    result["versions"] = {
        "python": platform.python_version(),
        **{name: importlib.metadata.version(name) for name in DISTRIBUTIONS},
        "trl_aspo_source": str(Path(trl_aspo.__file__).parent),
    }
    result["elapsed_s"] = time.perf_counter() - started
    Path(out).write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="JSON result file")
    parser.add_argument("--small", action="store_true", help="small CPU models (automatic without CUDA)")
    parser.add_argument("--case", choices=("all", "qwen", "smollm2"), default="all", help="which case(s) to run")
    parser.add_argument("--repeats", type=int, help="train() calls per trainer, interleaved (10 GPU, 2 small)")
    parser.add_argument("--steps", type=int, help="steps per train() call, the first not timed (4 GPU, 3 small)")
    parser.add_argument("--batch", type=int, default=None, help="completions per step (8 GPU, 4 small)")
    parser.add_argument(
        "--completion-length", type=int, help="tokens per completion (1024 GPU; 64 small, 96 small SmolLM2)"
    )
    parser.add_argument("--vocab", type=int, help="the Qwen case's vocabulary size (151936 GPU, 4096 small)")
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds; fewer repeats when exceeded")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*(on-policy|rollout_func|experimental).*")
    # The replayed rows hold calls that no tool runs here: the package's warning about that says nothing new.
    warnings.filterwarnings("ignore", message=".*tool_shaping=True, but the trainer has no.*")

    small = args.small or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    args.repeats = args.repeats or (2 if small else 10)
    args.steps = args.steps or (3 if small else 4)
    args.batch = args.batch or (4 if small else 8)
    if args.steps < 2 or args.repeats < 1 or args.batch < 2 or args.batch % 2:
        parser.error("--steps must be >= 2 (the first is warm-up), --repeats >= 1, --batch even and >= 2")
    if small:
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

    result = {
        "mode": "small-cpu" if small else "gpu",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "case": args.case,
    }
    if args.case in ("all", "qwen"):
        reserve = SMOLLM2_RESERVE_S if args.case == "all" and not small else 0.0
        result.update(qwen_case(args, small, device, started, args.time_budget - reserve))
        write_result(result, args.out, started)  # kept should the SmolLM2 case run past the command's limit
    if args.case in ("all", "smollm2"):
        release_memory(device)
        result["smollm2"] = smollm2_case(args, small, device)
    write_result(result, args.out, started)
    print_table(result)
    print(f"wrote {args.out}")
    return result


def print_table(result: dict) -> None:
    """The result as Markdown tables and a line per failed check."""
    if "trainers" in result:
        print_qwen_table(result)
    if "smollm2" in result:
        print_smollm2_table(result["smollm2"], result["mode"], result["device"])
    checks = all_checks(result)
    failed = [check for check in checks if not check["ok"]]
    print(f"device/dtype checks: {len(checks) - len(failed)}/{len(checks)} ok")
    for check in failed:
        if "error" in check:
            detail = check["error"]
        elif "expected" in check:
            detail = f"{check['value']}, expected {check['expected']}"
        else:
            detail = f"{check['dtype']} on {check['device']}, expected {check['expected_dtype']}"
        print(f"  FAIL {check['name']}: {detail}")


def gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_qwen_table(result: dict) -> None:
    print(
        f"\n{result['mode']} on {result['device']}, {result['dtype']}, {result['model']['parameters'] / 1e6:.1f}M "
        f"parameters, vocab {result['model']['vocab']}, {result['completions_per_step']} x "
        f"{result['model']['completion_length']} tokens per step, {result['repeats']} repeats x "
        f"{result['timed_steps_per_call']} timed steps, interleaved"
    )
    print("| trainer | median step (ms) | vs grpo | peak (GiB) | peak over start (GiB) | host syncs / step |")
    print("|---|---:|---:|---:|---:|---:|")
    grpo = result["trainers"]["grpo"]["median_step_s"]
    for name, row in result["trainers"].items():
        syncs = "n/a" if row["syncs_per_step"] is None else f"{row['syncs_per_step']:g}"
        cells = [f"{1e3 * row['median_step_s']:.1f}", f"{row['median_step_s'] / grpo:.3f}x"]
        cells += [gib(row["peak_memory_bytes"]), gib(row["peak_memory_over_start_bytes"]), syncs]
        print(f"| {name} | " + " | ".join(cells) + " |")
    verdict = "meets" if result["meets_goal"] else "misses"
    print(f"ratio aspo/grpo {result['ratio_aspo_over_grpo']:.3f} ({verdict} the {result['goal_ratio']}x goal)")
    sites = result["trainers"]["aspo"]["package_sync_sites"]
    if sites:
        print("package lines that synchronize (aspo call): " + ", ".join(f"{k} x{v}" for k, v in sites.items()))


def print_smollm2_table(case: dict, mode: str, device: str) -> None:
    model = case["model"]
    print(
        f"\nSmolLM2 case, {mode} on {device}: LlamaForCausalLM {model['parameters'] / 1e6:.1f}M parameters, "
        f"{model['layers']} layers, random weights, real tokenizer (vocab {model['vocab']}), "
        f"{case['completions_per_step']} x {case['completion_length']} tokens per step, "
        f"{case['timed_steps']} timed steps"
    )
    print("| dtype | trainer | median step (ms) | peak (GiB) | peak over start (GiB) | loss | tool-call share |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for run in case["runs"]:
        if "error" in run:
            print(f"| {run['dtype']} | {run['trainer']} | failed: {run['error'][:80]} | | | | |")
            continue
        logged = run["last_log"]
        cells = [f"{1e3 * run['median_step_s']:.1f}", gib(run["peak_memory_bytes"])]
        cells += [gib(run["peak_memory_over_start_bytes"]), number(logged["loss"], ".4g")]
        cells.append(number(logged["tools/tool_call_frac"], "g"))
        print(f"| {run['dtype']} | {run['trainer']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if outcome["all_checks_ok"] else 1)
