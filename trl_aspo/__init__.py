"""trl-aspo: asymmetric IS loss, tool-position shaping and single-stream value tracking for TRL's GRPOTrainer.

Layers, each a package whose imports point down only (checked by tests/unit/test_layers.py):

    cli/          the `trl-aspo` commands: train, evaluate, values, compare, plot
    trainers/     ASPOTrainer, AsyncASPOTrainer and what both share (the scoring pipeline, the loss assembly,
                  the pre-pass accounting, checkpoint state)
    evaluation/   tool-use evaluation, rewards, the code sandbox
    infra/        the asynchronous trainer's CPU worker, the prompt stream, the CPU vLLM weight sync
    builtin/      the built-in tasks, tools, tiny models and tokenizer
    config/       ASPOConfig, AsyncASPOConfig and the field declarations they share
    values/       value trackers, prompt ids, the prioritized sampler, value initialization
    algorithms/   pure tensor functions: losses, KL, shaping, normalization, filters, tool metrics, weight map
"""

import warnings

__version__ = "0.1.0"
__all__ = ["ASPOConfig", "ASPOTrainer", "AsyncASPOConfig", "AsyncASPOTrainer", "GracefulStop", "__version__"]

# Imported on first use: they load torch and TRL (the async ones TRL's experimental package), which the `trl-aspo`
# command's help and configuration checks never need.
_LAZY = {
    "ASPOConfig": "trl_aspo.config.aspo_config",
    "ASPOTrainer": "trl_aspo.trainers.aspo_trainer",
    "AsyncASPOConfig": "trl_aspo.config.async_config",
    "AsyncASPOTrainer": "trl_aspo.trainers.async_aspo_trainer",
    "GracefulStop": "trl_aspo.trainers.graceful_stop",
}

# TRL 1.16 calls transformers' renamed gradient-checkpointing API (`gradient_checkpointing` ->
# `activation_checkpointing`) whenever a config or trainer is built: three FutureWarnings a user cannot act on.
warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.*deprecated", category=FutureWarning)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
