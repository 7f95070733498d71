"""One synchronous training run generating with vLLM, as a script: `python sync_run.py SPEC.json RESULT.json`.

Colocate mode builds a vLLM engine inside the training process, and one process holds one engine, so each colocate
run of the tier is a fresh process. SPEC: `trainer` ("grpo" | "aspo"), `config` (ASPOConfig/GRPOConfig fields),
`reward` ("digit_share" | "correctness"), `tools` (bool). RESULT: the log history, the trained parameters (as a
safetensors file beside it) and the gap between vLLM's and the policy's log-probs of a fixed completion after a final
weight sync."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(spec: dict, result_path: Path) -> None:
    import torch
    from helpers import digit_share_reward
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from vllm_common import fixed_prompt_ids, policy_logprobs

    from trl_aspo import ASPOConfig, ASPOTrainer
    from trl_aspo.builtin import CHECKPOINT_DIR, load_tokenizer
    from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset
    from trl_aspo.infra.vllm_cpu import cpu_weight_sync

    tokenizer = load_tokenizer(CHECKPOINT_DIR)
    model = AutoModelForCausalLM.from_pretrained(str(CHECKPOINT_DIR), dtype=torch.float32)
    reward = {"digit_share": digit_share_reward, "correctness": correctness_reward}[spec["reward"]]
    common = dict(
        model=model,
        reward_funcs=[reward],
        train_dataset=make_dataset("train", 32, seed=0),
        processing_class=tokenizer,
        tools=[calculator] if spec["tools"] else None,
    )
    if spec["trainer"] == "grpo":
        # TRL's own trainer, with the CPU weight sync that TRL's NCCL path cannot do on this machine.
        with cpu_weight_sync(True):
            trainer = GRPOTrainer(args=GRPOConfig(**spec["config"]), **common)
    else:
        trainer = ASPOTrainer(args=ASPOConfig(**spec["config"]), **common)
    trainer.train()

    generation = trainer.vllm_generation
    generation.sync_weights()
    prompt = fixed_prompt_ids(tokenizer)
    if generation.mode == "colocate":
        from vllm import SamplingParams

        output = generation.llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, seed=1)
        )[0].outputs[0]
        completion = list(output.token_ids)
        engine = torch.tensor([next(iter(position.values())).logprob for position in output.logprobs])
    else:
        from vllm_common import server_completion, server_logprobs

        completion = server_completion(generation.vllm_client.base_url, prompt)
        engine = server_logprobs(generation.vllm_client.base_url, prompt, completion)
    gap = (policy_logprobs(trainer.model, prompt, completion) - engine).abs().max().item()
    save_file(
        {name: param.detach().contiguous() for name, param in trainer.model.named_parameters()},
        str(result_path.with_suffix(".safetensors")),
    )
    result = {"log_history": trainer.state.log_history, "logprob_gap": gap, "completion_length": len(completion)}
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
