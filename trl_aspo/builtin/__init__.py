"""Built-in tiny model, tokenizer and arithmetic task: see RL improve tool use on a CPU, offline."""

from trl_aspo.builtin.model import (
    CHECKPOINT_DIR,
    MULTICALL_CHECKPOINT_DIR,
    SHIPPED_CHECKPOINTS,
    SMOLLM2,
    TINY_CALCULATOR,
    TINY_MULTICALL,
    TINY_RANDOM,
    build_model_config,
    build_random_model,
    is_builtin,
    load_builtin,
)
from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset
from trl_aspo.builtin.tokenizer import build_tokenizer, is_builtin_tokenizer_dir, load_tokenizer

__all__ = [
    "CHECKPOINT_DIR",
    "MULTICALL_CHECKPOINT_DIR",
    "SHIPPED_CHECKPOINTS",
    "SMOLLM2",
    "TINY_CALCULATOR",
    "TINY_MULTICALL",
    "TINY_RANDOM",
    "build_model_config",
    "build_random_model",
    "build_tokenizer",
    "calculator",
    "correctness_reward",
    "is_builtin",
    "is_builtin_tokenizer_dir",
    "load_builtin",
    "load_tokenizer",
    "make_dataset",
]
