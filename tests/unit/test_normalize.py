"""Tests for batch (SPO) and action-token-measure (SPO++) advantage normalization."""

import math

import pytest
import torch

from trl_aspo.algorithms.normalize import batch_normalize, token_measure_normalize


def test_batch_normalize_hand_numbers():
    a = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    # mean 3, unbiased var = (4 + 1 + 0 + 9) / 3 = 14/3
    expected = [(x - 3.0) / (math.sqrt(14 / 3) + 1e-8) for x in (1.0, 2.0, 3.0, 6.0)]
    out = batch_normalize(a)
    assert out.tolist() == pytest.approx(expected, abs=1e-12)
    assert out.dtype == torch.float64
    assert batch_normalize(a.float()).dtype == torch.float32


def test_batch_normalize_degenerate():
    assert batch_normalize(torch.tensor([0.7])).tolist() == [0.0]
    assert batch_normalize(torch.tensor([0.2, 0.2, 0.2])).tolist() == [0.0, 0.0, 0.0]
    assert batch_normalize(torch.zeros(0)).numel() == 0
    with pytest.raises(ValueError, match="advantages"):
        batch_normalize(torch.zeros(2, 2))


def test_token_measure_hand_numbers():
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    counts = torch.tensor([1, 1, 2])
    # mu = (1 + 2 + 6) / 4 = 2.25; var = (1.5625 + 0.0625 + 2 * 0.5625) / 3 = 2.75 / 3
    sigma = math.sqrt(2.75 / 3)
    expected = [(x - 2.25) / (sigma + 1e-8) for x in (1.0, 2.0, 3.0)]
    assert token_measure_normalize(a, counts).tolist() == pytest.approx(expected, abs=1e-12)


def test_token_measure_weighted_moments():
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(64, generator=gen, dtype=torch.float64) - 0.4
    counts = torch.randint(0, 300, (64,), generator=gen)
    out = token_measure_normalize(a, counts, eps=0.0)
    weights = counts.to(torch.float64)
    assert (weights * out).sum().item() == pytest.approx(0.0, abs=1e-9)
    assert ((weights * out.square()).sum() / (weights.sum() - 1)).item() == pytest.approx(1.0, abs=1e-9)
    # The zero-token completion still gets a (finite) advantage; it just does not affect the moments.
    assert torch.isfinite(out).all()


def test_token_measure_equals_batch_when_all_counts_one():
    a = torch.randn(17, generator=torch.Generator().manual_seed(1))
    out = token_measure_normalize(a, torch.ones(17, dtype=torch.long))
    assert out.dtype == torch.float32
    assert torch.allclose(out, batch_normalize(a), atol=1e-6)


def test_token_measure_degenerate_totals():
    a = torch.tensor([0.3, 0.9])
    assert token_measure_normalize(a, torch.tensor([0, 0])).tolist() == [0.0, 0.0]
    # sum(L) = 1: mu = 0.9, centered only
    assert token_measure_normalize(a, torch.tensor([0, 1])).tolist() == pytest.approx([-0.6, 0.0], abs=1e-7)


@pytest.mark.parametrize(
    "counts", [torch.tensor([1, -1]), torch.tensor([1.0, float("nan")]), torch.tensor([1, 2, 3]), [1, 2]]
)
def test_token_measure_rejects_bad_counts(counts):
    with pytest.raises(ValueError, match="token_counts"):
        token_measure_normalize(torch.tensor([0.1, 0.2]), counts)
