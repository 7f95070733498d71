r"""Asymmetric importance-sampling policy loss (ASPO) and the small pure helpers around it.

Reference: Wang et al. 2025, ASPO (asymmetric importance sampling policy optimization), arXiv 2510.06062.

Per token, with current log-prob ``lp`` (differentiable), behaviour log-prob ``lp_old``, advantage ``A``,
ratio ``r = exp(clamp(lp - lp_old, -20, 20))``, hard-clip offsets ``eps_low``/``eps_high`` and soft dual
clip constant ``C > 1``; ``sg`` is stop-gradient. Every term is built so that ``d loss / d lp = -A * w``:

    token (A > 0 rows: flipped)      loss value                                          weight w
    A > 0, 1/C <= r <= 1+eps_high    -A * c / sg(c) / sg(c), c = min(r, 1+eps_high)      1/r  (the flip)
                                     (value -A/r)
    A > 0, r > 1+eps_high            same expression, c constant (value -A/(1+eps_high))  0   (hard clip)
    A > 0, r < 1/C                   -A * C * lp                                         C   (soft dual clip)
    A < 0, 1-eps_low <= r <= C       -A * c, c = max(r, 1-eps_low)                       r   (standard PPO)
    A < 0, r < 1-eps_low             same expression, c constant (value -A*(1-eps_low))   0   (hard clip)
    A < 0, r > C                     -A * C * lp                                         C   (soft dual clip)
    A = 0                            0                                                   0

Positive-advantage tokens that are *not* flipped (progressive flip: ``0 < A <= flip_threshold``; or the
"unflipped mix" samples) use TRL's standard clipped surrogate ``-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)``,
i.e. value ``-A * min(r, 1+eps_high)`` and ``w = r`` below ``1+eps_high``, 0 above.

The flip multiplies the standard PPO gradient ``r`` by ``1/r^2``: low-probability good tokens (``r < 1``)
get larger updates, the opposite of PPO's ratio weighting. On-policy (``r == 1``) every row reduces to
``w = 1`` and the gradient equals TRL's clipped surrogate.

The loss is one ``torch.autograd.Function`` that keeps a single (B, T) tensor, ``-A * w``, for backward:
the plain-op formulation keeps the ratio, clip masks and intermediate products alive instead.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# exp(20) ~ 4.9e8 is far beyond any clip boundary, so clamping changes no region and keeps exp finite.
LOG_RATIO_CLAMP = 20.0

_AGGREGATIONS = ("token", "sequence")


STATS_KEYS = ("ratio", "flipped", "flip_weight", "hard_clip_pos", "hard_clip_neg", "dual_clip_pos", "dual_clip_neg")


def _log_bounds(
    epsilon_low: float | torch.Tensor, epsilon_high: float | torch.Tensor
) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """log(1 - eps_low) and log(1 + eps_high); eps_low >= 1 means no lower clip (log 0 = -inf)."""
    if isinstance(epsilon_low, torch.Tensor):
        log_lower = (1.0 - epsilon_low).clamp(min=0.0).log()
    else:
        log_lower = math.log(1.0 - epsilon_low) if epsilon_low < 1.0 else -math.inf
    log_upper = epsilon_high.log1p() if isinstance(epsilon_high, torch.Tensor) else math.log1p(epsilon_high)
    return log_lower, log_upper


class _AsymmetricISLoss(torch.autograd.Function):
    """Fused forward (loss values and stats) and backward (``grad_output * -A * w``).

    Works in log space on ``z = sigma * log r`` with ``sigma = -1`` on flipped tokens and ``+1`` elsewhere: every
    region's coefficient is then ``k = exp(clamp(z, z_min, z_max))`` with per-row bounds (flipped: ``z >=
    -log(1+eps_high)``; unflipped positive: ``z <= log(1+eps_high)``; negative: ``z >= log(1-eps_low)``), the
    value is ``-A * k``, and the unclipped weight ``w`` equals ``k`` (``1/r`` flipped, ``r`` otherwise). So one
    clamp and one exp serve all rows, the bounds stay (B, 1) unless offsets or advantages vary per token, and
    ``-A * w`` is the value itself with clipped tokens zeroed.
    """

    @staticmethod
    def forward(
        ctx: Any,
        per_token_logps: torch.Tensor,
        old_per_token_logps: torch.Tensor,
        advantages: torch.Tensor,
        epsilon_low: float | torch.Tensor,
        epsilon_high: float | torch.Tensor,
        dual_clip_pos: float,
        dual_clip_neg: float,
        flip_threshold: float,
        unflipped_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        lp = per_token_logps
        log_ratio = (lp - old_per_token_logps).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = log_ratio.exp()
        dtype, device = log_ratio.dtype, log_ratio.device

        def full(value: float | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(value, dtype=dtype, device=device)

        pos = advantages > 0
        neg = advantages < 0
        flip = advantages > flip_threshold
        if unflipped_mask is not None:
            flip = flip & ~unflipped_mask
        log_lower, log_upper = _log_bounds(epsilon_low, epsilon_high)
        z = log_ratio.mul_(torch.where(flip, full(-1.0), full(1.0)))
        z_min = torch.where(flip, -full(log_upper), torch.where(neg, full(log_lower), full(-math.inf)))
        z_max = torch.where(pos & ~flip, full(log_upper), full(math.inf))
        k = torch.clamp(z, z_min, z_max)
        clipped = k != z
        k = k.exp_()

        neg_adv = -advantages
        loss = neg_adv * k
        neg_adv_weight = loss.masked_fill(clipped, 0.0)
        flip_weight = torch.where(flip & ~clipped, k, full(0.0)).float()
        if math.isfinite(dual_clip_pos) or math.isfinite(dual_clip_neg):
            # Flipped tokens with r < 1/C_pos and negative ones with r > C_neg both read z > log C.
            log_c = torch.where(
                flip, full(math.log(dual_clip_pos)), torch.where(neg, full(math.log(dual_clip_neg)), full(math.inf))
            )
            dual = z > log_c
            neg_adv_c = neg_adv * torch.where(flip, full(dual_clip_pos), full(dual_clip_neg))
            loss = torch.where(dual, neg_adv_c * lp, loss)
            neg_adv_weight = torch.where(dual, neg_adv_c, neg_adv_weight)
            dual_pos, dual_neg = dual & pos, dual & neg
            flip_weight = flip_weight.masked_fill_(dual_pos, dual_clip_pos)
        else:
            dual_pos = dual_neg = torch.zeros_like(clipped)

        ctx.save_for_backward(neg_adv_weight)
        ctx.lp_dtype = lp.dtype
        ctx.set_materialize_grads(False)
        stats = (
            ratio.float(),
            flip.expand(ratio.shape).float(),
            flip_weight,
            (clipped & pos).float(),
            (clipped & neg).float(),
            dual_pos.float(),
            dual_neg.float(),
        )
        ctx.mark_non_differentiable(*stats)
        return (loss, *stats)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor | None, *_stats_grads: Any) -> tuple[torch.Tensor | None, ...]:
        (neg_adv_weight,) = ctx.saved_tensors
        grad_lp = None if grad_loss is None else (grad_loss * neg_adv_weight).to(ctx.lp_dtype)
        return grad_lp, None, None, None, None, None, None, None, None


def _check_epsilon(name: str, value: float) -> None:
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"`{name}` must be >= 0, got {value}.")


def _per_token(name: str, tensor: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Return a (B, 1) or (B, T) view of a (B,) or (B, T) tensor, rejecting any other shape."""
    if tensor.shape == (batch,):
        return tensor.unsqueeze(1)
    if tensor.shape == (batch, seq):
        return tensor
    raise ValueError(f"`{name}` must have shape ({batch},) or ({batch}, {seq}), got {tuple(tensor.shape)}.")


def asymmetric_policy_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    dual_clip: float = 3.0,
    high_entropy_mask: torch.Tensor | None = None,
    epsilon_low_high_entropy: float | None = None,
    epsilon_high_high_entropy: float | None = None,
    *,
    flip_threshold: float = 0.0,
    unflipped_mask: torch.Tensor | None = None,
    dual_clip_pos: float | None = None,
    dual_clip_neg: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token ASPO loss (see the module docstring for the table of values and gradients).

    Args:
        per_token_logps: (B, T) log-probs of the current policy; the only input that receives a gradient.
        old_per_token_logps: (B, T) log-probs of the behaviour policy (``per_token_logps.detach()`` on-policy).
        advantages: (B,) or (B, T).
        epsilon_low, epsilon_high: hard-clip offsets, ``r`` is clipped to ``[1 - epsilon_low, 1 + epsilon_high]``.
        dual_clip: soft dual clip constant ``C > 1`` (``math.inf`` disables the dual clip).
        dual_clip_pos, dual_clip_neg: separate constants for flipped (positive) and negative tokens, as the
            reference's ``positive_clip_ratio_c`` / ``negative_clip_ratio_c``; ``None`` means ``dual_clip``.
        high_entropy_mask: (B, T) bool, True where a token uses the ``*_high_entropy`` offsets (see
            :func:`entropy_split_mask`).
        epsilon_low_high_entropy, epsilon_high_high_entropy: offsets for high-entropy tokens; ``None`` means the
            normal offset.
        flip_threshold: progressive flip, only tokens with ``A > flip_threshold`` are flipped; positive tokens
            at or below it use the standard PPO term (see :func:`progressive_flip_threshold`).
        unflipped_mask: (B,) or (B, T) bool, True where positive-advantage tokens keep the standard PPO term
            ("unflipped mix", see :func:`unflipped_sample_mask`).

    Returns:
        ``per_token_loss`` (B, T), neither masked nor aggregated, in the promoted dtype of the inputs, and
        ``stats``: detached float32 (B, T) tensors, for the caller to mask and reduce:

        - ``ratio``: ``r = exp(clamp(lp - lp_old, -20, 20))``.
        - ``flipped``: 1 where the token uses the flipped ratio (``A > flip_threshold`` and not unflipped).
        - ``flip_weight``: the weight ``w`` of flipped tokens (``1/r``, 0 if hard-clipped, ``C`` if dual-clipped),
          0 on other tokens; the mean flipped weight is ``sum(flip_weight * m) / sum(flipped * m)``.
        - ``hard_clip_pos``: 1 where ``A > 0`` and ``r > 1 + eps_high`` (flipped or not): zero gradient.
        - ``hard_clip_neg``: 1 where ``A < 0`` and ``r < 1 - eps_low``: zero gradient.
        - ``dual_clip_pos``: 1 where a flipped token has ``r < 1/C_pos``: weight C_pos.
        - ``dual_clip_neg``: 1 where ``A < 0`` and ``r > C_neg``: weight C_neg.

    Raises:
        ValueError: on shape mismatches, ``dual_clip <= 1``, negative offsets or a negative ``flip_threshold``.
    """
    if per_token_logps.dim() != 2:
        raise ValueError(f"`per_token_logps` must have shape (B, T), got {tuple(per_token_logps.shape)}.")
    batch, seq = per_token_logps.shape
    if old_per_token_logps.shape != per_token_logps.shape:
        raise ValueError(
            f"`old_per_token_logps` must have the shape of `per_token_logps` {(batch, seq)}, "
            f"got {tuple(old_per_token_logps.shape)}."
        )
    advantages = _per_token("advantages", advantages, batch, seq)
    dual_clip_pos = dual_clip if dual_clip_pos is None else dual_clip_pos
    dual_clip_neg = dual_clip if dual_clip_neg is None else dual_clip_neg
    for name, value in (("dual_clip", dual_clip), ("dual_clip_pos", dual_clip_pos), ("dual_clip_neg", dual_clip_neg)):
        if not value > 1.0:
            raise ValueError(f"`{name}` must be > 1, got {value}.")
    if not flip_threshold >= 0.0:
        raise ValueError(f"`flip_threshold` must be >= 0, got {flip_threshold}.")
    _check_epsilon("epsilon_low", epsilon_low)
    _check_epsilon("epsilon_high", epsilon_high)
    if unflipped_mask is not None:
        unflipped_mask = _per_token("unflipped_mask", unflipped_mask, batch, seq).bool()

    dtype = torch.promote_types(
        torch.promote_types(per_token_logps.dtype, old_per_token_logps.dtype), advantages.dtype
    )
    eps_low: float | torch.Tensor = epsilon_low
    eps_high: float | torch.Tensor = epsilon_high
    if high_entropy_mask is not None:
        if high_entropy_mask.shape != per_token_logps.shape:
            raise ValueError(
                f"`high_entropy_mask` must have shape {(batch, seq)}, got {tuple(high_entropy_mask.shape)}."
            )
        wide_low = epsilon_low if epsilon_low_high_entropy is None else epsilon_low_high_entropy
        wide_high = epsilon_high if epsilon_high_high_entropy is None else epsilon_high_high_entropy
        _check_epsilon("epsilon_low_high_entropy", wide_low)
        _check_epsilon("epsilon_high_high_entropy", wide_high)
        hem = high_entropy_mask.bool()

        def per_token_offset(wide: float, normal: float) -> torch.Tensor:
            # Built in the loss dtype: a float32 0.4 widened to float64 would move the clip boundary.
            return torch.where(hem, *(torch.as_tensor(e, dtype=dtype, device=hem.device) for e in (wide, normal)))

        eps_low = per_token_offset(wide_low, epsilon_low)
        eps_high = per_token_offset(wide_high, epsilon_high)

    loss, *stats = _AsymmetricISLoss.apply(
        per_token_logps,
        old_per_token_logps.to(dtype),
        advantages.to(dtype),
        eps_low,
        eps_high,
        float(dual_clip_pos),
        float(dual_clip_neg),
        float(flip_threshold),
        unflipped_mask,
    )
    return loss, dict(zip(STATS_KEYS, stats, strict=True))


def clipped_surrogate_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) PPO's clipped surrogate ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, ``r = exp(lp - lp_old)``:
    the per-token loss of TRL's `AsyncGRPOTrainer` ("ppo"), here for its decoupled mode, where the ratio is taken
    against the proximal policy, and for its dual clip. ``advantages`` is (B,) or (B, T).

    `dual_clip` (c > 1; Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", arXiv 1912.09729;
    verl's `clip_ratio_c`, AReaL's `c_clip`): for ``A < 0`` the term becomes ``min(surrogate, -c A)``, so a token whose
    ratio has grown far above 1 adds at most ``-c A`` and no gradient. Returns the loss and where the cap binds (bool,
    (B, T))."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(per_token_logps - old_per_token_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if dual_clip is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    if not dual_clip > 1:
        raise ValueError(f"`dual_clip` must be > 1 (a cap at or below the clipped surrogate's), got {dual_clip}.")
    cap = -dual_clip * advantages
    capped = (advantages < 0) & (loss.detach() > cap)
    return torch.where(capped, cap.to(loss.dtype), loss), capped


def entropy_split_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float = 0.8) -> torch.Tensor:
    """(B, T) bool: valid tokens whose entropy is strictly above the ``quantile`` of their own completion.

    The per-completion threshold follows ``torch.quantile`` (linear interpolation) over that completion's valid
    tokens; completions without valid tokens get no True. Unlike TRL's ``top_entropy_quantile`` (one threshold
    for the whole batch), ASPO splits within each completion so long and short answers are treated alike.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"`quantile` must be in [0, 1], got {quantile}.")
    if entropies.shape != mask.shape or entropies.dim() != 2:
        raise ValueError(
            f"`entropies` and `mask` must share a (B, T) shape, got {tuple(entropies.shape)} and {tuple(mask.shape)}."
        )
    valid = mask.bool()
    ent = entropies.detach().float()
    # Padding sorts last, so the first `count` sorted entries of a row are its valid entropies.
    ordered = ent.masked_fill(~valid, math.inf).sort(dim=-1).values
    count = valid.sum(-1, keepdim=True)
    position = (count - 1).clamp(min=0).to(ent.dtype) * quantile
    below = position.floor()
    low = ordered.gather(-1, below.long())
    high = ordered.gather(-1, position.ceil().long())
    # Written as low + frac * (high - low) only where high differs, so inf - inf never appears.
    frac = position - below
    threshold = torch.where(high == low, low, low + frac * (high - low))
    return valid & (ent > threshold) & (count > 0)


def progressive_flip_threshold(step: int, start: float, decay_steps: int) -> float:
    """Linear decay of the flip threshold from ``start`` at step 0 to 0 at ``decay_steps`` (0 afterwards)."""
    if start < 0 or decay_steps < 0:
        raise ValueError(f"`start` and `decay_steps` must be >= 0, got {start} and {decay_steps}.")
    if decay_steps == 0:
        return 0.0
    return float(start) * max(0.0, 1.0 - step / decay_steps)


def unflipped_sample_mask(
    advantages: torch.Tensor,
    fraction: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B,) bool marking ``round(fraction * P)`` (Python's rounding) of the ``P`` positive-advantage samples at random.

    True marks samples whose positive-advantage tokens keep the standard PPO ratio ("unflipped mix" of the ASPO
    reference, arXiv 2510.06062): the share is drawn among positive-advantage samples, where the flip acts, so
    ``fraction`` is the share of positive samples left unflipped. ``advantages`` holds one advantage per sample (B,).
    Pass a seeded ``generator`` (a CPU one) so every rank draws the same samples. Returned on ``advantages``' device.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"`fraction` must be in [0, 1], got {fraction}.")
    if advantages.dim() != 1:
        raise ValueError(f"`advantages` must be 1-D (one per sample), got shape {tuple(advantages.shape)}.")
    positive = (advantages.detach().cpu() > 0).nonzero().flatten()
    order = torch.randperm(len(positive), generator=generator)
    chosen = positive[order[: round(fraction * len(positive))]]
    unflipped = torch.zeros(len(advantages), dtype=torch.bool)
    unflipped[chosen] = True
    return unflipped.to(advantages.device)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str = "token",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    - ``"token"``: ``sum(loss * mask) / normalizer``: every action token weighs the same. ``None`` uses the local
      token count (TRL ``bnpo``); the trainers pass an optimizer step's count (`step_loss_normalizer`, or TRL's
      ``dapo`` normalizer in the synchronous trainer).
    - ``"sequence"``: ``sum_i (sum_t loss_it * mask_it / sum_t mask_it) / normalizer``: every completion weighs the
      same and tokens of long completions weigh less (TRL ``grpo``). ``None`` divides by the local number of rows.
    """
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {_AGGREGATIONS}, got {aggregation!r}.")
    if mask.shape != per_token_loss.shape:
        raise ValueError(f"`mask` must have shape {tuple(per_token_loss.shape)}, got {tuple(mask.shape)}.")
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if aggregation == "token":
        if normalizer is None:
            normalizer = mask.sum().clamp(min=1.0)
        return masked.sum() / normalizer
    sequence_means = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    if normalizer is None:
        return sequence_means.mean()
    return sequence_means.sum() / normalizer


def step_loss_normalizer(step_units: float | torch.Tensor, world_size: int) -> torch.Tensor:
    r"""The ``normalizer`` of `aggregate_loss` that makes one optimizer step's gradient a mean over the whole step.

    With ``N`` = the step's units over all its micro-batches and all ranks (action tokens for ``"token"``,
    completions for ``"sequence"``) and ``W`` ranks, rank ``r`` returns ``loss_{r,m} = sum_{r,m} / (N / W)`` for its
    micro-batch ``m``. DDP averages gradients over the ranks and gradient accumulation sums them over the
    micro-batches, so the step's gradient is ``grad (1/W) sum_{r,m} loss_{r,m} = grad sum_{r,m} sum_{r,m} / N``:
    each unit weighs ``1/N`` whatever rank or micro-batch it lands on (no further division by the accumulation
    steps). Returns ``max(N, 1) / W``.
    """
    return torch.as_tensor(step_units, dtype=torch.float32).clamp(min=1.0) / world_size


def repetition_rate(completion_ids: torch.Tensor, mask: torch.Tensor, n: int = 4) -> torch.Tensor:
    """Share of completions in which some token n-gram occurs at least twice (0-d float32 tensor).

    Only n-grams of ``n`` consecutive valid tokens count, so tool outputs (mask 0) break n-grams instead of
    gluing the text before and after them together.
    """
    if n < 1:
        raise ValueError(f"`n` must be >= 1, got {n}.")
    if completion_ids.shape != mask.shape or completion_ids.dim() != 2:
        raise ValueError(
            f"`completion_ids` and `mask` must share a (B, T) shape, got {tuple(completion_ids.shape)} and "
            f"{tuple(mask.shape)}."
        )
    batch, seq = completion_ids.shape
    if batch == 0 or seq < n:
        return torch.zeros((), dtype=torch.float32, device=completion_ids.device)
    grams = completion_ids.unfold(1, n, 1)  # (B, T-n+1, n)
    gram_valid = mask.bool().unfold(1, n, 1).all(-1)
    # One `unique` over (row, n-gram) pairs of the whole batch instead of one per row: no per-row host sync.
    rows = torch.arange(batch, device=completion_ids.device).unsqueeze(1).expand(-1, grams.shape[1])
    keyed = torch.cat([rows.unsqueeze(-1), grams.long()], dim=-1)[gram_valid]  # (valid n-grams, 1 + n)
    distinct_rows = torch.unique(keyed, dim=0)[:, 0]
    distinct = torch.bincount(distinct_rows, minlength=batch)
    return (distinct < gram_valid.sum(-1)).float().mean()
