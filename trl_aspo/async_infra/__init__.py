"""CPU, no-network infrastructure for TRL's `AsyncGRPOTrainer` (trl.experimental.async_grpo).

- `LocalRolloutWorker` + `LocalWeightTransfer`: TRL's rollout loop in-process, sampling on a CPU policy copy that the
  trainer's weight syncs update, with optional seeded latency jitter (out-of-order, stale samples);
  `LocalWorkerResumeMixin` resumes it at the first untrained prompt.
- `varlen_attention` / `install_tree_attention_fallback`: the packed tree attention without the FA3 kernel.
- `install_cpu_fallbacks()`: the attention kernel and FLOPs lookup only where TRL's originals cannot run.

TRL's own rollout worker against a real vLLM server (vLLM's CPU build on a laptop) needs nothing from here but the
fallbacks: `AsyncASPOTrainer` syncs weights into it with `trl_aspo.vllm_cpu.CPUWeightTransfer` on a CPU.
"""

from .fallbacks import install_cpu_fallbacks
from .generation import load_named_tensors, sample_completion
from .local_worker import LocalRolloutWorker, LocalWeightTransfer, LocalWorkerResumeMixin
from .model_paths import resolve_model_path
from .tree_attention import install_tree_attention_fallback, varlen_attention

__all__ = [
    "LocalRolloutWorker",
    "LocalWeightTransfer",
    "LocalWorkerResumeMixin",
    "install_cpu_fallbacks",
    "install_tree_attention_fallback",
    "load_named_tensors",
    "resolve_model_path",
    "sample_completion",
    "varlen_attention",
]
