"""`sample_rows_like`, the draw of the converted SmolLM2's four added rows (trl_aspo.builtin.smollm2)."""

from __future__ import annotations

import numpy as np
import torch

from trl_aspo.builtin.smollm2 import sample_rows_like


def _rows(count: int) -> torch.Tensor:
    """`count` rows of a 3-d normal: mean (1, -2, 0.5), covariance [[4, 1.2, 0], [1.2, 1, -0.3], [0, -0.3, 0.25]]."""
    mean = np.array([1.0, -2.0, 0.5])
    covariance = np.array([[4.0, 1.2, 0.0], [1.2, 1.0, -0.3], [0.0, -0.3, 0.25]])
    return torch.from_numpy(np.random.default_rng(7).multivariate_normal(mean, covariance, size=count))


def test_draws_have_the_rows_mean_and_covariance():
    rows = _rows(4000)
    draws = sample_rows_like(rows, 40000, seed=0).numpy()
    reference = rows.numpy()
    np.testing.assert_allclose(draws.mean(axis=0), reference.mean(axis=0), atol=0.03)
    np.testing.assert_allclose(np.cov(draws, rowvar=False), np.cov(reference, rowvar=False, bias=True), atol=0.06)


def test_a_seed_gives_the_same_rows_and_another_seed_other_rows_each_unlike_the_mean():
    rows = _rows(500)
    first = sample_rows_like(rows, 4, seed=0)
    assert torch.equal(first, sample_rows_like(rows, 4, seed=0))
    assert not torch.allclose(first, sample_rows_like(rows, 4, seed=1))
    # Four distinct rows, none the mean (the mean alone gives every added token the same row).
    assert torch.cdist(first, first).fill_diagonal_(float("inf")).min() > 0.1
    assert torch.cdist(first, rows.mean(dim=0, keepdim=True)).min() > 0.1


def test_the_draw_keeps_the_rows_dtype():
    rows = _rows(100).float()
    assert sample_rows_like(rows, 2, seed=0).dtype == torch.float32
