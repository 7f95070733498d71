"""CPU infrastructure for TRL's AsyncGRPOTrainer: varlen and tree-attention fallbacks, sampling log-probs, named
tensors and the local worker's checks (TRL's own worker against a real vLLM server is in tests/vllm_tier)."""

from __future__ import annotations

import pytest
import torch
from helpers import MODEL, async_grpo_config

from trl_aspo.builtin.task import correctness_reward, make_dataset
from trl_aspo.infra import (
    LocalRolloutWorker,
    install_cpu_fallbacks,
    load_named_tensors,
    resolve_model_path,
    sample_completion,
    varlen_attention,
)

# Tree-attention fallback


def test_varlen_attention_single_segment_equals_causal_sdpa():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(5, 4, 8, generator=generator) for _ in range(3))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(varlen_attention(query, key, value, cu, cu), expected, atol=1e-6, rtol=1e-5)


def test_varlen_attention_aligns_a_short_segment_to_the_end_of_its_path():
    """One query after a 2-token path sees all 3 keys: uniform scores (zero queries) average the 3 values."""
    query = torch.zeros(1, 1, 2)
    key = torch.randn(3, 1, 2)
    value = torch.tensor([[[1.0, 0.0]], [[0.0, 3.0]], [[2.0, 6.0]]])
    out = varlen_attention(query, key, value, torch.tensor([0, 1]), torch.tensor([0, 3]))
    torch.testing.assert_close(out, torch.tensor([[[1.0, 3.0]]]))


def test_varlen_attention_rejects_heads_that_do_not_group():
    query, key = torch.zeros(2, 3, 4), torch.zeros(2, 2, 4)
    with pytest.raises(ValueError, match="3 heads, not a multiple of the 2"):
        varlen_attention(query, key, key, torch.tensor([0, 2]), torch.tensor([0, 2]))


def test_tree_attention_fallback_matches_unpacked_log_probs(tiny_model):
    """Packed trie forward (TRL's tree attention on the fallback) == each sample forwarded alone with SDPA."""
    from trl.experimental.async_grpo import packing

    install_cpu_fallbacks()
    packing.register_tree_attention()
    assert packing._flash_attn().flash_attn_varlen_func is varlen_attention
    prompt = [11, 12, 13, 14, 15]
    samples = [
        ([*prompt, 21, 22, 23], [0, 0, 0, 0, 0, 1, 1, 1]),
        ([*prompt, 21, 24], [0, 0, 0, 0, 0, 1, 1]),
        ([*prompt, 31, 32, 33, 34], [0, 0, 0, 0, 0, 1, 1, 1, 1]),
        ([40, 41, 42], [0, 1, 1]),
    ]
    row = packing.TreeRow()
    for ids, mask in samples:
        row.add(
            {
                "input_ids": torch.tensor(ids),
                "completion_mask": torch.tensor(mask),
                "old_log_probs": torch.zeros(len(ids)),
                "advantage": 0.0,
                "group_id": 0,
            }
        )
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(len(ids) for ids, _ in samples)  # the prompt is shared

    tiny_model.eval()
    tiny_model.set_attn_implementation(packing.TREE_ATTENTION)
    with torch.no_grad():
        logits = tiny_model(
            input_ids=packed["input_ids"][None],
            position_ids=packed["position_ids"][None],
            tree_kv_index=packed["tree_kv_index"],
            tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
        ).logits[0]
    targets = [ids[p] for ids, mask in samples for p in range(1, len(ids)) if mask[p]]
    packed_log_probs = torch.log_softmax(logits[packed["token_index"]], -1)[torch.arange(len(targets)), targets]

    tiny_model.set_attn_implementation("sdpa")
    unpacked = []
    with torch.no_grad():
        for ids, mask in samples:
            log_probs = torch.log_softmax(tiny_model(input_ids=torch.tensor([ids])).logits[0], -1)
            unpacked += [log_probs[p - 1, ids[p]] for p in range(1, len(ids)) if mask[p]]
    torch.testing.assert_close(packed_log_probs, torch.stack(unpacked), atol=1e-5, rtol=0)


# Local sampling


def test_sample_completion_log_probs_are_the_temperature_scaled_policy(tiny_model):
    prompt = [5, 6, 7]
    generator = torch.Generator().manual_seed(0)
    tokens, log_probs = sample_completion(
        tiny_model, prompt, max_tokens=6, eos_token_ids=[], temperature=0.7, generator=generator
    )
    assert len(tokens) == 6
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, -1)[torch.arange(6), tokens]
    torch.testing.assert_close(torch.tensor(log_probs), expected, atol=1e-5, rtol=0)


def test_sample_completion_rejects_zero_temperature(tiny_model):
    with pytest.raises(ValueError, match="temperature=0"):
        sample_completion(tiny_model, [1, 2], max_tokens=2, eos_token_ids=[], temperature=0)


def test_load_named_tensors_rejects_unknown_names_and_shapes(tiny_model):
    with pytest.raises(KeyError, match="no_such.weight"):
        load_named_tensors(tiny_model, [("no_such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_named_tensors(tiny_model, [("model.norm.weight", torch.zeros(3))])


def test_resolve_model_path_maps_the_builtin_checkpoint():
    assert resolve_model_path("builtin:tiny-calculator") == MODEL
    assert resolve_model_path("/some/dir") == "/some/dir"
    with pytest.raises(ValueError, match="builtin:tiny-random"):
        resolve_model_path("builtin:tiny-random")


def test_local_worker_rejects_negative_jitter(tmp_path, calculator_tokenizer):
    with pytest.raises(ValueError, match="jitter_s=-1"):
        LocalRolloutWorker(
            MODEL,
            calculator_tokenizer,
            make_dataset("train", 4),
            correctness_reward,
            async_grpo_config(tmp_path),
            jitter_s=-1,
        )


def test_local_worker_warns_when_the_trainer_autocasts_but_the_copy_samples_in_float32(
    tmp_path, calculator_tokenizer, caplog
):
    dataset = make_dataset("train", 4)
    LocalRolloutWorker(
        MODEL, calculator_tokenizer, dataset, correctness_reward, async_grpo_config(tmp_path, bf16=True)
    )
    assert "Set bf16=False and fp16=False" in caplog.text
