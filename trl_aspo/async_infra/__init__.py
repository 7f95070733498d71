"""CPU, no-network infrastructure for TRL's `AsyncGRPOTrainer` (trl.experimental.async_grpo).

- `LocalRolloutWorker` + `LocalWeightTransfer`: TRL's rollout loop in-process, sampling on a CPU policy copy that the
  trainer's weight syncs update, with optional seeded latency jitter (out-of-order, stale samples);
  `LocalWorkerResumeMixin` resumes it at the first untrained prompt.
- `varlen_attention` / `install_tree_attention_fallback`: the packed tree attention without the FA3 kernel.
- `StandInVLLMServer` + `HTTPWeightTransfer`: a minimal local stand-in of the vLLM endpoints TRL's own worker process
  and clients call, serving a model with transformers on CPU.
- `install_cpu_fallbacks()`: routes the trainer to the above only where TRL's originals are unavailable.
"""

from .fallbacks import install_cpu_fallbacks
from .generation import load_named_tensors, sample_completion
from .http_transport import HTTPWeightTransfer, UrllibRolloutLoop, UrllibRolloutWorker, UrllibVLLMClient
from .local_worker import LocalRolloutWorker, LocalWeightTransfer, LocalWorkerResumeMixin
from .model_paths import resolve_model_path
from .standin_server import StandInVLLMServer
from .tree_attention import install_tree_attention_fallback, varlen_attention

__all__ = [
    "HTTPWeightTransfer",
    "LocalRolloutWorker",
    "LocalWeightTransfer",
    "LocalWorkerResumeMixin",
    "StandInVLLMServer",
    "UrllibRolloutLoop",
    "UrllibRolloutWorker",
    "UrllibVLLMClient",
    "install_cpu_fallbacks",
    "install_tree_attention_fallback",
    "load_named_tensors",
    "resolve_model_path",
    "sample_completion",
    "varlen_attention",
]
