"""CPU, no-network infrastructure for TRL's `AsyncGRPOTrainer` (trl.experimental.async_grpo).

- `LocalRolloutWorker` + `LocalWeightTransfer`: TRL's rollout loop in-process, sampling on a CPU policy copy that the
  trainer's weight syncs update, with optional seeded latency jitter (out-of-order, stale samples); a trainer resumes
  it with `trl_aspo.trainers.local_worker_resume.LocalWorkerResumeMixin`.
- `trl_aspo.infra.rollout_state`: the resume file `rollout_state.json`, read and checked.
- `trl_aspo.infra.dispatch_control`: SPO++'s runtime in the worker's loop (one request in flight per prompt, the
  old weights' work drained at publish).
- `varlen_attention` / `install_tree_attention_fallback`: the packed tree attention without the FA3 kernel.
- `install_cpu_fallbacks()`: the attention kernel and FLOPs lookup only where TRL's originals cannot run.
- `ReplayRolloutWorker` + `NoOpWeightTransfer`: no generation at all, pre-made samples handed out and weights
  published nowhere, to time or test the trainer alone (benchmarks, the GPU check, tests).

TRL's own rollout worker against a real vLLM server (vLLM's CPU build on a laptop) needs nothing from here but the
fallbacks: `AsyncASPOTrainer` syncs weights into it with `trl_aspo.infra.vllm_cpu.CPUWeightTransfer` on a CPU.
"""

import importlib

# Imported on first use: `trl_aspo.infra.notices` (log filters) is read by the CLI before torch loads.
_LAZY = {
    "LocalRolloutWorker": "trl_aspo.infra.local_worker",
    "LocalWeightTransfer": "trl_aspo.infra.local_worker",
    "NoOpWeightTransfer": "trl_aspo.infra.replay",
    "ReplayRolloutWorker": "trl_aspo.infra.replay",
    "install_cpu_fallbacks": "trl_aspo.infra.fallbacks",
    "install_tree_attention_fallback": "trl_aspo.infra.tree_attention",
    "load_named_tensors": "trl_aspo.infra.generation",
    "resolve_model_path": "trl_aspo.infra.model_paths",
    "sample_completion": "trl_aspo.infra.generation",
    "varlen_attention": "trl_aspo.infra.tree_attention",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
