"""The trainer side of `log_weight_map` (trl_aspo.algorithms.weight_map), the same in both trainers."""

from __future__ import annotations

import json
import os

import torch

from trl_aspo.algorithms.policy_losses import PolicyLoss
from trl_aspo.algorithms.weight_map import WEIGHT_MAP_FILE, WeightMapLog, clipped_ratio_weight, weight_map_sums


class WeightMapMixin:
    """Trainer side of `log_weight_map`, shared by ASPOTrainer and AsyncASPOTrainer: each rank adds its micro-batches'
    `weight_map_sums` to the logging window (on device), `log` closes the window (summed over ranks: every rank
    logs), and the main process writes `weight_map.json` in the output directory and every checkpoint, from which a
    resumed run continues the map. Needs the Trainer's `args`, `state` and `accelerator` and the loss's `epsilon_low`
    and `epsilon_high`."""

    _weight_map: WeightMapLog | None = None

    def _start_weight_map(self) -> None:
        """The run's map (None without `log_weight_map`), this window's sums and the window's first optimizer step."""
        self._weight_map = WeightMapLog(self.args.loss_type) if self.args.log_weight_map else None
        self._weight_map_window: torch.Tensor | None = None
        self._weight_map_first_step = 1

    def _add_weight_map(self, old_per_token_logps, per_token_logps, advantages, mask, weight) -> None:
        """Add one micro-batch's action tokens (`weight_map_sums` of the same arguments) to the logging window."""
        sums = weight_map_sums(old_per_token_logps, per_token_logps, advantages, mask, weight)
        self._weight_map_window = sums if self._weight_map_window is None else self._weight_map_window + sums

    def _add_clipped_ratio_weight_map(
        self, old_per_token_logps, per_token_logps, advantages, mask, delta: float | None = None
    ) -> None:
        """`_add_weight_map` with the weight of TRL's clipped surrogate (`clipped_ratio_weight`, the trainer's
        `epsilon_low`/`epsilon_high`)."""
        weight = clipped_ratio_weight(
            per_token_logps, old_per_token_logps, advantages, self.epsilon_low, self.epsilon_high, delta
        )
        self._add_weight_map(old_per_token_logps, per_token_logps, advantages, mask, weight)

    def _add_registered_weight_map(
        self, policy_loss: PolicyLoss, old_per_token_logps, per_token_logps, advantages, mask, stats
    ) -> None:
        """`_add_weight_map` with the weight a registered loss gives from its `stats` (`PolicyLoss.weight`)."""
        weight = policy_loss.weight(stats, advantages, self.args)
        self._add_weight_map(old_per_token_logps, per_token_logps, advantages, mask, weight)

    def _log_weight_map(self) -> None:
        """Close the logging window: its sums, summed over ranks (every rank logs), join the map, and the main
        process rewrites `weight_map.json` in the output directory."""
        window = self._weight_map_window
        bins = self._weight_map.bins
        if window is None:
            window = torch.zeros(2, 2, bins, bins, dtype=torch.float64, device=self.accelerator.device)
        window = self.accelerator.reduce(window, reduction="sum")
        self._weight_map.add_window(self._weight_map_first_step, self.state.global_step, window)
        self._weight_map_window = None
        self._weight_map_first_step = self.state.global_step + 1
        if self.args.should_save:
            self._weight_map.write(self.args.output_dir)

    def _save_weight_map(self, checkpoint: str) -> None:
        """Write the map into a checkpoint being saved (collective: every rank calls it; the main process writes).
        The open logging window is closed at the checkpoint's step first, so the checkpoint holds every token
        trained up to it: a run resumed from it starts at the next step, and a checkpoint between two logs would
        otherwise lose the steps since the last log."""
        if self._weight_map is None:
            return
        self._log_weight_map()
        if self.args.should_save:
            self._weight_map.write(checkpoint)

    def _restore_weight_map(self, checkpoint: str) -> None:
        """Continue the map of the checkpoint a run resumes from (a checkpoint without one leaves the map empty)."""
        path = os.path.join(checkpoint, WEIGHT_MAP_FILE)
        if self._weight_map is None or not os.path.isfile(path):
            return
        with open(path) as handle:
            self._weight_map.load_state_dict(json.load(handle))
        self._weight_map_first_step = self.state.global_step + 1
