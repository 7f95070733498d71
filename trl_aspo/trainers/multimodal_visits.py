"""Per-sample multimodal inputs for the KL-adaptive rho's stored visits (SPO, arXiv:2509.13232, `_get_spo_rho`).

KL-adaptive rho re-scores a prompt's stored completion at its next visit, possibly many rounds later, batched with
other prompts' stored completions. A vision-language model needs each completion's own images for that pass, so a
visit keeps its slice of the round's multimodal inputs, laid out as TRL lays out one sample
(`trl.trainer.utils.split_pixel_values_by_grid`, and `GRPOTrainer._get_per_token_logps_and_entropies`, which slices
image-indexed tensors by `num_images`, tile-indexed ones by `num_tiles` and per-token ones by row):

* `image_grid_thw` (Qwen-VL): `pixel_values` rows per image = `prod(image_grid_thw[i])`;
* `image_position_ids` (Gemma 4): `pixel_values` and `image_position_ids` one row per image;
* `spatial_shapes` (LFM2-VL): `pixel_values`, `pixel_attention_mask`, `spatial_shapes` one row per tile;
* `num_tiles` alone (InternVL): `pixel_values` one row per tile;
* otherwise `pixel_values` one row per image (LLaVA), `image_sizes` one row per image in every layout;
* `token_type_ids`, `mm_token_type_ids`: one row per sample over prompt + completion positions.

Batching visits back concatenates the image- and tile-indexed slices in row order, lists `num_images`/`num_tiles`, and
lays the per-token rows out like the visits' `input_ids` (prompt without padding, then completion, right-padded).
A layout that cannot be split per sample reliably (`pixel_values` padded to one row per sample, as Idefics and SmolVLM
do, whose rows of different rounds have different padded shapes) is refused, naming the field.
"""

from __future__ import annotations

import torch

TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")
COUNT_FIELDS = ("num_images", "num_tiles")
# Per-image or per-tile rows: a batch is their concatenation in sample order.
ROW_FIELDS = (
    "pixel_values",
    "image_grid_thw",
    "image_position_ids",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
)


def _refuse(field: str, why: str) -> ValueError:
    return ValueError(
        f"ASPOConfig.value_rho_mode='kl' stores each visit's own multimodal inputs, but this model's `{field}` "
        f"{why}, so a visit's slice cannot be told apart reliably. Use value_rho_mode='constant' with this model."
    )


def _split_rows(tensor: torch.Tensor, sizes: list[int], field: str, unit: str) -> list[torch.Tensor]:
    if tensor.size(0) != sum(sizes):
        raise _refuse(field, f"has {tensor.size(0)} rows where the batch has {sum(sizes)} {unit}")
    return [part.to("cpu", copy=True) for part in torch.split(tensor, sizes, dim=0)]


def split_multimodal_inputs(
    batch: dict, prompt_mask: torch.Tensor, completion_lengths: list[int]
) -> list[dict[str, torch.Tensor | int]]:
    """Each sample's own multimodal inputs from a TRL batch, on CPU; an empty dict per sample for a text-only batch.

    `prompt_mask` (B, P) and `completion_lengths` trim per-token fields to the sample's own positions (prompt without
    padding, then its completion). Raises ValueError naming the field for a layout that cannot be split per sample."""
    present = {key: batch[key] for key in (*ROW_FIELDS, *TOKEN_FIELDS, *COUNT_FIELDS) if batch.get(key) is not None}
    samples: list[dict] = [{} for _ in completion_lengths]
    if not present:
        return samples
    num_samples = len(samples)
    image_fields = [key for key in ROW_FIELDS if key in present]
    if image_fields:
        if "num_images" not in present:
            raise _refuse("num_images", f"is missing while the batch has {image_fields[0]}")
        num_images = [int(count) for count in present["num_images"]]
        per_sample = {"num_images": num_images}
        if "num_tiles" in present:
            per_sample["num_tiles"] = [int(count) for count in present["num_tiles"]]
        # The same order of layouts as `GRPOTrainer._get_per_token_logps_and_entropies`.
        if "image_grid_thw" in present:
            grid = present["image_grid_thw"]
            rows = grid.prod(dim=-1).tolist()
            bounds = torch.tensor([0, *num_images]).cumsum(0).tolist()
            rows_per_sample = [sum(rows[bounds[i] : bounds[i + 1]]) for i in range(num_samples)]
            per_sample["image_grid_thw"] = _split_rows(grid, num_images, "image_grid_thw", "images")
            if "pixel_values" in present:
                per_sample["pixel_values"] = _split_rows(
                    present["pixel_values"], rows_per_sample, "pixel_values", "patches in image_grid_thw"
                )
        elif "image_position_ids" in present:
            if "pixel_values" in present:
                per_sample["pixel_values"] = _split_rows(present["pixel_values"], num_images, "pixel_values", "images")
        elif "spatial_shapes" in present or "num_tiles" in present:
            if "num_tiles" not in present:
                raise _refuse("num_tiles", "is missing while the batch has spatial_shapes")
            for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
                if key in present:
                    per_sample[key] = _split_rows(present[key], per_sample["num_tiles"], key, "tiles")
        elif "pixel_values" in present:
            if present["pixel_values"].size(0) != sum(num_images):
                raise _refuse("pixel_values", "is padded to one row per sample rather than one row per image")
            per_sample["pixel_values"] = _split_rows(present["pixel_values"], num_images, "pixel_values", "images")
        for key in ("image_position_ids", "image_sizes"):
            if key in present:
                per_sample[key] = _split_rows(present[key], num_images, key, "images")
        if "pixel_attention_mask" in present and "pixel_attention_mask" not in per_sample:
            raise _refuse("pixel_attention_mask", "is padded to one row per sample without spatial_shapes")
        for key in image_fields:
            if key not in per_sample:
                raise _refuse(key, "comes in no per-sample layout TRL uses")
        for key, values in per_sample.items():
            for sample, value in zip(samples, values, strict=True):
                sample[key] = value
    prompt_width = prompt_mask.size(1)
    for key in TOKEN_FIELDS:
        if key not in present:
            continue
        ids = present[key]
        if ids.dim() != 2 or ids.size(0) != num_samples or ids.size(1) < prompt_width + max(completion_lengths):
            raise _refuse(key, f"has shape {tuple(ids.shape)}, not (samples, prompt + completion positions)")
        for row, (sample, length) in enumerate(zip(samples, completion_lengths, strict=True)):
            prompt_part = ids[row, :prompt_width][prompt_mask[row].bool()]
            sample[key] = torch.cat([prompt_part, ids[row, prompt_width : prompt_width + length]]).to("cpu", copy=True)
    return samples


def batch_multimodal_inputs(samples: list[dict], width: int) -> dict:
    """Forward keyword arguments for samples stored by `split_multimodal_inputs`, batched in row order.

    Per-token fields are right-padded with 0 to `width`, like the rows' `input_ids`. A sample without a field (a
    text-only round, or an image-free prompt) contributes no rows and counts 0 images and tiles; a batch with no image
    rows passes no image tensors."""
    batched: dict = {}
    for key in COUNT_FIELDS:
        if any(key in sample for sample in samples):
            batched[key] = [int(sample.get(key, 0)) for sample in samples]
    for key in ROW_FIELDS:
        parts = [sample[key] for sample in samples if key in sample]
        if parts and sum(part.size(0) for part in parts) > 0:
            batched[key] = torch.cat(parts, dim=0)
    for key in TOKEN_FIELDS:
        rows = [sample.get(key) for sample in samples]
        present = [row for row in rows if row is not None]
        if not present:
            continue
        padded = torch.zeros(len(samples), width, dtype=present[0].dtype)
        for index, row in enumerate(rows):
            if row is not None:
                padded[index, : row.size(0)] = row
        batched[key] = padded
    return batched
