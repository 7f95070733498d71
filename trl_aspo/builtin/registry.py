"""The built-in names the `trl-aspo` commands accept for datasets, reward functions and tools, with the dotted
paths they stand for (the task generators, rewards and tools of `trl_aspo.builtin`)."""

BUILTIN_DATASET = "builtin:calculator"
MULTICALL_DATASET = "builtin:multicall"
# The calculator problems with a system message, for pretrained chat models (builtin:smollm2-135m-instruct).
CHAT_DATASET = "builtin:calculator-chat"
# Each built-in task: its problem generator and the built-in tool that solves it.
BUILTIN_DATASETS = {
    BUILTIN_DATASET: ("trl_aspo.builtin.task.make_dataset", "builtin:calculator"),
    MULTICALL_DATASET: ("trl_aspo.builtin.multicall.make_dataset", "builtin:one-op-calculator"),
    CHAT_DATASET: ("trl_aspo.builtin.task.make_chat_dataset", "builtin:calculator"),
}
BUILTIN_REWARDS = {"builtin:correctness": "trl_aspo.builtin.task.correctness_reward"}
BUILTIN_TOOLS = {
    "builtin:calculator": "trl_aspo.builtin.task.calculator",
    # One operation per call (and named `calculator` too, see trl_aspo.builtin.multicall): for builtin:multicall.
    "builtin:one-op-calculator": "trl_aspo.builtin.multicall.calculator",
}
