"""A multimodal processor (here a tiny `LlavaProcessor` built locally) is accepted wherever `GRPOTrainer` accepts it,
and the KL-adaptive rho's drift pass forwards each stored visit's own multimodal inputs (issue 10 item 11)."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from helpers import tiny_run_fields
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import build_model_config, build_random_model
from trl_aspo.builtin.task import make_dataset
from trl_aspo.trainers.checkpoint_state import load_checkpoint_state

# The builtin tokenizer's Qwen2.5 template renders string contents only; this one also renders typed image parts.
_IMAGE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<image>{% else %}{{ c.text }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def llava_processor(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    # 16 x 16 images in 4 x 4 patches: 16 <image> tokens per image, as many features as the tiny model's CLIP yields.
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=4, chat_template=_IMAGE_CHAT_TEMPLATE
    )


def _tiny_llava(processor, seed=0):
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=build_model_config(processor.tokenizer),
        image_token_index=processor.tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config)


def _trainer(processor, tmp_path, **overrides) -> ASPOTrainer:
    model = build_random_model(processor.tokenizer, seed=0)
    model.config.image_token_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    defaults = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1)
    fields = tiny_run_fields(tmp_path, **{**defaults, **overrides})
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
    assert trainer._tool_calls.call_token_ids == llava_processor.tokenizer.encode(
        "<tool_call>", add_special_tokens=False
    )


def _llava_round(prompt_ids, prompt_mask, completion_ids, images_per_row, seed):
    """A round as GRPOTrainer hands it over for a LLaVA model: `pixel_values` and `image_sizes` one row per image, in
    row order, `num_images` per row. Each image is distinct, so a slice tells whose image it is."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(images_per_row)
    output = {
        "prompt_ids": torch.tensor(prompt_ids),
        "prompt_mask": torch.tensor(prompt_mask),
        "completion_ids": torch.tensor(completion_ids),
        "completion_mask": torch.ones(len(completion_ids), len(completion_ids[0]), dtype=torch.long),
        "pixel_values": torch.randn(total, 3, 16, 16, generator=generator),
        "image_sizes": torch.randint(1, 1000, (total, 2), generator=generator),
        "num_images": list(images_per_row),
    }
    bounds = torch.tensor([0, *images_per_row]).cumsum(0).tolist()
    own = [
        {key: output[key][bounds[row] : bounds[row + 1]] for key in ("pixel_values", "image_sizes")}
        for row in range(len(images_per_row))
    ]
    return output, own


def _assert_rows_get_their_images(call, expected_rows):
    """Row r of the drift pass holds `expected_rows[r]`'s tokens and exactly its images (TRL slices images of a
    batch by `num_images` in row order)."""
    assert call["num_images"] == [len(row["pixel_values"]) for row in expected_rows]
    bounds = torch.tensor([0, *call["num_images"]]).cumsum(0).tolist()
    for row, expected in enumerate(expected_rows):
        tokens = expected["tokens"]
        assert call["input_ids"][row, : len(tokens)].tolist() == tokens
        assert call["attention_mask"][row].sum().item() == len(tokens)
        for key in ("pixel_values", "image_sizes"):
            assert torch.equal(call[key][bounds[row] : bounds[row + 1]], expected[key])


def test_kl_adaptive_rho_passes_forward_each_visits_own_multimodal_inputs(llava_processor, tmp_path):
    trainer = _trainer(llava_processor, tmp_path, advantage_estimator="spo", num_generations=1, value_rho_mode="kl")
    calls = []

    def recording_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        calls.append({"input_ids": input_ids, "attention_mask": attention_mask, **kwargs})
        return torch.zeros(len(input_ids), logits_to_keep), None, None

    trainer._get_per_token_logps_and_entropies = recording_logps
    scorable = torch.tensor([True, True])
    # Round 1: prompt "a" (left-padded) with one image, "b" with two.
    first, (a1, b1) = _llava_round([[0, 1, 2], [3, 4, 5]], [[0, 1, 1], [1, 1, 1]], [[6, 7], [8, 9]], [1, 2], seed=1)
    a1["tokens"], b1["tokens"] = [1, 2, 6, 7], [3, 4, 5, 8, 9]
    trainer._values.pending_visit = trainer._values.visit_drift.snapshot(
        first, ["a", "b"], torch.tensor([0.0, 1.0]), scorable
    )
    trainer._values.close_pending_round()
    # First visits stand in for themselves: stored rows, then this round's rows.
    _assert_rows_get_their_images(calls[-1], [a1, b1, a1, b1])
    for key, own in (("a", a1), ("b", b1)):
        assert torch.equal(trainer._values.visit_store[key]["multimodal"]["pixel_values"], own["pixel_values"])
        assert trainer._values.visit_store[key]["multimodal"]["num_images"] == len(own["pixel_values"])

    # Round 2, in the other order and with other images: the stored visits of b and a (different images) share the
    # batch with this round's completions.
    second, (b2, a2) = _llava_round([[10, 11], [12, 13]], [[1, 1], [1, 1]], [[14, 15], [16, 17]], [1, 3], seed=2)
    b2["tokens"], a2["tokens"] = [10, 11, 14, 15], [12, 13, 16, 17]
    trainer._values.pending_visit = trainer._values.visit_drift.snapshot(
        second, ["b", "a"], torch.tensor([1.0, 0.0]), scorable
    )
    closed = trainer._values.close_pending_round()
    _assert_rows_get_their_images(calls[-1], [b1, a1, b2, a2])
    assert closed["value/rho_mean"] == pytest.approx(0.96)  # unchanged log-probs: rho_max

    # Round 3 is pending at the checkpoint, which closes it on copies: its visits are saved with their own images.
    third, (a3,) = _llava_round([[20, 21]], [[1, 1]], [[22, 23]], [2], seed=3)
    a3["tokens"] = [20, 21, 22, 23]
    trainer._values.pending_visit = trainer._values.visit_drift.snapshot(
        third, ["a"], torch.tensor([1.0]), torch.tensor([True])
    )
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    trainer._save_aspo_state(str(checkpoint))
    _assert_rows_get_their_images(calls[-1], [a2, a3])
    saved = load_checkpoint_state(str(checkpoint))["visit_store"]
    for key, own in (("a", a3), ("b", b2)):
        for field in ("pixel_values", "image_sizes"):
            assert torch.equal(saved[key]["multimodal"][field], own[field])
        assert saved[key]["multimodal"]["num_images"] == len(own["pixel_values"])

    # A run resumed from it measures the next visits against the restored images.
    trainer._values.visit_store = saved
    fourth, (b4, a4) = _llava_round([[30, 31], [32, 33]], [[1, 1], [1, 1]], [[34, 35], [36, 37]], [2, 1], seed=4)
    b4["tokens"], a4["tokens"] = [30, 31, 34, 35], [32, 33, 36, 37]
    trainer._values.pending_visit = trainer._values.visit_drift.snapshot(
        fourth, ["b", "a"], torch.tensor([1.0, 0.0]), scorable
    )
    trainer._values.close_pending_round()
    _assert_rows_get_their_images(calls[-1], [b2, a3, b4, a4])


def test_text_only_visits_store_and_forward_no_multimodal_inputs(llava_processor, tmp_path):
    trainer = _trainer(llava_processor, tmp_path, advantage_estimator="spo", num_generations=1, value_rho_mode="kl")
    calls = []

    def recording_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        calls.append(kwargs)
        return torch.zeros(len(input_ids), logits_to_keep), None, None

    trainer._get_per_token_logps_and_entropies = recording_logps
    output = {
        "prompt_ids": torch.tensor([[1, 2]]),
        "prompt_mask": torch.ones(1, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[3, 4]]),
        "completion_mask": torch.ones(1, 2, dtype=torch.long),
    }
    trainer._values.pending_visit = trainer._values.visit_drift.snapshot(
        output, ["a"], torch.tensor([1.0]), torch.tensor([True])
    )
    trainer._values.close_pending_round()
    assert set(trainer._values.visit_store["a"]) == {"prompt_ids", "completion_ids", "action_mask", "logps"}
    assert calls == [{"batch_size": trainer.args.per_device_train_batch_size}]


@pytest.mark.parametrize(
    ("multimodal", "field"),
    [
        # Idefics/SmolVLM: pixel_values padded to one row per sample (2 samples, up to 2 images each).
        (
            {
                "pixel_values": torch.zeros(2, 2, 3, 4, 4),
                "pixel_attention_mask": torch.ones(2, 2, 4, 4),
                "num_images": [1, 2],
            },
            "pixel_values",
        ),
        ({"pixel_values": torch.zeros(3, 3, 4, 4)}, "num_images"),
        # The grid promises 4 patch rows, pixel_values has 2.
        (
            {"pixel_values": torch.zeros(2, 4), "image_grid_thw": torch.tensor([[1, 2, 2]]), "num_images": [1, 0]},
            "pixel_values",
        ),
        ({"token_type_ids": torch.zeros(2, 3, dtype=torch.long)}, "token_type_ids"),
    ],
)
def test_kl_adaptive_rho_refuses_a_layout_it_cannot_split_per_sample(llava_processor, tmp_path, multimodal, field):
    trainer = _trainer(llava_processor, tmp_path, advantage_estimator="spo", num_generations=1, value_rho_mode="kl")
    output = {
        "prompt_ids": torch.tensor([[1, 2], [3, 4]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[5, 6], [7, 8]]),
        "completion_mask": torch.ones(2, 2, dtype=torch.long),
        **multimodal,
    }
    with pytest.raises(ValueError, match=rf"value_rho_mode='kl'.*`{field}`"):
        trainer._values.visit_drift.snapshot(output, ["a", "b"], torch.tensor([0.0, 1.0]), torch.tensor([True, True]))


def _completion_logps(model, visit, pixel_values, temperature):
    """Log-probs of a stored completion's tokens under `model`, one sample alone, with the given images."""
    prompt, completion = visit["prompt_ids"].long(), visit["completion_ids"].long()
    ids = torch.cat([prompt, completion])[None]
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixel_values).logits[0, len(prompt) - 1 : ids.size(1) - 1]
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, completion[:, None]).squeeze(-1)


def test_kl_adaptive_rho_trains_a_vision_language_model_with_each_visits_own_images(llava_processor, tmp_path):
    """Real TRL training of a tiny LLaVA with KL-adaptive rho (every round holds both prompts). The checkpoint closes
    the last round with the final model, so each saved visit's log-probs must equal that model's log-probs of its
    completion computed alone with its own image, and differ with another prompt's image."""
    generator = torch.Generator().manual_seed(0)
    images = [Image.fromarray((torch.rand(16, 16, 3, generator=generator) * 255).byte().numpy()) for _ in range(2)]
    dataset = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"q{i}"}]}] for i in range(2)
            ],
            "image": images,
            "prompt_id": ["p0", "p1"],
        }
    )
    model = _tiny_llava(llava_processor)
    args = ASPOConfig(
        **tiny_run_fields(
            tmp_path,
            per_device_train_batch_size=2,
            num_generations=1,
            max_completion_length=4,
            max_steps=3,
            save_strategy="steps",
            save_steps=3,
            learning_rate=1e-2,
            advantage_estimator="spo",
            value_rho_mode="kl",
            prompt_id_column="prompt_id",
        )
    )
    trainer = ASPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kwargs: [float(i % 2) for i in range(len(completions))]],
        args=args,
        train_dataset=dataset,
        processing_class=llava_processor,
    )
    trainer.train()
    drifts = [log["value/kl_drift"] for log in trainer.state.log_history if "value/kl_drift" in log]
    # Step 2 closes round 1 (first visits); step 3 closes round 2, which revisited both prompts after an update.
    assert drifts[0] == 0 and drifts[1] > 0
    saved = load_checkpoint_state(str(tmp_path / "checkpoint-3"))["visit_store"]
    assert set(saved) == {"p0", "p1"}
    for key, other in (("p0", "p1"), ("p1", "p0")):
        visit = saved[key]
        assert visit["multimodal"]["num_images"] == 1
        own = _completion_logps(trainer.model, visit, visit["multimodal"]["pixel_values"], args.temperature)
        torch.testing.assert_close(visit["logps"], own, atol=1e-5, rtol=1e-5)
        swapped = _completion_logps(trainer.model, visit, saved[other]["multimodal"]["pixel_values"], args.temperature)
        assert (swapped - own).abs().max() > 1e-3
