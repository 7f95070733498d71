"""What `ASPOTrainer` does to the arguments it is given before GRPOTrainer sees them."""

from __future__ import annotations

import copy
import dataclasses

from trl import GRPOConfig

from trl_aspo.config.aspo_config import ASPOConfig


def as_aspo_config(args: GRPOConfig) -> GRPOConfig:
    """Give a plain `GRPOConfig` the ASPOConfig fields at their defaults (every new feature off)."""
    for config_field in dataclasses.fields(ASPOConfig):
        if not hasattr(args, config_field.name):
            setattr(args, config_field.name, config_field.default)
    if args.advantage_normalization is None:
        args.advantage_normalization = "group"
    return args


def with_overlong_penalty(reward_funcs, args: GRPOConfig):
    """Append TRL's soft overlong punishment (DAPO) as a reward function weighted by `overlong_penalty_factor`.

    Works on a copy of `args`, so a config reused for a second trainer does not collect a second penalty weight."""
    from trl.rewards import get_soft_overlong_punishment

    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    penalty = get_soft_overlong_punishment(args.max_completion_length, args.overlong_buffer_length)
    args = copy.copy(args)
    weights = [1.0] * len(funcs) if args.reward_weights is None else list(args.reward_weights)
    args.reward_weights = [*weights, args.overlong_penalty_factor]
    return [*funcs, penalty], args
