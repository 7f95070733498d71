"""The decoupled objective's fields of AsyncASPOConfig (issue 30): bad values refused by name before TRL's config
runs, and the processed-log-probs rule the trainer applies once it knows its rollout worker."""

from __future__ import annotations

import pytest

from trl_aspo.config.async_config import AsyncASPOConfig, check_sampling_logprobs

BASE = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
ON = {"vllm_importance_sampling_correction": True}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {**ON, "vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.5},
            r"vllm_importance_sampling_clip_max=1\.5 is invalid: must be >= vllm_importance_sampling_clip_min=2\.0",
        ),
        (
            {**ON, "vllm_importance_sampling_clip_min": -0.5},
            r"vllm_importance_sampling_clip_min=-0\.5 is invalid: must lie in \[0, 1e\+06\]",
        ),
        (
            {**ON, "vllm_importance_sampling_clip_max": -1.0},
            r"vllm_importance_sampling_clip_max=-1\.0 is invalid: must lie in \(0, 1e\+06\]",
        ),
        (
            {**ON, "vllm_importance_sampling_clip_max": None},
            r"vllm_importance_sampling_clip_max=None is invalid: a bound is needed",
        ),
        (
            {**ON, "vllm_importance_sampling_mode": "token_cap"},
            r"vllm_importance_sampling_mode='token_cap' is invalid: must be one of \('token_truncate', 'token_mask', "
            r"'sequence_truncate', 'sequence_mask'\)",
        ),
        # A mode or a bound without the switch does nothing: refused, naming the switch.
        (
            {"vllm_importance_sampling_mode": "token_mask"},
            r"vllm_importance_sampling_mode='token_mask' is invalid: it shapes the rollout correction, which is off, "
            r"so it needs vllm_importance_sampling_correction=True",
        ),
        (
            {"vllm_importance_sampling_clip_max": 2.0},
            r"vllm_importance_sampling_clip_max=2\.0 is invalid: .* needs vllm_importance_sampling_correction=True",
        ),
        # Types, from Python as from YAML (the fields declared on AsyncASPOConfig itself were not type-checked: a
        # string switch was taken as on, a string bound ended in a raw TypeError).
        (
            {"vllm_importance_sampling_correction": "yes"},
            r"vllm_importance_sampling_correction='yes' is invalid: must be true or false",
        ),
        (
            {**ON, "vllm_importance_sampling_clip_max": "3"},
            r"vllm_importance_sampling_clip_max='3' is invalid: must be a finite number or None",
        ),
        (
            {**ON, "vllm_importance_sampling_clip_min": True},
            r"vllm_importance_sampling_clip_min=True is invalid: must be a finite number or None",
        ),
        (
            {"allow_processed_sampling_logprobs": 1},
            r"allow_processed_sampling_logprobs=1 is invalid: must be true or false",
        ),
    ],
)
def test_bad_values_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=r"AsyncASPOConfig\." + message):
        AsyncASPOConfig(**BASE, **overrides)


def test_the_defaults_are_trls_asynchronous_trainer():
    config = AsyncASPOConfig(**BASE)
    assert config.vllm_importance_sampling_correction is False
    assert config.loss_type == "ppo"
    # GRPOConfig's defaults for the mode and the bounds, for the synchronous trainer's field names.
    assert (config.vllm_importance_sampling_mode, config.vllm_importance_sampling_clip_max) == ("sequence_mask", 3.0)
    assert config.vllm_importance_sampling_clip_min is None


@pytest.mark.parametrize(
    ("overrides", "processed", "refused"),
    [
        (
            {**ON, "top_p": 0.9},
            True,
            r"AsyncASPOConfig\.top_p=0\.9 is invalid: .*top_p=0\.9, top_k=0 .*rollout correction",
        ),
        ({"loss_type": "aspo", "top_k": 20}, True, r"AsyncASPOConfig\.top_k=20 is invalid: .*loss_type='aspo'"),
        # A worker reporting full-softmax log-probs, TRL's own PPO loss without correction, full-softmax sampling, or
        # the mismatch accepted on purpose: no refusal.
        ({**ON, "top_p": 0.9}, False, None),
        ({"top_p": 0.9}, True, None),
        ({**ON, "loss_type": "aspo"}, True, None),
        ({**ON, "top_k": 20, "allow_processed_sampling_logprobs": True}, True, None),
    ],
)
def test_processed_log_probs_with_a_ratio_reading_loss_are_refused(overrides, processed, refused):
    config = AsyncASPOConfig(**BASE, **overrides)
    if refused is None:
        check_sampling_logprobs(config, processed)
    else:
        with pytest.raises(ValueError, match=refused):
            check_sampling_logprobs(config, processed)
