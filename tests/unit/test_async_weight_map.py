"""Issue 19 item 1, second half: AsyncASPOConfig takes `log_weight_map` with the loss types it can weigh and refuses
the others (the runs: tests/integration/test_async_weight_map_trainer.py)."""

from __future__ import annotations

import pytest
from helpers import async_weight_map_config


@pytest.mark.parametrize("loss_type", ["ppo", "aspo"])
def test_the_config_takes_the_map_with_each_loss_type(tmp_path, loss_type):
    assert async_weight_map_config(tmp_path, loss_type).log_weight_map


def test_a_loss_type_the_map_cannot_weigh_is_refused(tmp_path):
    from trl_aspo import ASPOConfig

    with pytest.raises(ValueError, match=r"ASPOConfig\.log_weight_map=True is invalid: .*needs loss_type in"):
        ASPOConfig(output_dir=str(tmp_path), loss_type="cispo", num_iterations=2, log_weight_map=True, use_cpu=True)
    with pytest.raises(ValueError, match=r"AsyncASPOConfig\.loss_type='dapo' is invalid: must be one of"):
        async_weight_map_config(tmp_path, "dapo")
