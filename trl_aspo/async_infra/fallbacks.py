"""`install_cpu_fallbacks()`: what lets TRL's plain `AsyncGRPOTrainer` run on a CPU machine without network.

Each replacement takes effect only where TRL's original cannot work:

- the FA3 tree-attention kernel (CUDA + the Hub): TRL's kernel lookup falls back to `varlen_attention`;
- `requests` not installed: the trainer's `VLLMClient` becomes `UrllibVLLMClient` (same endpoints, same answers);
- a device that is not CUDA: TRL's peak-FLOPs lookup (`torch.cuda.get_device_name`, which fails on a CPU build)
  answers "unknown", its documented answer for unlisted devices, which turns the MFU metrics off;
- `vllm`/`aiohttp` not installed: the trainer's default `AsyncRolloutWorker` becomes `UrllibRolloutWorker` (TRL's
  spawned worker process and loop, HTTP on `urllib`), which a stand-in server can serve.

Weight sync is not replaced: pass `weight_transfer=` (`LocalWeightTransfer` or `HTTPWeightTransfer`), the trainer's
public plug-in point.
"""

from __future__ import annotations

from trl.import_utils import is_aiohttp_available, is_requests_available, is_vllm_available

from .http_transport import UrllibRolloutWorker, UrllibVLLMClient
from .tree_attention import install_tree_attention_fallback


def install_cpu_fallbacks() -> None:
    """Install the fallbacks above (idempotent). Call once before constructing `AsyncGRPOTrainer`."""
    from trl.experimental.async_grpo import async_grpo_trainer

    install_tree_attention_fallback()
    peak_flops = async_grpo_trainer.get_peak_flops_per_device
    if not getattr(peak_flops, "knows_non_cuda_devices", False):

        def peak_flops_per_device(accelerator, dtype: str) -> float | None:
            return peak_flops(accelerator, dtype) if accelerator.device.type == "cuda" else None

        peak_flops_per_device.knows_non_cuda_devices = True
        async_grpo_trainer.get_peak_flops_per_device = peak_flops_per_device
    if not is_requests_available():
        async_grpo_trainer.VLLMClient = UrllibVLLMClient
    if not (is_vllm_available() and is_aiohttp_available()):
        async_grpo_trainer.AsyncRolloutWorker = UrllibRolloutWorker
