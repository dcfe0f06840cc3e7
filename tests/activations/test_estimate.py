"""The saved-bytes formula against bytes measured through saved_tensors_hooks (exact, CPU)."""

from __future__ import annotations

import pytest
import torch

from protrain.activations import apply_activation_policies
from protrain.activations.estimate import (
    LlamaLayerShape,
    block_activation_bytes,
    measure_saved_bytes,
    saved_bytes,
    saved_bytes_breakdown,
)

from .models import build

DIMS = dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, vocab_size=96)
BATCH, SEQ = 3, 10


def _measure(kind, attn, dtype, kv_heads, targets):
    model = build(kind, num_key_value_heads=kv_heads, attn_implementation=attn, **DIMS).to(dtype)
    if targets is not None:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    inner = model.get_base_model() if targets is not None else model
    ids = torch.randint(0, 96, (BATCH, SEQ))
    return measure_saved_bytes(inner.model.layers, lambda: model(input_ids=ids, labels=ids))


def _shape(kv_heads):
    return LlamaLayerShape(BATCH, SEQ, 48, 6, kv_heads, 80)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [2, 6])
@pytest.mark.parametrize(
    "targets", [None, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                ("q_proj", "v_proj")]
)  # fmt: skip
def test_formula_equals_measured_bytes(kind, attn, dtype, kv_heads, targets):
    measured = _measure(kind, attn, dtype, kv_heads, targets)
    predicted = saved_bytes(
        _shape(kv_heads), dtype=dtype, attn_implementation=attn, lora_targets=targets, lora_rank=4
    )
    # layer 0's input needs no gradient under LoRA (embeddings frozen): compare the others
    for i, got in enumerate(measured[1:], start=1):
        assert got == predicted, (
            i,
            got,
            saved_bytes_breakdown(
                _shape(kv_heads), dtype=dtype, attn_implementation=attn, lora_targets=targets,
                lora_rank=4,
            ),
        )  # fmt: skip


def test_policies_hold_what_the_formula_says():
    """Swap moves the keep bytes to the host; offload-checkpoint moves the layer input."""
    shape = _shape(2)
    keep = block_activation_bytes(shape, "keep", dtype=torch.float32)
    assert keep.device_bytes == saved_bytes(shape, dtype=torch.float32) and keep.host_bytes == 0
    model = build("llama", **DIMS)
    ids = torch.randint(0, 96, (BATCH, SEQ))
    handle = apply_activation_policies(model, ["swap"] * 4, device="cpu")
    model(input_ids=ids, labels=ids)
    swap = block_activation_bytes(shape, "swap", dtype=torch.float32)
    assert swap == type(swap)(0, keep.device_bytes)
    assert handle.swapper.transfer.bytes_to_host == 4 * swap.host_bytes
    handle.remove()
    handle = apply_activation_policies(model, ["offload_checkpoint"] * 4, device="cpu")
    model(input_ids=ids, labels=ids)
    held = block_activation_bytes(shape, "offload_checkpoint", dtype=torch.float32)
    assert handle.swapper.transfer.bytes_to_host == 4 * held.host_bytes
    assert block_activation_bytes(shape, "checkpoint", dtype=torch.float32).device_bytes == (
        held.host_bytes
    )
    handle.remove()


def test_llama3_8b_at_8192_in_numbers():
    """The numbers the GPU probe compares: Llama-3-8B layer, batch 1, seq 8192, bf16, sdpa."""
    shape = LlamaLayerShape(1, 8192, 4096, 32, 8, 14336)
    keep = saved_bytes(shape, dtype=torch.bfloat16)
    # 2 norms (fp32 input, rsqrt, normalized, output) + rope + q,k,v,out,lse + 4 MLP tensors
    t = 8192
    expected = (
        2 * (t * 4096 * 4 + t * 4 + 2 * t * 4096 * 2)
        + 2 * 8192 * 128 * 2
        + (2 * t * 4096 + 2 * t * 1024) * 2
        + 32 * 8192 * 4
        + 4 * t * 14336 * 2
    )
    assert keep == expected
    assert 1.6e9 < keep < 1.7e9  # about 1.65 GB per layer
