"""`install_cpu_fallbacks()`: what lets TRL's `AsyncGRPOTrainer` run on a CPU machine without network.

Each replacement takes effect only where TRL's original cannot work:

- the FA3 tree-attention kernel (CUDA + the Hub): TRL's kernel lookup falls back to `varlen_attention`;
- a device that is not CUDA: TRL's peak-FLOPs lookup (`torch.cuda.get_device_name`, which fails on a CPU build)
  answers "unknown", its documented answer for unlisted devices, which turns the MFU metrics off.

`AsyncASPOTrainer` installs them by itself on a CPU. Weight sync is not replaced here: it is the trainer's
`weight_transfer=` plug-in point (`trl_aspo.infra.vllm_cpu.CPUWeightTransfer` for a vLLM server on CPU, which
`AsyncASPOTrainer` picks on a CPU; `LocalWeightTransfer` for the local worker).
"""

from __future__ import annotations

from trl_aspo.infra.tree_attention import install_tree_attention_fallback


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
