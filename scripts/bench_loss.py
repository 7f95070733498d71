"""Benchmark the fused ASPO loss against TRL's clipped surrogate (forward + backward, masked token mean).

The variants run on the same (B, T) inputs in one process:

- ``trl surrogate``: TRL's ``coef_1 = exp(lp - old)``, ``coef_2 = clamp(coef_1, 1-el, 1+eh)``,
  ``-min(coef_1*A, coef_2*A)``, the baseline every ratio is relative to;
- ``aspo fused``: :func:`trl_aspo.algorithms.losses.asymmetric_policy_loss` (one autograd Function);
- ``aspo plain ops``: the docs/design.md expressions written with ordinary autograd ops, to show what the fusion saves;
- ``trl surrogate + metrics`` / ``aspo fused + metrics``: each loss together with what its trainer computes for its
  logged metrics per micro-batch: GRPOTrainer's entropy mean and clip means (low, high, region; per-sequence min/max),
  each read back with ``.item()``; ASPOTrainer's entropy, clip and dual-clip fractions, flipped weight and policy
  loss, stacked and read back with one ``.tolist()`` (``ASPOTrainer._log_aspo_metrics``).

Memory is reported as the tensors autograd saves for backward (counted with ``saved_tensors_hooks``, shared
storages counted once) and, on CUDA, the peak allocated memory of one forward + backward above the inputs.

Usage: python scripts/bench_loss.py [--device cpu|cuda] [--repeats 20] [--B 32] [--T 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from trl.trainer.utils import nanmax, nanmin

from trl_aspo.algorithms.losses import aggregate_loss, asymmetric_policy_loss

EPS_LOW, EPS_HIGH, DUAL_CLIP = 0.2, 0.2, 3.0

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def trl_surrogate(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor
) -> torch.Tensor:
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    return (per_token_loss * mask).sum() / normalizer


def aspo_fused(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor
) -> torch.Tensor:
    per_token_loss, _ = asymmetric_policy_loss(lp, old, adv.squeeze(1), EPS_LOW, EPS_HIGH, DUAL_CLIP)
    return aggregate_loss(per_token_loss, mask, "token", normalizer)


def aspo_plain_ops(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor
) -> torch.Tensor:
    r = torch.exp(torch.clamp(lp - old, -20, 20))
    c_pos = torch.clamp(r, max=1 + EPS_HIGH)
    c_neg = torch.clamp(r, min=1 - EPS_LOW)
    dual = -adv * DUAL_CLIP * lp
    pos = torch.where(r < 1 / DUAL_CLIP, dual, -adv * c_pos / c_pos.detach() / c_pos.detach())
    neg = torch.where(r > DUAL_CLIP, dual, -adv * c_neg)
    per_token_loss = torch.where(adv > 0, pos, torch.where(adv < 0, neg, torch.zeros_like(r)))
    return (per_token_loss * mask).sum() / normalizer


def trl_surrogate_with_metrics(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor
) -> torch.Tensor:
    """The surrogate and GRPOTrainer._compute_loss's metric code for loss_type dapo (one process, no KL)."""
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    loss = (-torch.min(coef_1 * adv, coef_2 * adv) * mask).sum() / normalizer
    entropies = -lp.detach()

    def global_masked_mean(x: torch.Tensor) -> float:
        totals = torch.stack([(x * mask).sum(), mask.sum().float()])
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum(-1) / mask.sum(-1)

    global_masked_mean(entropies)
    is_low = (coef_1 < 1 - EPS_LOW) & (adv < 0)
    is_high = (coef_1 > 1 + EPS_HIGH) & (adv > 0)
    for clipped in (is_low, is_high, is_low | is_high):
        global_masked_mean(clipped.float())
    nanmin(masked_seq_mean(is_low.float())).item()
    nanmax(masked_seq_mean(is_high.float())).item()
    loss.detach().item()  # policy_loss
    return loss


def aspo_fused_with_metrics(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor
) -> torch.Tensor:
    """The fused loss and ASPOTrainer._log_aspo_metrics (one process, no KL)."""
    per_token_loss, stats = asymmetric_policy_loss(lp, old, adv.squeeze(1), EPS_LOW, EPS_HIGH, DUAL_CLIP)
    loss = aggregate_loss(per_token_loss, mask, "token", normalizer)
    entropies = -lp.detach()
    names = ("hard_clip_pos", "hard_clip_neg", "dual_clip_pos", "dual_clip_neg", "flipped")
    columns = [(stats[name].float() * mask).sum() for name in names]
    columns += [(stats["flip_weight"] * mask).sum(), (entropies * mask).sum(), mask.sum().float(), loss.detach()]
    torch.stack(columns).tolist()
    return loss


VARIANTS: dict[str, LossFn] = {
    "trl surrogate": trl_surrogate,
    "aspo fused": aspo_fused,
    "aspo plain ops": aspo_plain_ops,
    "trl surrogate + metrics": trl_surrogate_with_metrics,
    "aspo fused + metrics": aspo_fused_with_metrics,
}


def make_inputs(batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(batch, seq, generator=g) * 5
    old = lp + 0.3 * torch.randn(batch, seq, generator=g)  # off-policy, so every clip region is populated
    adv = torch.randn(batch, 1, generator=g)
    lengths = torch.randint(seq // 4, seq + 1, (batch, 1), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths).float()
    normalizer = mask.sum()
    return tuple(t.to(device) for t in (lp, old, adv, mask, normalizer))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(fn: LossFn, inputs: tuple[torch.Tensor, ...], device: torch.device) -> float:
    lp, *rest = inputs
    lp = lp.detach().requires_grad_()
    sync(device)
    start = time.perf_counter()
    fn(lp, *rest).backward()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def saved_tensors(fn: LossFn, inputs: tuple[torch.Tensor, ...]) -> tuple[int, float]:
    """Number of tensors autograd saves for backward, and their size in MB with shared storages counted once."""
    lp, *rest = inputs
    lp = lp.detach().requires_grad_()
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(lp, *rest)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}
    del loss
    return len(packed), sum(storages.values()) / 2**20


def cuda_peak_mb(fn: LossFn, inputs: tuple[torch.Tensor, ...], device: torch.device) -> float:
    lp, *rest = inputs
    lp = lp.detach().requires_grad_()
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn(lp, *rest).backward()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--B", type=int, default=32)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    inputs = make_inputs(args.B, args.T, device)

    for fn in VARIANTS.values():
        for _ in range(args.warmup):
            time_step(fn, inputs, device)
    # Interleaved, so load from other processes on a shared machine hits every variant alike.
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, fn in VARIANTS.items():
            times[name].append(time_step(fn, inputs, device))
    rows = {}
    for name, fn in VARIANTS.items():
        count, megabytes = saved_tensors(fn, inputs)
        peak = cuda_peak_mb(fn, inputs, device) if device.type == "cuda" else None
        rows[name] = (statistics.median(times[name]), min(times[name]), count, megabytes, peak)

    base_ms = rows["trl surrogate"][0]
    threads = torch.get_num_threads() if device.type == "cpu" else None
    print(
        f"B={args.B} T={args.T} float32 device={device} repeats={args.repeats} (median)"
        + (f" threads={threads}" if threads else "")
    )
    header = "| loss | fwd+bwd median (ms) | min (ms) | median vs surrogate | saved tensors | saved MB |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if device.type == "cuda":
        header += " CUDA peak MB |"
        rule += "---:|"
    print(header)
    print(rule)
    trl_with_metrics_ms = rows["trl surrogate + metrics"][0]
    for name, (ms, fastest, count, megabytes, peak) in rows.items():
        versus = f"{ms / base_ms:.2f}x"
        if name == "aspo fused + metrics":
            versus += f" ({ms / trl_with_metrics_ms:.2f}x trl + metrics)"
        line = f"| {name} | {ms:.3f} | {fastest:.3f} | {versus} | {count} | {megabytes:.1f} |"
        if peak is not None:
            line += f" {peak:.1f} |"
        print(line)
    print("\nSaved tensors include the aggregation's mask and normalizer, identical in every row.")


if __name__ == "__main__":
    main()
