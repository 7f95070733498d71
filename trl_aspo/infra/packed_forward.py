"""The forward of TRL's `AsyncGRPOTrainer.compute_loss` on one packed micro-batch, on its own: the model inputs TRL
builds from the collated row (its tree-packed tokens, positions and the tree-attention index), and the log-probs of
the row's trained tokens. `AsyncASPOTrainer` records the proximal policy with it (`proximal_policy="recompute"`), so
the recorded log-probs come from the very call its training forward makes (same packing, same kernels): at a
learning rate of 0 the proximal ratio is 1. Kept in step with TRL 1.16's `compute_loss`; this module is the one
place that reads that layout for a forward of trl-aspo's own.
"""

from __future__ import annotations

import torch

TREE_INDEX_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


def packed_model_inputs(inputs: dict[str, torch.Tensor]) -> dict:
    """The keyword arguments TRL's `compute_loss` passes to the model for the collated micro-batch `inputs` (one
    rank's row, padding stripped)."""
    real = inputs["attention_mask"].bool()
    model_inputs = {
        "input_ids": inputs["input_ids"][real].unsqueeze(0),
        "position_ids": inputs["position_ids"][real].unsqueeze(0),
        "shift_labels": inputs["shift_labels"][real].unsqueeze(0),
        "fused_lm_head": True,
    }
    model_inputs.update({key: inputs[key][inputs[key] >= 0] for key in TREE_INDEX_KEYS})
    model_inputs["tree_max_seqlen_q"], model_inputs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    return model_inputs


def packed_log_probs(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """(M,) log-probs of the micro-batch's M trained tokens (`token_index >= 0`, in TRL's order), by `model`'s
    forward as `compute_loss` runs it (no gradient is taken here: call it under `torch.no_grad()`)."""
    outputs = model(**packed_model_inputs(inputs))
    return outputs.log_probs.flatten()[inputs["token_index"][inputs["token_index"] >= 0]]
