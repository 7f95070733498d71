"""Stored visits of a grid-layout multimodal processor batch back with their own patches and token types (the
trainer side: tests/integration/test_multimodal.py)."""

from __future__ import annotations

import torch

from trl_aspo.trainers.multimodal_visits import batch_multimodal_inputs, split_multimodal_inputs


def test_grid_layout_visits_batch_back_with_their_own_patches_and_token_types():
    """Qwen-VL layout: `pixel_values` has prod(image_grid_thw[i]) rows per image; `mm_token_type_ids` covers the
    left-padded prompt and the completion. Sample 0: one 1x2x2 image (4 rows); sample 1: none; sample 2: a 1x2x2 and
    a 1x1x2 image (6 rows)."""
    grid = torch.tensor([[1, 2, 2], [1, 2, 2], [1, 1, 2]])
    pixel_values = torch.arange(10 * 2).reshape(10, 2).float()
    token_types = torch.tensor([[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    batch = {
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
        "num_images": [1, 0, 2],
        "mm_token_type_ids": token_types,
    }
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])
    samples = split_multimodal_inputs(batch, prompt_mask, completion_lengths=[2, 1, 0])
    assert torch.equal(samples[0]["pixel_values"], pixel_values[0:4])
    assert samples[1]["pixel_values"].shape == (0, 2)
    assert torch.equal(samples[2]["pixel_values"], pixel_values[4:10])
    assert torch.equal(samples[2]["image_grid_thw"], grid[1:3])
    assert [s["num_images"] for s in samples] == [1, 0, 2]
    assert [s["mm_token_type_ids"].tolist() for s in samples] == [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0]]

    # Batched back in another order, as the drift pass mixes visits: rows follow the samples.
    batched = batch_multimodal_inputs([samples[2], samples[1], samples[0]], width=5)
    assert torch.equal(batched["pixel_values"], torch.cat([pixel_values[4:10], pixel_values[0:4]]))
    assert torch.equal(batched["image_grid_thw"], grid[[1, 2, 0]])
    assert batched["num_images"] == [2, 0, 1]
    assert batched["mm_token_type_ids"].tolist() == [[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    # A visit from a text-only round counts no images; a batch without image rows passes no image tensors.
    text_only = batch_multimodal_inputs([samples[1], {}], width=4)
    assert set(text_only) == {"num_images", "mm_token_type_ids"}
    assert text_only["num_images"] == [0, 0]
    assert text_only["mm_token_type_ids"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]
