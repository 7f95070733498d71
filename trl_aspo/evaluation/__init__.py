"""Evaluation and rewards: the tool-use evaluation (`evaluate_tool_use`), the before/after report, and the code
reward `code_unit_test_reward` with its subprocess sandbox. Public path: `from trl_aspo.evaluation import ...`."""

from trl_aspo.evaluation.rewards import code_unit_test_reward, run_unit_tests, sandbox_isolates_network, summed_rewards
from trl_aspo.evaluation.tool_use import evaluate_tool_use, tool_suffix_ids

__all__ = [
    "code_unit_test_reward",
    "evaluate_tool_use",
    "run_unit_tests",
    "sandbox_isolates_network",
    "summed_rewards",
    "tool_suffix_ids",
]
