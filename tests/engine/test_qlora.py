"""QLoRA inside chunks: 4-bit base weights (bitsandbytes NF4, double quantization) and
their quantization state live in chunks, on the host when offloaded, and the engine
computes what the same PEFT model computes unwrapped (fp32 compute on CPU: to 1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain

from .models import batches, build, lora
from .test_equivalence import ACCUM, LR, STEPS, WD, train_engine, train_plain

bnb = pytest.importorskip("bitsandbytes")

from protrain.quant import is_4bit_linear, lift_quant_state, quantize_linear_4bit  # noqa: E402
from protrain.quant.four_bit import KEEP_DTYPE_ATTR  # noqa: E402


def _qlora(kind: str = "llama", quant_type: str = "nf4") -> torch.nn.Module:
    model = build(kind)
    quantize_linear_4bit(model, compute_dtype=torch.float32, quant_type=quant_type)
    return lora(model, kind)


def test_quantized_layers_hold_their_state_as_frozen_parameters():
    model = _qlora()
    layers = [m for m in model.modules() if is_4bit_linear(m)]
    assert len(layers) == 3 * 7  # every projection of the 3 blocks; lm_head is skipped
    layer = layers[0]
    names = {n for n, _ in layer.named_parameters(recurse=False)}
    assert names == {"weight", "quant_absmax", "quant_absmax2"}
    state = layer.weight.quant_state
    assert state.absmax is layer.quant_absmax and state.state2.absmax is layer.quant_absmax2
    assert layer.weight.dtype == torch.uint8 and layer.quant_absmax.dtype == torch.uint8
    assert layer.quant_absmax2.dtype == torch.float32
    assert not any(p.requires_grad for p in layer.parameters(recurse=False))
    assert lift_quant_state(model) == 0  # idempotent
    # a copy's state is copied apart from its parameters; lifting links them again (wrap
    # lifts every model it is given)
    twin = copy.deepcopy(model)
    layer = next(m for m in twin.modules() if is_4bit_linear(m))
    assert layer.weight.quant_state.absmax is not layer.quant_absmax
    assert lift_quant_state(twin) == len(layers)
    assert layer.weight.quant_state.absmax is layer.quant_absmax
    assert layer.weight.quant_state.state2.absmax is layer.quant_absmax2


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_qlora_same_losses_and_adapters_as_unwrapped(quant_type):
    base = _qlora(quant_type=quant_type)
    data = batches("llama", STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses, ref_norms = train_plain(reference, data)
    ref_state = {k: v for k, v in reference.state_dict().items() if "lora_" in k}

    probe, _, layout = protrain.wrap(copy.deepcopy(base), device="cpu")
    n_chunks = layout.n_chunks
    protrain.close(probe)
    assert n_chunks >= 3
    # the packed weights are stored as bytes, the scales in fp32, whatever the compute dtype
    dtypes = {pl.dtype for c in layout.chunks for pl in c.placements}
    assert {torch.uint8, torch.float32} <= dtypes
    for n_persist in sorted({0, n_chunks // 2, n_chunks}):
        model, optimizer, layout = protrain.wrap(
            copy.deepcopy(base), n_persist=n_persist, lr=LR, weight_decay=WD, device="cpu"
        )
        layer = next(m for m in model.modules() if is_4bit_linear(m))
        assert layer.weight.quant_state.absmax is layer.quant_absmax  # what the engine moves
        if n_persist == 0:  # the state is chunk storage: no bytes until its chunk is gathered
            assert layer.quant_absmax2.untyped_storage().nbytes() == 0
            assert layer.weight.untyped_storage().nbytes() == 0
        losses, norms = train_engine(model, data, optimizer)
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), n_persist
        assert norms == pytest.approx(ref_norms, abs=1e-6, rel=1e-6), n_persist
        state = protrain.state_dict(model)
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
        protrain.close(model)


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    """bf16 compute as on a GPU; the quantization scales stay fp32."""
    for p in model.parameters():
        if p.is_floating_point() and not getattr(p, KEEP_DTYPE_ATTR, False):
            p.data = p.data.to(torch.bfloat16)
    return model


def test_qlora_bf16_compute_keeps_the_scales_of_a_copied_model_in_fp32():
    """bf16 compute on the CPU, the model deep-copied before wrap (a copy drops the marks
    that keep the scales fp32; wrap marks them again): the same losses as unwrapped."""
    base = _bf16(_qlora())
    data = batches("llama", STEPS * ACCUM)
    ref_losses, _ = train_plain(copy.deepcopy(base), data)
    model, optimizer, layout = protrain.wrap(
        copy.deepcopy(base), n_persist=0, lr=LR, weight_decay=WD, device="cpu",
        compute_dtype=torch.bfloat16,
    )  # fmt: skip
    scales = {pl.dtype for c in layout.chunks for pl in c.placements if "absmax2" in pl.names[0]}
    assert scales == {torch.float32}
    losses, _ = train_engine(model, data, optimizer)
    # the first optimizer step: same bf16 math; after it the engine's fp32 masters differ
    # from plain AdamW on bf16 adapters
    assert losses[:ACCUM] == pytest.approx(ref_losses[:ACCUM], rel=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    protrain.close(model)


def test_qlora_with_checkpointed_blocks_and_host_held_inputs():
    base = _qlora()
    data = batches("llama", STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses, _ = train_plain(reference, data)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base),
        n_persist=0,
        n_checkpoint=2,
        offload_checkpoint=True,
        lr=LR,
        weight_decay=WD,
        device="cpu",
    )
    losses, _ = train_engine(model, data, optimizer)
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    protrain.close(model)


def test_quantize_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError, match="quant_type='int3' is not allowed"):
        quantize_linear_4bit(build("llama"), compute_dtype=torch.float32, quant_type="int3")
    with torch.device("meta"):
        meta = build("llama")
    with pytest.raises(ValueError, match="meta device"):
        quantize_linear_4bit(meta, compute_dtype=torch.float32)


@pytest.mark.gpu
def test_qlora_on_gpu_matches_unwrapped_with_every_chunk_offloaded():
    """bf16 compute, base and state on the host between uses: the same bitsandbytes kernels
    on the same bytes as the unwrapped model on the GPU."""
    torch.manual_seed(0)
    base = build("llama")
    quantize_linear_4bit(base, compute_dtype=torch.bfloat16, quant_device="cuda")
    base = _bf16(lora(base, "llama"))
    data = [{k: v.cuda() for k, v in b.items()} for b in batches("llama", STEPS * ACCUM)]
    reference = copy.deepcopy(base).cuda()
    ref_losses, _ = train_plain(reference, data)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, n_buffer=2, lr=LR, weight_decay=WD, device="cuda"
    )
    layer = next(m for m in model.modules() if is_4bit_linear(m))
    assert layer.quant_absmax.device.type == "cuda"
    losses, _ = train_engine(model, data, optimizer)
    assert losses[:ACCUM] == pytest.approx(ref_losses[:ACCUM], rel=1e-3)
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    protrain.close(model)


def test_peft_wraps_with_its_4bit_lora_layers_and_a_merge_is_lifted_again():
    """PEFT's 4-bit LoRA layer merges by de- and re-quantizing the weight: the new state is
    the truth, and lifting (the first thing wrap does) takes its scales."""
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    model = _qlora()
    assert any(isinstance(m, LoraLinear4bit) for m in model.modules())
    batch = batches("llama", 1)[0]
    model.eval()
    with torch.no_grad():
        merged = model.merge_and_unload()
        expected = merged(**batch).loss
        lift_quant_state(merged)
        again = merged(**batch).loss
    assert again == expected
    layer = next(m for m in merged.modules() if is_4bit_linear(m))
    assert layer.weight.quant_state.absmax is layer.quant_absmax


def test_eval_on_the_cpu_keeps_the_weights_in_their_chunks():
    # bitsandbytes repacks a CPU layer for inference in eval mode where the CPU has
    # AVX512-BF16; lifted layers opt out, so the weight stays a view of its chunk
    model, _, _ = protrain.wrap(_qlora(), n_persist=0, device="cpu")
    layer = next(m for m in model.modules() if is_4bit_linear(m))
    packed = layer.weight.untyped_storage()
    model.eval()
    with torch.no_grad():
        model(**batches("llama", 1)[0])
    assert layer.weight.untyped_storage() is packed or (
        layer.weight.untyped_storage().data_ptr() == packed.data_ptr()
    )
    assert layer.weight.quant_state.absmax is layer.quant_absmax
    protrain.close(model)


def test_scales_cast_after_quantization_are_refused():
    # 8-bit layers: tests/engine/test_eight_bit.py
    model = _qlora()
    model.to(torch.bfloat16)  # casts the lifted fp32 scales too
    with pytest.raises(ValueError, match="was the model cast"):
        protrain.wrap(model, device="cpu")
