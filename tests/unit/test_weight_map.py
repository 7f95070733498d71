"""Issue 19 item 1: the ASPO weight map (trl_aspo.algorithms.weight_map): binned sums of each token's gradient weight
by (old, current) probability, the weight of TRL's clipped ratio and of the aspo loss, the map's log and checkpoint,
and `trl-aspo plot --weights`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_aspo.algorithms.losses import asymmetric_policy_loss
from trl_aspo.algorithms.weight_map import (
    WEIGHT_MAP_FILE,
    WeightMapLog,
    aspo_weight,
    clipped_ratio_weight,
    weight_map_sums,
)
from trl_aspo.trainers.weight_map_mixin import WeightMapMixin


def _close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype))


def _logps(probabilities: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probabilities, dtype=torch.float64).log()


def test_bins_and_sums_by_hand():
    # Row 0 (A = +1): (old 0.95, cur 0.85) -> cell (9, 8), w 2.0; (0.05, 0.15) -> (0, 1), w 0.5; the third is padding.
    # Row 1 (A = -1): (0.55, 0.55) and (0.55, 0.58) -> (5, 5), w 1.0 and 3.0 (mean 2.0); (1.0, 1.0) -> (9, 9), w 0.7
    # (probability 1 falls in the last bin). Row 2 (A = 0) is left out.
    old = _logps([[0.95, 0.05, 0.5], [0.55, 0.55, 1.0], [0.3, 0.3, 0.3]])
    current = _logps([[0.85, 0.15, 0.5], [0.55, 0.58, 1.0], [0.3, 0.3, 0.3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    weight = torch.tensor([[2.0, 0.5, 9.0], [1.0, 3.0, 0.7], [5.0, 5.0, 5.0]])
    sums = weight_map_sums(old, current, torch.tensor([1.0, -1.0, 0.0]), mask, weight)
    assert sums.shape == (2, 2, 10, 10)
    positive_sum, positive_count = sums[0]
    negative_sum, negative_count = sums[1]
    assert positive_count.sum() == 2 and negative_count.sum() == 3
    assert positive_count[9, 8] == 1 and positive_sum[9, 8] == 2.0
    assert positive_count[0, 1] == 1 and positive_sum[0, 1] == 0.5
    assert negative_count[5, 5] == 2 and negative_sum[5, 5] / negative_count[5, 5] == 2.0
    assert negative_count[9, 9] == 1 and negative_sum[9, 9] == pytest.approx(0.7)
    assert positive_sum.sum() == 2.5 and negative_sum.sum() == pytest.approx(4.7)


def test_per_token_advantages_pick_the_sign_per_token():
    old = _logps([[0.25, 0.25]])
    current = _logps([[0.75, 0.75]])
    sums = weight_map_sums(old, current, torch.tensor([[0.5, -0.5]]), torch.ones(1, 2), torch.tensor([[3.0, 1.0]]))
    assert sums[0, 0, 2, 7] == 3.0 and sums[1, 0, 2, 7] == 1.0
    assert sums[:, 1].sum() == 2


def test_bad_shapes_name_the_input():
    logps = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="`mask` must have the shape of `per_token_logps`"):
        weight_map_sums(logps, logps, torch.ones(2), torch.ones(2, 2), logps)


RATIOS = [0.5, 0.9, 1.1, 1.3]


def _trl_clipped_weight(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float, delta=None):
    """w by autograd of GRPOTrainer's per-token term -min(c1 A, c2 A): d loss / d lp = -A w."""
    lp = ratio.log().clone().requires_grad_(True)
    coef_1 = torch.exp(lp)
    coef_2 = torch.clamp(coef_1, 1 - low, 1 + high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    return grad / -advantages


def test_clipped_ratio_weight_by_hand_and_against_trls_term():
    ratio = torch.tensor([RATIOS, RATIOS], dtype=torch.float64)
    advantages = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    weight = clipped_ratio_weight(ratio.log(), torch.zeros_like(ratio), advantages.squeeze(1), 0.2, 0.28)
    # A > 0: r above 1 + 0.28 is clipped (1.3); A < 0: r below 1 - 0.2 is clipped (0.5).
    _close(weight, [[0.5, 0.9, 1.1, 0.0], [0.0, 0.9, 1.1, 1.3]])
    _close(weight, _trl_clipped_weight(ratio, advantages, 0.2, 0.28))
    with_delta = clipped_ratio_weight(ratio.log(), torch.zeros_like(ratio), advantages, 0.2, 0.28, delta=1.2)
    _close(with_delta, [[0.5, 0.9, 1.1, 0.0], [0.0, 0.9, 1.1, 0.0]])
    _close(with_delta, _trl_clipped_weight(ratio, advantages, 0.2, 0.28, 1.2))
    # delta below 1 + eps_high (TRL allows it): A > 0 stops at delta; A < 0 between delta and 1 + eps_high follows the
    # clipped term c2 = r again.
    ratio = torch.tensor([[0.5, 0.9, 1.05, 1.2, 1.3]] * 2, dtype=torch.float64)
    low_delta = clipped_ratio_weight(ratio.log(), torch.zeros_like(ratio), advantages, 0.2, 0.28, delta=1.1)
    _close(low_delta, [[0.5, 0.9, 1.05, 0.0, 0.0], [0.0, 0.9, 1.05, 1.2, 0.0]])
    _close(low_delta, _trl_clipped_weight(ratio, advantages, 0.2, 0.28, 1.1))


def test_aspo_weight_by_hand_and_against_the_losss_gradient():
    # A > 0 (flipped, C = 3): r 0.2 < 1/3 -> C; 0.5 -> 1/r = 2; 1 -> 1; 1.5 > 1.28 -> 0.
    # A < 0: r 0.5 < 0.8 -> 0; 1 -> 1; 2 -> 2; 4 > C -> C.
    ratio = torch.tensor([[0.2, 0.5, 1.0, 1.5], [0.5, 1.0, 2.0, 4.0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    lp = ratio.log().clone().requires_grad_(True)
    loss, stats = asymmetric_policy_loss(lp, torch.zeros_like(ratio), advantages, 0.2, 0.28, dual_clip=3.0)
    weight = aspo_weight(stats, advantages, dual_clip_neg=3.0)
    _close(weight, [[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    _close(weight, (grad / -advantages.unsqueeze(1)))


def test_aspo_weight_of_unflipped_positive_tokens_is_the_standard_ratio():
    ratio = torch.tensor([[0.5, 1.1, 1.5]], dtype=torch.float64)
    advantages = torch.tensor([0.5], dtype=torch.float64)
    lp = ratio.log().clone().requires_grad_(True)
    # flip_threshold 1.0 > A: the token keeps TRL's clipped surrogate (w = r below 1 + eps_high, 0 above).
    loss, stats = asymmetric_policy_loss(lp, torch.zeros_like(ratio), advantages, 0.2, 0.28, flip_threshold=1.0)
    weight = aspo_weight(stats, advantages, dual_clip_neg=3.0)
    _close(weight, [[0.5, 1.1, 0.0]])
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    _close(weight, (grad / -advantages))


def _window(count: float) -> torch.Tensor:
    sums = torch.zeros(2, 2, 10, 10, dtype=torch.float64)
    sums[0, 0, 1, 2], sums[0, 1, 1, 2] = 2.0 * count, count
    return sums


def test_log_keeps_the_total_and_merges_windows_pairwise(tmp_path):
    log = WeightMapLog("aspo", max_windows=2)
    log.add_window(1, 1, _window(1.0))
    log.add_window(2, 2, torch.zeros(2, 2, 10, 10))  # no tokens: skipped
    log.add_window(3, 4, _window(2.0))
    log.add_window(5, 5, _window(3.0))
    assert [(first, last) for first, last, _ in log.windows] == [(1, 4), (5, 5)]
    assert log.windows[0][2][0, 1, 1, 2] == 3.0
    assert log.total[0, 1].sum() == 6.0 and log.total[0, 0, 1, 2] == 12.0
    state = json.loads(Path(log.write(str(tmp_path))).read_text())
    assert state["loss_type"] == "aspo" and state["total"]["positive"]["count"][1][2] == 6.0
    restored = WeightMapLog("aspo")
    restored.load_state_dict(state)
    assert torch.equal(restored.total, log.total) and len(restored.windows) == 2


def test_plot_weights_draws_the_runs_side_by_side(tmp_path, capsys):
    from trl_aspo.cli.plot_command import WEIGHT_MAP_FILE as PLOT_FILE
    from trl_aspo.cli.plot_command import plot_main

    assert PLOT_FILE == WEIGHT_MAP_FILE
    for loss_type in ("dapo", "aspo"):
        log = WeightMapLog(loss_type)
        sums = _window(4.0)
        sums[1, 0, 7, 3], sums[1, 1, 7, 3] = 1.0, 2.0
        log.add_window(1, 2, sums)
        log.write(str(tmp_path / loss_type))
    output = tmp_path / "map.png"
    assert plot_main([str(tmp_path / "dapo"), str(tmp_path / "aspo"), "--weights", "--output", str(output)]) == 0
    assert output.stat().st_size > 10_000
    assert "Figure written to" in capsys.readouterr().out


def test_plot_weights_names_a_run_without_a_map(tmp_path, capsys):
    from trl_aspo.cli.plot_command import plot_main

    with pytest.raises(SystemExit):
        plot_main([str(tmp_path), "--weights"])
    assert f"no {WEIGHT_MAP_FILE} in the folder" in capsys.readouterr().err


def test_plot_weights_refuses_a_map_without_tokens(tmp_path, capsys):
    from trl_aspo.cli.plot_command import plot_main

    WeightMapLog("dapo").write(str(tmp_path))  # what an on-policy run writes: no window was added
    with pytest.raises(SystemExit):
        plot_main([str(tmp_path), "--weights"])
    assert "the map holds no tokens (no off-policy pass was logged" in capsys.readouterr().err


class _MapHost(WeightMapMixin):
    """The Trainer attributes WeightMapMixin reads, on one process."""

    def __init__(self, output_dir):
        self.args = SimpleNamespace(
            loss_type="dapo", log_weight_map=True, should_save=True, output_dir=str(output_dir)
        )
        self.state = SimpleNamespace(global_step=0)
        self.accelerator = SimpleNamespace(device=torch.device("cpu"), reduce=lambda tensor, reduction: tensor)
        self._start_weight_map()

    def train_step(self, tokens: int) -> None:
        """One optimizer step of `tokens` positive-advantage tokens in cell (2, 7), weight 1 each."""
        logps = torch.full((1, tokens), 0.25).log()
        self._add_weight_map(logps, logps + math.log(3), torch.ones(1), torch.ones(1, tokens), torch.ones(1, tokens))
        self.state.global_step += 1


def test_a_checkpoint_between_two_logs_keeps_the_steps_since_the_last_log(tmp_path):
    """Logging every 2 steps, saving at step 1: the checkpoint holds step 1's tokens, and the run resumed from it
    ends with the uninterrupted run's total."""
    uninterrupted = _MapHost(tmp_path / "uninterrupted")
    uninterrupted.train_step(3)
    uninterrupted._save_weight_map(str(tmp_path / "checkpoint-1"))
    saved = json.loads((tmp_path / "checkpoint-1" / WEIGHT_MAP_FILE).read_text())
    assert saved["total"]["positive"]["count"][2][7] == 3
    uninterrupted.train_step(2)
    uninterrupted._log_weight_map()

    resumed = _MapHost(tmp_path / "resumed")
    resumed.state.global_step = 1
    resumed._restore_weight_map(str(tmp_path / "checkpoint-1"))
    resumed.train_step(2)
    resumed._log_weight_map()
    for host in (uninterrupted, resumed):
        assert host._weight_map.total[0, 1, 2, 7] == 5
        assert [(first, last) for first, last, _ in host._weight_map.windows] == [(1, 1), (2, 2)]
