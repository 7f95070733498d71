"""Per-sample rows of a packed batch.

TRL's `AsyncGRPOTrainer` packs a micro-batch's samples into one tree-packed row; each loss target (a trained token
of one sample) carries `segment_id`, the index of the sample it came from, and the targets of one sample are listed
together, in token order. The parts of the asymmetric loss that work per completion (ASPO, arXiv 2510.06062: the
entropy split's per-completion quantile, the unflipped share drawn per sample, `sequence` aggregation) need them as
(S, T) rows: target ``m`` of sample ``s = segment_id[m]`` goes to ``rows[s, m - first(s)]``, where ``first(s)`` is
the index of the sample's first target; the mask marks the filled entries.
"""

from __future__ import annotations

import torch


class SegmentRows:
    """The (S, T) layout of `M` packed loss targets, from their `segment_id` (M,) (samples 0 .. S-1)."""

    def __init__(self, segment_id: torch.Tensor) -> None:
        if segment_id.dim() != 1:
            raise ValueError(f"`segment_id` must be 1-D (one per loss target), got shape {tuple(segment_id.shape)}.")
        if segment_id.numel() and (bool((segment_id < 0).any()) or bool((segment_id.diff() < 0).any())):
            raise ValueError("`segment_id` must be non-negative and list each sample's targets together, in order.")
        num_rows = int(segment_id.max()) + 1 if segment_id.numel() else 0
        counts = torch.bincount(segment_id, minlength=num_rows)
        first = counts.cumsum(0) - counts
        self.row = segment_id
        self.column = torch.arange(segment_id.numel(), device=segment_id.device) - first[segment_id]
        self.shape = (num_rows, int(counts.max()) if num_rows else 0)
        self.mask = torch.zeros(self.shape, dtype=torch.bool, device=segment_id.device)
        self.mask[self.row, self.column] = True

    def to_rows(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """(M,) values as (S, T) rows, `fill` where a sample has no target; differentiable in `values`."""
        rows = values.new_full(self.shape, fill)
        return rows.index_put((self.row, self.column), values)

    def first_of_row(self, values: torch.Tensor) -> torch.Tensor:
        """(S,) the value at each sample's first target (a per-sample quantity stamped on every target)."""
        return self.to_rows(values)[:, 0]


def packed_loss_units(segment_id: torch.Tensor) -> torch.Tensor:
    """(2,) float32: the loss targets (action tokens) of a packed row and the samples with at least one of them, from
    the targets' `segment_id` (M,): the units that `aspo_aggregation` 'token' and 'sequence' average over."""
    samples = torch.unique(segment_id).numel()
    return torch.tensor([float(segment_id.numel()), float(samples)], device=segment_id.device)
