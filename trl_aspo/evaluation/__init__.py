"""Evaluation and rewards: the tool-use evaluation (`evaluate_tool_use`), the before/after report, and the code
reward `code_unit_test_reward` with its subprocess sandbox. Public path: `from trl_aspo.evaluation import ...`."""

from trl_aspo.evaluation.rewards import code_unit_test_reward, run_unit_tests, sandbox_isolates_network, summed_rewards

__all__ = [
    "code_unit_test_reward",
    "evaluate_tool_use",
    "run_unit_tests",
    "sandbox_isolates_network",
    "summed_rewards",
    "tool_suffix_ids",
]

# Imported on first use: they load torch, which the code reward (a reward server, a grading script) never needs.
_LAZY = {"evaluate_tool_use": "trl_aspo.evaluation.tool_use", "tool_suffix_ids": "trl_aspo.evaluation.tool_use"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
