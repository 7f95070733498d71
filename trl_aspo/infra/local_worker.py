"""An in-process rollout worker and weight transfer for `AsyncGRPOTrainer`: no vLLM, no NCCL, no network.

`LocalRolloutWorker` implements TRL's `RolloutWorkerProtocol` by running TRL's own rollout loop
(`_AsyncRolloutLoop`: dataset cycling, groups of `num_generations`, the multi-turn tool loop, sample building,
reward scoring and the per-group advantage, `RolloutSample`) on a thread, with one thing replaced: a turn is sampled
by `sample_completion` on a CPU copy of the policy instead of being posted to vLLM's `/v1/completions`. So it scores
exactly like TRL's worker. An optional seeded latency jitter delays every turn by `U(0, jitter_s)` seconds, so groups
finish out of order and samples reach the trainer several versions old, stamped with the `model_version` their
group was started at, as TRL stamps them.

`LocalWeightTransfer` implements `WeightTransferProtocol` by copying the trainer's weights into that policy copy
under the copy's lock, so no turn is sampled from half-updated weights.

`LocalWorkerResumeMixin` (before `AsyncGRPOTrainer` in a trainer's bases; `AsyncASPOTrainer` has it) saves and
restores the local worker's prompt position and model version with each checkpoint, as `AsyncGRPOTrainer` does for
its own worker only; for either worker it counts a group as trained when its micro-batch is trained (not when the
data loader fetches it, one micro-batch ahead) and resumes at the checkpoint's model version.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import datasets
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.async_grpo import AsyncGRPOConfig
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop
from trl.trainer.utils import create_model_from_path

from trl_aspo.infra.generation import load_named_tensors, sample_completion
from trl_aspo.infra.json_files import read_json, require_int, require_object, write_json_atomic
from trl_aspo.infra.model_paths import resolve_model_path

logger = logging.getLogger(__name__)


ROLLOUT_STATE_FILE = "rollout_state.json"
# rollout_state.json holds two integers; anything near this size is not one.
ROLLOUT_STATE_MAX_BYTES = 4096


def checkpoint_global_step(checkpoint: str) -> int | None:
    """`global_step` of the checkpoint's `trainer_state.json` (checked: an integer >= 0), None without the file."""
    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.exists(path):
        return None
    state = require_object(read_json(path), path)
    return require_int(state.get("global_step"), path, "global_step", low=0)


class RolloutStateBounds(NamedTuple):
    """The largest `prompt_index` and `model_version` a `rollout_state.json` can hold (None: no bound), and why."""

    max_prompt_index: int | None
    max_model_version: int | None
    prompt_reason: str = ""
    version_reason: str = ""


def rollout_state_bounds(
    global_step: int | None, samples_per_step: int, drops_groups: bool, republishes: bool
) -> RolloutStateBounds:
    """What a `rollout_state.json` saved at `global_step` can hold (where the step is unknown, nothing is bounded).

    - `prompt_index` counts the prompt groups before the first untrained one, over all epochs (the worker starts at
      `prompt_index % rows`, so it may exceed the rows). A group counts once one of its completions is trained, and
      a step trains at most `samples_per_step` completions, so it is at most `global_step * samples_per_step`, unless
      groups are consumed untrained (`drops_groups`: `filter_zero_variance_groups` drops whole groups, any number a
      step), which leaves it unbounded.
    - `model_version` counts weight syncs: at most one a step, plus the cold sync at each (re)start; a resume that
      republishes the checkpoint's version (`republishes`: always for the local worker) mints none, and a checkpoint
      after a restart follows at least one more step, so it is at most `1 + global_step` (`1 + 2 * global_step`)."""
    if global_step is None:
        return RolloutStateBounds(None, None)
    prompt_reason = (
        f" (global_step {global_step} x at most {samples_per_step} trained completions a step with this run's batch "
        "settings, each completion of one group: resume with the checkpoint's batch settings if they differ)"
    )
    restarts = "" if republishes else ", plus one cold sync per restart"
    version_reason = f" (one cold sync, then at most one weight sync per optimizer step{restarts})"
    return RolloutStateBounds(
        None if drops_groups else global_step * samples_per_step,
        1 + global_step * (1 if republishes else 2),
        "" if drops_groups else prompt_reason,
        version_reason,
    )


def read_rollout_state(path: str, bounds: RolloutStateBounds) -> dict[str, int]:
    """`{"prompt_index": int, "model_version": int}` (the version optional: older files lack it) of a checkpoint's
    `rollout_state.json`, each in `[0, bounds.max_*]` (`rollout_state_bounds`); `ValueError` naming the file, the
    field, the value and the allowed range otherwise. Other fields are left to whoever wrote them (TRL reads the
    same file for its own worker)."""
    state = require_object(read_json(path, max_bytes=ROLLOUT_STATE_MAX_BYTES), path)
    if "prompt_index" not in state:
        raise ValueError(f"{path}: prompt_index is missing (the first untrained prompt group, an integer >= 0).")
    checked = {
        "prompt_index": require_int(
            state["prompt_index"], path, "prompt_index", 0, bounds.max_prompt_index, bounds.prompt_reason
        )
    }
    if "model_version" in state:
        checked["model_version"] = require_int(
            state["model_version"], path, "model_version", 0, bounds.max_model_version, bounds.version_reason
        )
    return checked


class SharedValue:
    """The `.value` holder TRL's loop reads its model version and heartbeat from (an `mp.Value` across processes)."""

    def __init__(self, value: float):
        self.value = value


class _LocalRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop with its vLLM HTTP call replaced by local sampling (and no HTTP session to open)."""

    def __init__(
        self,
        *,
        policy: PreTrainedModel,
        policy_lock: threading.Lock,
        jitter_s: float,
        seed: int,
        **loop_kwargs: Any,
    ):
        super().__init__(**loop_kwargs)
        self._policy = policy
        self._policy_lock = policy_lock
        self._jitter_s = jitter_s
        self._rng = random.Random(seed)
        # One sampler thread: the policy copy is one model, and the event loop must stay free to score and push.
        self._sampler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-rollout-sampler")

    async def _run_loops(self, stop_event: asyncio.Event) -> None:
        try:
            await asyncio.gather(self._generate_loop(stop_event=stop_event), self._score_loop(stop_event=stop_event))
        finally:
            self._sampler.shutdown(wait=True, cancel_futures=True)

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        # Draw on the event-loop thread so the random stream is consumed in dispatch order.
        delay = self._rng.uniform(0.0, self._jitter_s) if self._jitter_s > 0 else 0.0
        generator = torch.Generator().manual_seed(self._rng.getrandbits(63))
        if delay:
            await asyncio.sleep(delay)
        return await asyncio.get_running_loop().run_in_executor(self._sampler, self._sample, prompt_ids, generator)

    def _sample(self, prompt_ids: list[int], generator: torch.Generator) -> tuple[list[int], list[float]]:
        with self._policy_lock:
            return sample_completion(
                self._policy,
                prompt_ids,
                max_tokens=self.max_tokens,
                eos_token_ids=self.eos_token_ids,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                generator=generator,
            )


def trainer_eos_token_ids(model: PreTrainedModel, processing_class: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a completion, derived exactly as `AsyncGRPOTrainer.__init__` derives them."""
    eos_token_ids = model.generation_config.eos_token_id
    if eos_token_ids is None:
        eos_token_ids = []
    elif isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    if processing_class.eos_token_id not in eos_token_ids:
        eos_token_ids = [processing_class.eos_token_id, *eos_token_ids]
    return list(eos_token_ids)


class LocalRolloutWorker:
    """`RolloutWorkerProtocol` for `AsyncGRPOTrainer`: TRL's rollout loop on a thread, sampling on a CPU policy copy.

    Like TRL's `AsyncRolloutWorker`, it builds its loop (`_loop_cls`) from `_loop_kwargs` when it starts, and the
    loop begins at `_loop_kwargs["dataset_start_index"]`: `LocalWorkerResumeMixin` sets it on resume from the
    checkpoint's `rollout_state.json`, as `AsyncGRPOTrainer` does for its own worker (and for no other).

    Args:
        model: the path `AsyncGRPOTrainer` loads its policy from (or `builtin:tiny-calculator`); the copy is loaded
            from it the same way (with `args.dtype` and standard attention).
        processing_class: the tokenizer passed to the trainer.
        train_dataset: the prompts (a `prompt` column, plus the reward functions' columns); cycled like TRL does.
        reward_funcs: the trainer's reward functions.
        args: the trainer's `AsyncGRPOConfig`; generation length, sampling, `num_generations`, tool-loop and in-flight
            settings are read from it. `max_inflight_tasks=-1` resolves as the trainer resolves it.
        tools: tool functions for TRL's multi-turn tool loop.
        environment_factory: as for `AsyncGRPOTrainer`.
        jitter_s: each turn waits `U(0, jitter_s)` seconds before sampling (0: none), so groups finish out of order.
        seed: seed of the jitter and of each turn's sampling stream.
    """

    _loop_cls: type[_LocalRolloutLoop] = _LocalRolloutLoop

    def __init__(
        self,
        model: str,
        processing_class: PreTrainedTokenizerBase,
        train_dataset,
        reward_funcs: Callable | list[Callable],
        args: AsyncGRPOConfig,
        tools: list[Callable] | None = None,
        environment_factory=None,
        jitter_s: float = 0.0,
        seed: int = 0,
    ):
        if jitter_s < 0:
            raise ValueError(f"jitter_s={jitter_s}: the latency jitter is a duration in seconds, so it must be >= 0.")
        model_init_kwargs = dict(args.model_init_kwargs or {})
        model_init_kwargs.setdefault("dtype", args.dtype)
        model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        model_init_kwargs.pop("attn_implementation", None)
        model = resolve_model_path(model)
        self.policy = create_model_from_path(model, device_map=None, attn_implementation="sdpa", **model_init_kwargs)
        self.policy.requires_grad_(False)
        if (args.bf16 or args.fp16) and self.policy.dtype == torch.float32:
            # Measured on the built-in model: fresh samples had ratio 0.9992, KL 1e-5 under bf16; 1.0, 2e-9 without.
            logger.warning(
                f"bf16={args.bf16}, fp16={args.fp16}: the trainer computes log-probs under mixed-precision autocast "
                "while the policy copy samples in float32, so importance ratios of fresh samples differ from 1. Set "
                "bf16=False and fp16=False in AsyncGRPOConfig (the usual choice on CPU) for matching log-probs."
            )
        self.policy_lock = threading.Lock()
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        max_inflight_tasks = args.max_inflight_tasks
        if max_inflight_tasks < 0:
            max_inflight_tasks = max(args.max_staleness, 1) * samples_per_step
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=args.queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        self._model_version = SharedValue(0)
        self._heartbeat = SharedValue(time.time())
        self._failed = threading.Event()
        self._exception_info: queue.Queue = queue.Queue(maxsize=1)
        # The loop is built at `start` from these, so a prompt stream can be attached first
        # (trl_aspo.infra.prompt_stream).
        self._loop_kwargs = dict(
            policy=self.policy,
            policy_lock=self.policy_lock,
            jitter_s=jitter_s,
            seed=seed,
            model_name=model,
            dataset=train_dataset,
            reward_funcs=reward_funcs if isinstance(reward_funcs, list) else [reward_funcs],
            processing_class=processing_class,
            eos_token_ids=trainer_eos_token_ids(self.policy, processing_class),
            rollout_buffer=self.rollout_buffer,
            model_version_value=self._model_version,
            heartbeat_value=self._heartbeat,
            failed_event=self._failed,
            exception_info_queue=self._exception_info,
            metrics_queue=self.metrics_queue,
            tools=tools,
            environment_factory=environment_factory,
            num_generations=args.num_generations,
            max_inflight_tasks=max_inflight_tasks,
            queue_maxsize=args.queue_maxsize,
            max_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            chat_template_kwargs=args.chat_template_kwargs,
            max_tool_calling_iterations=args.max_tool_calling_iterations,
            log_completions=args.log_completions,
            num_completions_to_print=args.num_completions_to_print,
            fork_threshold_tokens=args.fork_threshold_tokens,
            dataset_start_index=0,
        )
        self._loop: _LocalRolloutLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def model_version(self) -> int:
        return int(self._model_version.value)

    def update_model_version(self, model_version: int) -> None:
        self._model_version.value = int(model_version)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = self._loop_cls(**self._loop_kwargs)
        self._heartbeat.value = time.time()
        self._thread = threading.Thread(target=self._run, name="local-rollout-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # TRL's loop reports its own failure through `_failed`/`_exception_info`, which `check_health` raises.
        with contextlib.suppress(BaseException):
            self._loop.run()

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the loop failed (with its traceback), stopped, or has not ticked within `stale_after_s` seconds."""
        if self._failed.is_set():
            try:
                type_name, message, trace = self._exception_info.get_nowait()
                cause = RuntimeError(f"{type_name}: {message}\n{trace}")
            except queue.Empty:
                cause = None
            raise RuntimeError("The local rollout worker failed; see the chained exception.") from cause
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("The local rollout worker's thread has stopped.")
        age = time.time() - self._heartbeat.value
        if age > stale_after_s:
            raise RuntimeError(f"Local rollout worker heartbeat stale: {age:.0f}s > {stale_after_s:.0f}s.")

    def stop(self) -> None:
        if self._thread is None:
            return
        loop = self._loop
        # The loop may already be closed if it failed; then there is nothing to signal.
        if not loop._loop.is_closed():
            loop._loop.call_soon_threadsafe(loop._stop_event.set)
        self._thread.join(timeout=60)
        self._thread = None


class LocalWeightTransfer:
    """`WeightTransferProtocol` that copies the trainer's weights into a `LocalRolloutWorker`'s policy copy.

    The copy happens under the copy's lock, which every sampled turn also holds: a turn is sampled wholly from the
    old or wholly from the new weights, so `pause`/`resume` have nothing left to do (and a failed copy cannot leave
    sampling paused).
    """

    def __init__(self, worker: LocalRolloutWorker):
        self.worker = worker
        self.syncs = 0

    def init_weight_transfer(self) -> None:
        """Nothing to set up: trainer and policy copy share the process."""

    def pause(self) -> None:
        """Nothing to pause: `send_weights` is atomic with respect to sampling."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        with self.worker.policy_lock:
            load_named_tensors(self.worker.policy, iterator)
        self.syncs += 1

    def resume(self) -> None:
        """Nothing to resume (see `pause`)."""

    def destroy(self) -> None:
        """Nothing to release."""


class _CollatedGroups:
    """Stands in for the trained-group set TRL's collator updates: keeps each micro-batch's groups, in order, until
    that micro-batch is trained."""

    def __init__(self):
        self.pending: collections.deque[set[int]] = collections.deque()

    def update(self, groups) -> None:
        self.pending.append(set(groups))


class LocalWorkerResumeMixin:
    """For a subclass of `AsyncGRPOTrainer` (listed before it): checkpoints record the `LocalRolloutWorker`'s first
    untrained prompt and the model version (`rollout_state.json`), and a resumed run restarts the worker there.

    `AsyncGRPOTrainer` does exactly this in `_save_checkpoint` / `_inner_training_loop`, but only for an instance of
    its own worker class, so these two methods add the same for the local worker. With another worker they only call
    TRL's. For every worker, two things make a resumed run continue as the uninterrupted one:

    - TRL's collator marks a micro-batch's groups trained when the data loader fetches it, which is one micro-batch
      ahead of training, so a checkpoint's first untrained prompt would skip the fetched, untrained step. Here the
      groups join `_trained_groups` when their micro-batch is trained (`training_step`).
    - The cold weight sync at train begin counts a version; on resume it republishes the checkpoint's weights, so
      it restores the checkpoint's version instead of minting a new one (not with TRL's adapter-only sync, whose
      adapter names must not be reused on a running server)."""

    def get_train_dataloader(self):
        trained, self._trained_groups = self._trained_groups, _CollatedGroups()
        try:
            dataloader = super().get_train_dataloader()
        finally:
            self._collated_groups, self._trained_groups = self._trained_groups, trained
        return dataloader

    def training_step(self, model, inputs, num_items_in_batch=None):
        output = super().training_step(model, inputs, num_items_in_batch)
        collated = getattr(self, "_collated_groups", None)
        if collated is not None and collated.pending:
            self._trained_groups.update(collated.pending.popleft())
        return output

    def _sync_weight(self):
        if getattr(self, "_republish_checkpoint_version", False):
            self._republish_checkpoint_version = False
            if self.accelerator.is_main_process:
                self.model_version -= 1
        super()._sync_weight()

    def _save_checkpoint(self, model, trial):
        if self.accelerator.is_main_process and isinstance(self.rollout_worker, LocalRolloutWorker):
            checkpoint_dir = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            os.makedirs(checkpoint_dir, exist_ok=True)
            first_untrained = next(group for group in itertools.count() if group not in self._trained_groups)
            prompt_index = self.rollout_worker._loop_kwargs["dataset_start_index"] + first_untrained
            state = {"prompt_index": prompt_index, "model_version": self.model_version}
            write_json_atomic(os.path.join(checkpoint_dir, ROLLOUT_STATE_FILE), state)
        super()._save_checkpoint(model, trial)

    def _inner_training_loop(self, *args, **kwargs):
        # Before TRL's train-begin callback starts the worker, which builds its loop from `_loop_kwargs`.
        checkpoint = kwargs.get("resume_from_checkpoint")
        if isinstance(self.rollout_worker, LocalRolloutWorker):
            self._restore_local_prompt_position(checkpoint)
        self._republish_checkpoint_version = self._resumes_a_model_version(checkpoint)
        return super()._inner_training_loop(*args, **kwargs)

    def _resumes_a_model_version(self, checkpoint: str | None) -> bool:
        """Whether this run resumes the worker at the checkpoint's model version (>= 1), which the cold sync then
        republishes: the rules by which TRL and `_restore_local_prompt_position` read `rollout_state.json`."""
        from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

        if checkpoint is None or getattr(self, "_lora_sync", False):
            return False
        if not isinstance(self.rollout_worker, AsyncRolloutWorker | LocalRolloutWorker):
            return False
        state = self._read_rollout_state(checkpoint)
        return state is not None and state.get("model_version", 0) > 0

    def _read_rollout_state(self, checkpoint: str) -> dict | None:
        """The checkpoint's `rollout_state.json`, checked (`read_rollout_state`) against the bounds of this run and
        of the checkpoint's `global_step`; None when there is none or the dataset is not map-style (TRL's rules).
        TRL's own worker reads the file again after this check, so a bad file is refused before either reads it."""
        state_file = os.path.join(checkpoint, ROLLOUT_STATE_FILE)
        # `lexists`, not TRL's `isfile`: a link to a device or a folder in its place is refused, not skipped.
        if not os.path.lexists(state_file) or not isinstance(self.train_dataset, datasets.Dataset):
            return None
        args = self.args
        per_row = (
            args.token_budget if (getattr(args, "token_budget", None) or 0) > 0 else args.per_device_train_batch_size
        )
        local = isinstance(self.rollout_worker, LocalRolloutWorker)
        bounds = rollout_state_bounds(
            checkpoint_global_step(checkpoint),
            samples_per_step=per_row * args.gradient_accumulation_steps * self.accelerator.num_processes,
            drops_groups=bool(getattr(args, "filter_zero_variance_groups", False)),
            republishes=local,
        )
        return read_rollout_state(state_file, bounds)

    def _restore_local_prompt_position(self, checkpoint: str | None) -> None:
        self.rollout_worker._loop_kwargs["dataset_start_index"] = 0
        self._groups_before_resume = 0
        if checkpoint is None:
            return
        state = self._read_rollout_state(checkpoint)
        if state is None:
            logger.warning(
                f"{checkpoint} records no prompt position (rollout_state.json) or the dataset is not a map-style "
                "datasets.Dataset: the local rollout worker restarts from prompt 0."
            )
            return
        self.rollout_worker._loop_kwargs["dataset_start_index"] = state["prompt_index"]
        self._groups_before_resume = state["prompt_index"]
        self.model_version = state.get("model_version", 0)
        self.rollout_worker.update_model_version(self.model_version)
