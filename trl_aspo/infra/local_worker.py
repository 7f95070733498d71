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

A trainer resumes the worker at its first untrained prompt with `LocalWorkerResumeMixin`
(trl_aspo.trainers.local_worker_resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl.experimental.async_grpo import AsyncGRPOConfig
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop
from trl.trainer.utils import create_model_from_path

from trl_aspo.algorithms.context_length import check_turn_fits, model_context_length
from trl_aspo.infra.generation import load_named_tensors, sample_completion
from trl_aspo.infra.model_paths import resolve_model_path

logger = logging.getLogger(__name__)


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
        processed_logprobs: bool,
        **loop_kwargs: Any,
    ):
        super().__init__(**loop_kwargs)
        self._policy = policy
        self._policy_lock = policy_lock
        self._processed_logprobs = processed_logprobs
        self._jitter_s = jitter_s
        self._rng = random.Random(seed)
        # One sampler thread: the policy copy is one model, and the event loop must stay free to score and push.
        self._sampler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-rollout-sampler")
        self._context = model_context_length(policy.config)

    async def _run_loops(self, stop_event: asyncio.Event) -> None:
        try:
            await asyncio.gather(self._generate_loop(stop_event=stop_event), self._score_loop(stop_event=stop_event))
        finally:
            self._sampler.shutdown(wait=True, cancel_futures=True)

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        # Each turn samples up to max_tokens after the whole conversation so far: it must fit the policy's positions.
        check_turn_fits(prompt_ids, self.max_tokens, self._context, self.tokenizer)
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
                processed_logprobs=self._processed_logprobs,
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
    loop begins at `_loop_kwargs["dataset_start_index"]`: a trainer with `LocalWorkerResumeMixin` sets it on resume
    from the checkpoint's `rollout_state.json`, as `AsyncGRPOTrainer` does for its own worker (and for no other).

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
        processed_logprobs: report each token's log-prob under the distribution sampled from (after top-p / top-k,
            renormalized), as vLLM does behind TRL's `vllm-serve`; False (default): under the temperature-scaled full
            softmax, the trainer's, so a ratio at zero drift is 1 whatever the sampling settings.
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
        processed_logprobs: bool = False,
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
        # Read by AsyncASPOTrainer (trl_aspo.config.async_config.check_sampling_logprobs).
        self.reports_processed_logprobs = processed_logprobs
        # What a vLLM server on this policy reports as max_model_len (read by AsyncASPOTrainer for token_budget=None).
        self.max_model_len = self.policy.config.max_position_embeddings
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        max_inflight_tasks = args.max_inflight_tasks
        if max_inflight_tasks < 0:
            max_inflight_tasks = (
                max(args.max_staleness, 1) * samples_per_step * getattr(args, "steps_per_rollout_batch", 1)
            )
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
            processed_logprobs=processed_logprobs,
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
