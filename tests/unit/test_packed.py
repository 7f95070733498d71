"""SegmentRows: the (S, T) per-sample layout of a packed batch's loss targets."""

from __future__ import annotations

import pytest
import torch

from trl_aspo.algorithms.packed import SegmentRows


def test_layout_by_hand():
    rows = SegmentRows(torch.tensor([0, 0, 0, 1, 2, 2]))
    assert rows.shape == (3, 3)
    assert rows.mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], requires_grad=True)
    laid_out = rows.to_rows(values, fill=-1.0)
    assert laid_out.tolist() == [[1.0, 2.0, 3.0], [4.0, -1.0, -1.0], [5.0, 6.0, -1.0]]
    assert rows.first_of_row(values).tolist() == [1.0, 4.0, 5.0]
    (laid_out * torch.arange(9.0).view(3, 3)).sum().backward()
    # Each value's gradient is the weight of the cell it landed in: cells 0, 1, 2, 3, 6, 7.
    assert values.grad.tolist() == [0.0, 1.0, 2.0, 3.0, 6.0, 7.0]


def test_empty_batch():
    rows = SegmentRows(torch.zeros(0, dtype=torch.long))
    assert rows.shape == (0, 0) and rows.to_rows(torch.zeros(0)).shape == (0, 0)


@pytest.mark.parametrize("segment_id", [[0, 1, 0], [-1, 0], [[0, 1]]])
def test_bad_layouts_are_refused(segment_id):
    with pytest.raises(ValueError, match="segment_id"):
        SegmentRows(torch.tensor(segment_id))


def test_loss_units_count_targets_and_samples_with_targets():
    from trl_aspo.algorithms.packed import packed_loss_units

    # Sample 1 has no target (only tool output or prompt): it is no completion of the loss.
    assert packed_loss_units(torch.tensor([0, 0, 0, 2, 2])).tolist() == [5.0, 2.0]
    assert packed_loss_units(torch.zeros(0, dtype=torch.long)).tolist() == [0.0, 0.0]
