"""A plain-PyTorch stand-in for the FA3 varlen kernel behind TRL's packed tree attention.

TRL's `tree_attention` (trl/experimental/async_grpo/packing.py) gathers, for every segment of a packed prefix trie,
the K/V rows of its root-to-segment path and calls `flash_attn_varlen_func` from an FA3 kernel fetched from the Hub.
That kernel needs CUDA and the network. `varlen_attention` computes the same function: for segment `s` with queries
`Q_s` (its own `L_q` tokens) and keys/values `K_s, V_s` (its path's `L_k >= L_q` tokens, the segment last),

    O_s = softmax(c(Q_s K_s^T * scale) + M_s) V_s,

where `c` is the optional tanh soft-cap `c(x) = cap * tanh(x / cap)` and `M_s` the causal mask aligned to the bottom
right, as FlashAttention aligns it when `L_q < L_k`: query `i` sits at path position `i + L_k - L_q` and sees keys
`j <= i + L_k - L_q` (and, with a sliding window of `w` tokens, `j > i + L_k - L_q - w`). Grouped-query attention
repeats each K/V head for its `H_q / H_k` query heads (Dao 2023, "FlashAttention-2", arXiv:2307.08691, for the
varlen interface; Vaswani et al. 2017 for the attention itself).

`install_tree_attention_fallback` routes TRL's kernel lookup to this function only when the kernel cannot be used.
"""

from __future__ import annotations

import functools
import logging
import math
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """FlashAttention's `flash_attn_varlen_func` in plain PyTorch (float32 softmax), one segment at a time.

    Args:
        query: `(N_q, H_q, D)`, the segments' queries laid end to end.
        key, value: `(N_k, H_k, D)`, the segments' keys and values laid end to end; `H_q` must be a multiple of `H_k`.
        cu_seqlens_q, cu_seqlens_k: `(S + 1,)` segment boundaries in `query` and in `key`/`value`.
        max_seqlen_q, max_seqlen_k: accepted for signature compatibility; the boundaries already say it all.
        softmax_scale: defaults to `1 / sqrt(D)`.
        causal: bottom-right aligned causal mask (see the module docstring).
        window_size: `(left, right)`; `left >= 0` limits each query to the `left + 1` latest keys it may see.
        softcap: tanh soft-cap of the scores; 0 disables it.

    Returns:
        `(N_q, H_q, D)` in `query`'s dtype.
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query has {num_heads} heads, not a multiple of the {num_kv_heads} key/value heads.")
    if len(cu_seqlens_q) != len(cu_seqlens_k):
        raise ValueError(
            f"cu_seqlens_q has {len(cu_seqlens_q)} boundaries but cu_seqlens_k has {len(cu_seqlens_k)}: "
            "every query segment needs its key segment."
        )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    left_window = window_size[0]
    output = torch.empty_like(query)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q_start, q_end, k_start, k_end in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        if q_end == q_start:
            continue
        q = query[q_start:q_end].float().transpose(0, 1)
        k = key[k_start:k_end].float().repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        v = value[k_start:k_end].float().repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        length_q, length_k = q_end - q_start, k_end - k_start
        query_position = torch.arange(length_q, device=query.device)[:, None] + (length_k - length_q)
        key_position = torch.arange(length_k, device=query.device)[None, :]
        visible = torch.ones(length_q, length_k, dtype=torch.bool, device=query.device)
        if causal:
            visible &= key_position <= query_position
        if left_window >= 0:
            visible &= key_position >= query_position - left_window
        scores = scores.masked_fill(~visible, float("-inf"))
        output[q_start:q_end] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(query.dtype)
    return output


TORCH_VARLEN_KERNEL = SimpleNamespace(flash_attn_varlen_func=varlen_attention)


def install_tree_attention_fallback() -> None:
    """Make TRL's tree attention fall back to `varlen_attention` when the FA3 kernel is unavailable; idempotent.

    TRL resolves its kernel through `trl.experimental.async_grpo.packing._flash_attn()` at every call, so that lookup
    is the one thing replaced: TRL's `tree_attention` (K/V gathering, dtype handling, registration) runs unchanged.
    The kernel is still used wherever it loads (a CUDA/ROCm device and the `kernels` package reaching the Hub).
    """
    from trl.experimental.async_grpo import packing

    if getattr(packing._flash_attn, "falls_back_to_torch", False):
        return
    load_kernel = packing._flash_attn

    @functools.cache
    def resolve_kernel():
        if torch.cuda.is_available():
            try:
                return load_kernel()
            except Exception as error:  # noqa: BLE001 - any failure to fetch or load the kernel means "unavailable"
                logger.warning(f"FA3 tree-attention kernel unavailable ({error}); using the PyTorch fallback.")
        return TORCH_VARLEN_KERNEL

    resolve_kernel.falls_back_to_torch = True
    packing._flash_attn = resolve_kernel
