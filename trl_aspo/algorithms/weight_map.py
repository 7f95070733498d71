r"""The ASPO weight map: the per-token gradient weight as a function of the token's old and current probability.

Reference: Wang et al. 2025, ASPO (asymmetric importance sampling policy optimization), arXiv 2510.06062, whose
core figure draws this map for positive- and negative-advantage tokens.

Every policy loss here has, per token, ``d loss / d lp = -A * w``: the loss pushes ``log pi`` of the token along
``A * w``, so ``w`` is the token's weight in the policy gradient ``-A * w * grad(log pi)``. With ratio
``r = pi / pi_old = exp(lp - lp_old)``:

    loss                                     A > 0                               A < 0
    TRL's clipped ratio (grpo, dapo, ...)    r if r <= 1+eps_high, else 0        r if r >= 1-eps_low, else 0
    (without TRL's delta; see clipped_ratio_weight)
    aspo (trl_aspo.algorithms.losses)                   1/r (flip), 0 if r > 1+eps_high,    r, 0 if r < 1-eps_low,
                                             C_pos if r < 1/C_pos                C_neg if r > C_neg

so the standard ratio up-weights positive tokens whose probability has already risen (``r > 1``) and ASPO reverses
that. The map bins the action tokens of each advantage sign by ``(pi_old, pi)`` into a K x K grid of equal
probability bins over [0, 1] and keeps, per cell, the sum of ``w`` and the token count (:func:`weight_map_sums`);
sums add over micro-batches, ranks and logging windows, so a cell's mean weight ``sum / count`` is exact over any
span. :class:`WeightMapLog` keeps the run's total and a bounded list of windows and writes them as JSON
(``weight_map.json`` in the output directory, docs/asymmetric_loss.md); `trl_aspo.trainers.weight_map_mixin`
is the part both trainers share (logging windows, ranks, checkpoints). Factors applied after the policy term (TRL's
off-policy mask, entropy mask, vLLM IS correction) are not part of ``w``.
"""

from __future__ import annotations

import json
import os

import torch

WEIGHT_MAP_BINS = 10
WEIGHT_MAP_FILE = "weight_map.json"
# GRPOTrainer's losses whose coefficient `clipped_ratio_weight` computes; AsyncGRPOTrainer's "ppo" is the same clipped
# surrogate without `delta`. A registered loss has a weight when its registration gives one (`PolicyLoss.weight`).
CLIPPED_RATIO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
SIGNS = ("positive", "negative")


def clipped_ratio_weight(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    r"""(B, T) gradient weight ``w`` of TRL's token-level clipped surrogate ``-min(c1 A, c2 A)`` with
    ``c1 = min(r, delta)`` (``r`` without ``delta``) and ``c2 = clip(r, 1-eps_low, 1+eps_high)``
    (GRPOTrainer._compute_loss for grpo, bnpo, dr_grpo, dapo, luspo): ``d loss / d lp = -A w`` with ``w = r`` where
    the active term (``min(c1, c2)`` for ``A > 0``, ``max(c1, c2)`` for ``A < 0``) still depends on ``r``, else 0.
    Without ``delta``: ``A > 0``: ``w = r [r <= 1+eps_high]``; ``A < 0``: ``w = r [r >= 1-eps_low]``.
    ``advantages`` is (B,) or (B, T)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(per_token_logps.detach().float() - old_per_token_logps.detach().float())
    unclipped = (ratio >= 1 - epsilon_low) & (ratio <= 1 + epsilon_high)
    coef_1, below_delta = ratio, torch.ones_like(unclipped)
    if delta is not None:
        coef_1, below_delta = ratio.clamp(max=delta), ratio <= delta
    coef_2 = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    first_active = torch.where(advantages > 0, coef_1 <= coef_2, coef_1 >= coef_2)
    depends_on_ratio = torch.where(first_active, below_delta, unclipped)
    return torch.where(depends_on_ratio, ratio, torch.zeros_like(ratio))


def aspo_weight(stats: dict[str, torch.Tensor], advantages: torch.Tensor, dual_clip_neg: float) -> torch.Tensor:
    """(B, T) gradient weight ``w`` of the aspo loss from the stats of
    `trl_aspo.algorithms.losses.asymmetric_policy_loss`: ``flip_weight`` on flipped tokens (1/r, 0 hard-clipped, C_pos
    dual-clipped); on the others 0 where hard-clipped, ``dual_clip_neg`` (C_neg) where a negative token is
    dual-clipped, else ``r``. ``advantages`` is (B,) or (B, T)."""
    ratio = stats["ratio"]
    standard = torch.where(stats["dual_clip_neg"] > 0, torch.full_like(ratio, dual_clip_neg), ratio)
    standard = standard.masked_fill((stats["hard_clip_pos"] + stats["hard_clip_neg"]) > 0, 0.0)
    return torch.where(stats["flipped"] > 0, stats["flip_weight"], standard)


def weight_map_sums(
    old_per_token_logps: torch.Tensor,
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    bins: int = WEIGHT_MAP_BINS,
) -> torch.Tensor:
    r"""(2, 2, K, K) float64 sums over the action tokens (``mask``) of each advantage sign (index 0: A > 0, 1: A < 0;
    tokens with A = 0 are left out): ``[sign, 0]`` the sum of ``weight``, ``[sign, 1]`` the token count, per cell
    ``(i, j)`` with ``i = min(floor(K pi_old), K-1)`` and ``j = min(floor(K pi), K-1)``, ``pi = exp(log-prob)``.
    Log-probs, mask and weight are (B, T); ``advantages`` (B,) or (B, T)."""
    if bins < 1:
        raise ValueError(f"`bins` must be >= 1, got {bins}.")
    shape = per_token_logps.shape
    for name, tensor in (("old_per_token_logps", old_per_token_logps), ("mask", mask), ("weight", weight)):
        if tensor.shape != shape:
            raise ValueError(f"`{name}` must have the shape of `per_token_logps` {tuple(shape)}, got {tensor.shape}.")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.detach().expand(shape)

    def bin_of(logps: torch.Tensor) -> torch.Tensor:
        return (logps.detach().double().exp() * bins).floor().long().clamp(0, bins - 1)

    cell = bin_of(old_per_token_logps) * bins + bin_of(per_token_logps)
    valid = mask.detach().bool()
    sums = torch.zeros(2, 2, bins * bins, dtype=torch.float64, device=per_token_logps.device)
    for sign, selected in enumerate((valid & (advantages > 0), valid & (advantages < 0))):
        cells = cell[selected]
        sums[sign, 0].index_add_(0, cells, weight.detach()[selected].double())
        sums[sign, 1].index_add_(0, cells, torch.ones_like(cells, dtype=torch.float64))
    return sums.view(2, 2, bins, bins)


def _grids(sums: torch.Tensor) -> dict:
    return {
        sign: {"weight_sum": sums[index, 0].tolist(), "count": sums[index, 1].tolist()}
        for index, sign in enumerate(SIGNS)
    }


def _sums(entry: dict) -> torch.Tensor:
    return torch.tensor([[entry[sign]["weight_sum"], entry[sign]["count"]] for sign in SIGNS], dtype=torch.float64)


class WeightMapLog:
    """The run's weight map: the total over every logging window and at most ``max_windows`` windows, each
    ``(first_step, last_step, sums)``; past that, neighbouring windows are merged pairwise (sums add), so the file
    stays bounded (K=10: 400 numbers a window) and still covers the run from its first logged step."""

    def __init__(self, loss_type: str, bins: int = WEIGHT_MAP_BINS, max_windows: int = 32):
        self.loss_type = loss_type
        self.bins = bins
        self.max_windows = max_windows
        self.total = torch.zeros(2, 2, bins, bins, dtype=torch.float64)
        self.windows: list[tuple[int, int, torch.Tensor]] = []

    def add_window(self, first_step: int, last_step: int, sums: torch.Tensor) -> None:
        """Add one logging window's (rank-summed) `weight_map_sums`; a window without tokens is skipped."""
        sums = sums.detach().double().cpu()
        if sums[:, 1].sum() == 0:
            return
        self.total += sums
        self.windows.append((first_step, last_step, sums))
        if len(self.windows) > self.max_windows:
            pairs = zip(self.windows[0::2], self.windows[1::2] + [None], strict=True)
            self.windows = [a if b is None else (a[0], b[1], a[2] + b[2]) for a, b in pairs]

    def state_dict(self) -> dict:
        return {
            "format": 1,
            "loss_type": self.loss_type,
            "bins": self.bins,
            "axes": "grid[i][j]: i = old probability bin, j = current probability bin, bin k = [k/bins, (k+1)/bins)",
            "weight": "gradient coefficient w of -A * w * grad(log pi); mean = weight_sum / count",
            "total": _grids(self.total),
            "windows": [
                {"first_step": first, "last_step": last, **_grids(sums)} for first, last, sums in self.windows
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self.bins = state["bins"]
        self.total = _sums(state["total"])
        self.windows = [(entry["first_step"], entry["last_step"], _sums(entry)) for entry in state["windows"]]

    def write(self, directory: str) -> str:
        """Write `weight_map.json` into ``directory`` (atomically: a reader never sees half a file)."""
        path = os.path.join(directory, WEIGHT_MAP_FILE)
        os.makedirs(directory, exist_ok=True)
        with open(path + ".tmp", "w") as handle:
            json.dump(self.state_dict(), handle)
        os.replace(path + ".tmp", path)
        return path
