"""GPU check: step time and peak memory of `ASPOTrainer` against `GRPOTrainer`, and a device/dtype audit.

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

`--small` (automatic without CUDA) runs the same on CPU in float32 with hidden 64, 2 layers, a 4,096-entry
vocabulary and 64-token completions, so the script is tested without a GPU (tests/integration/test_gpu_check.py); a
CPU ratio says little about the GPU one.

Running it on the GPU machine (Python 3.12, no network; torch, transformers, accelerate, peft, pyarrow, pandas are
preinstalled; trl, datasets, dill, multiprocess and this package are not): build the wheels here with
`scripts/build_gpu_wheels.sh` (or `make gpu-wheels`; into `build/gpu_wheels`, ignored by git), then call the device
tool with `carry=["build/gpu_wheels"]`, `timeout_s=600` and this command (one line):

    set -o pipefail; W=build/gpu_wheels; python3 -m pip install -q --no-index --find-links $W $W/trl_aspo-*.whl
    > $OUT/pip.log 2>&1 || { echo "resolver install failed (pip.log); installing without dependency checks";
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $W/trl-*.whl $W/datasets-*.whl
    $W/dill-*.whl $W/multiprocess-*.whl >> $OUT/pip.log 2>&1 && export PYTHONPATH=/tmp/site; };
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
    python3 scripts/gpu_check.py --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

pip keeps every preinstalled package that satisfies the pins and takes the rest from the wheels; `PYTHONPATH=$PWD`
makes the working tree's `trl_aspo` the one measured (the wheel only brings its dependency list). The script keeps
itself to `--time-budget` seconds (420 by default) by running fewer repeats when steps are slow; the result records
the versions it ran with. Exit status 1 means a device/dtype check failed.

Usage: python scripts/gpu_check.py [--out gpu_check.json] [--small] [--repeats 10] [--steps 4] [--batch 8]
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, TrainerCallback, set_seed
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import GRPOConfig, GRPOTrainer

import trl_aspo
from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.algorithms.losses import (
    aggregate_loss,
    asymmetric_policy_loss,
    entropy_split_mask,
    repetition_rate,
    unflipped_sample_mask,
)
from trl_aspo.algorithms.tool_metrics import first_tool_call_positions
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


def describe(tensor: torch.Tensor) -> dict[str, str]:
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "device": tensor.device.type}


ROWS = {
    "grpo": (GRPOTrainer, GRPOConfig, {"num_generations": 2}),
    "aspo": (
        ASPOTrainer,
        ASPOConfig,
        {"num_generations": 1, "loss_type": "aspo", "tool_shaping": True, "advantage_estimator": "spo++"},
    ),
}


def build_trainer(name, model, tokenizer, rollout, args, shape, device, dtype, output_dir):
    trainer_cls, config_cls, extra = ROWS[name]
    config = config_cls(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch,
        max_completion_length=shape.completion_length,
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
    return {"name": name, **describe(tensor), "expected_dtype": str(dtype).removeprefix("torch."), "ok": ok}


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="JSON result file")
    parser.add_argument("--small", action="store_true", help="small CPU model (automatic without CUDA)")
    parser.add_argument("--repeats", type=int, help="train() calls per trainer, interleaved (10 GPU, 2 small)")
    parser.add_argument("--steps", type=int, help="steps per train() call, the first not timed (4 GPU, 3 small)")
    parser.add_argument("--batch", type=int, default=None, help="completions per step (8 GPU, 4 small)")
    parser.add_argument("--completion-length", type=int, help="tokens per completion (1024 GPU, 64 small)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (151936 GPU, 4096 small)")
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds; fewer repeats when exceeded")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*(on-policy|rollout_func|experimental).*")

    small = args.small or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float32 if small else torch.bfloat16
    base = SMALL if small else QWEN25_05B
    shape = Shape(
        **{
            **base.__dict__,
            **({"vocab": args.vocab} if args.vocab else {}),
            **({"completion_length": args.completion_length} if args.completion_length else {}),
        }
    )
    args.repeats = args.repeats or (2 if small else 10)
    args.steps = args.steps or (3 if small else 4)
    args.batch = args.batch or (4 if small else 8)
    if args.steps < 2 or args.repeats < 1 or args.batch < 2 or args.batch % 2:
        parser.error("--steps must be >= 2 (the first is warm-up), --repeats >= 1, --batch even and >= 2")
    if small:
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

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
                name, copy, tokenizer, make_rollout(rows), args, shape, device, dtype, f"{scratch}/{name}"
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
            if elapsed / (repeats_done + 1) * (repeats_done + 2) > args.time_budget:
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
    result = {
        "mode": "small-cpu" if small else "gpu",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype).removeprefix("torch."),
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
                "last_log": {key: trainer.state.log_history[-2].get(key) for key in LOGGED},
            }
            for name, (trainer, recorder) in trainers.items()
        },
        "sync_count_error": sync_error,
        "ratio_aspo_over_grpo": ratio,
        "goal_ratio": GOAL_RATIO,
        "meets_goal": ratio <= GOAL_RATIO,
        "checks": checks,
        "all_checks_ok": all(check["ok"] for check in checks),
        "versions": {
            "python": platform.python_version(),
            **{name: importlib.metadata.version(name) for name in DISTRIBUTIONS},
            "trl_aspo_source": str(Path(trl_aspo.__file__).parent),
        },
        "elapsed_s": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    return result


def print_table(result: dict) -> None:
    gib = 2**30
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
        peak = "n/a" if row["peak_memory_bytes"] is None else f"{row['peak_memory_bytes'] / gib:.2f}"
        over = (
            "n/a"
            if row["peak_memory_over_start_bytes"] is None
            else f"{row['peak_memory_over_start_bytes'] / gib:.2f}"
        )
        syncs = "n/a" if row["syncs_per_step"] is None else f"{row['syncs_per_step']:g}"
        cells = [f"{1e3 * row['median_step_s']:.1f}", f"{row['median_step_s'] / grpo:.3f}x", peak, over, syncs]
        print(f"| {name} | " + " | ".join(cells) + " |")
    verdict = "meets" if result["meets_goal"] else "misses"
    print(f"ratio aspo/grpo {result['ratio_aspo_over_grpo']:.3f} ({verdict} the {result['goal_ratio']}x goal)")
    sites = result["trainers"]["aspo"]["package_sync_sites"]
    if sites:
        print("package lines that synchronize (aspo call): " + ", ".join(f"{k} x{v}" for k, v in sites.items()))
    failed = [check for check in result["checks"] if not check["ok"]]
    print(f"device/dtype checks: {len(result['checks']) - len(failed)}/{len(result['checks'])} ok")
    for check in failed:
        if "error" in check:
            print(f"  FAIL {check['name']}: {check['error']}")
        else:
            print(f"  FAIL {check['name']}: {check['dtype']} on {check['device']}, expected {check['expected_dtype']}")


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if outcome["all_checks_ok"] else 1)
