"""The code reward of the archer2_code recipe, and that the GPU recipes parse."""

from __future__ import annotations

import pytest

from trl_aspo.rewards import code_unit_test_reward
from trl_aspo.train import make_parser


def test_code_unit_test_reward():
    good = [{"role": "assistant", "content": "Sure:\n```python\ndef add(a, b):\n    return a + b\n```"}]
    wrong = [{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a - b\n```"}]
    hang = [{"role": "assistant", "content": "```python\nwhile True:\n    pass\n```"}]
    no_code = [{"role": "assistant", "content": "add is a+b"}]
    tests = [["assert add(2, 3) == 5"]] * 4
    assert code_unit_test_reward([good, wrong, hang, no_code], tests, timeout=2.0) == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("path", ["configs/archer2_math.yaml", "configs/archer2_code.yaml"])
def test_reference_recipes_parse(path, monkeypatch):
    # bf16 and vLLM are GPU settings: override them so the configuration validates on a CPU machine.
    script, training, model, _ = make_parser().parse_args_and_config(
        args=["--config", path, "--bf16", "false", "--use_cpu", "true", "--use_vllm", "false"]
    )
    assert training.loss_type == "aspo" and training.num_generations == 16 and training.num_iterations == 2
    assert training.aspo_entropy_quantile == 0.8 and training.aspo_dual_clip == 3.0 and training.beta == 0.001
    assert model.model_name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"


def test_code_unit_test_reward_discards_program_output():
    import resource

    # 256 MiB on stdout and stderr each: read into memory, they would raise this process's peak by at least that.
    flood = "\n".join(
        [
            "import sys",
            "chunk = 'x' * 2**20",
            "for _ in range(256):",
            "    sys.stdout.write(chunk)",
            "    sys.stderr.write(chunk)",
        ]
    )
    completion = [{"role": "assistant", "content": f"```python\n{flood}\n```"}]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert code_unit_test_reward([completion], [["assert True"]], timeout=60.0) == [1.0]
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64
