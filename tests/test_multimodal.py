"""A multimodal processor (here a tiny `LlavaProcessor` built locally) is accepted wherever `GRPOTrainer` accepts it,
and the KL-adaptive rho passes forward the multimodal inputs of their round."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CLIPImageProcessor, LlavaProcessor

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import build_random_model
from trl_aspo.builtin.task import make_dataset


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def llava_processor(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=4, chat_template=tokenizer.chat_template
    )


def _trainer(processor, tmp_path, **overrides) -> ASPOTrainer:
    model = build_random_model(processor.tokenizer, seed=0)
    model.config.image_token_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    fields = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    fields.update(overrides)
    return ASPOTrainer(
        model=model,
        reward_funcs=[_zero_reward],
        args=ASPOConfig(**fields),
        train_dataset=make_dataset("train", 8, seed=0),
        processing_class=processor,
    )


def test_construction_with_a_processor_and_every_feature_off(llava_processor, tmp_path):
    trainer = _trainer(llava_processor, tmp_path)
    assert trainer.processing_class is llava_processor
    assert trainer._call_token_ids == llava_processor.tokenizer.encode("<tool_call>", add_special_tokens=False)


def test_kl_adaptive_rho_passes_forward_the_multimodal_inputs(llava_processor, tmp_path):
    trainer = _trainer(llava_processor, tmp_path, advantage_estimator="spo", num_generations=1, value_rho_mode="kl")
    pixel_values = torch.randn(2, 3, 16, 16)
    image_sizes = torch.tensor([[16, 16], [16, 16]])
    output = {
        "prompt_ids": torch.tensor([[1, 2], [3, 4]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]),
        "completion_mask": torch.ones(2, 3, dtype=torch.long),
        "pixel_values": pixel_values,
        "image_sizes": image_sizes,
    }
    calls = []

    def recording_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        calls.append(kwargs)
        return torch.zeros(len(input_ids), logits_to_keep), None, None

    trainer._get_per_token_logps_and_entropies = recording_logps
    pending = trainer._snapshot_for_kl_rho(output, ["a", "b"], torch.tensor([0.0, 1.0]), torch.tensor([True, True]))
    rho = trainer._pending_visit_rho(pending)
    assert len(calls) == 2  # the log-probs at dispatch, then after the update
    for kwargs in calls:
        assert kwargs["pixel_values"] is pixel_values and kwargs["image_sizes"] is image_sizes
    assert rho.tolist() == [0.96, 0.96]  # no change in log-probs: rho_max
