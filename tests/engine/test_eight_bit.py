"""QLoRA at 8 bits inside chunks: bitsandbytes' int8 base weights (LLM.int8, frozen) and
their per-row scales live in chunks, on the host when offloaded, and the engine computes
what the same PEFT model computes unwrapped (fp32 compute on CPU: to 1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain

from .models import batches, build, lora
from .test_equivalence import ACCUM, LR, STEPS, WD, train_engine, train_plain

bnb = pytest.importorskip("bitsandbytes")

from protrain.chunks.layout import KEEP_DTYPE_ATTR  # noqa: E402
from protrain.profile.chunk_table import chunk_table  # noqa: E402
from protrain.quant import (  # noqa: E402
    is_8bit_linear,
    lift_quant_state,
    quantize_linear_8bit,
)


def _add_outliers(model: torch.nn.Module) -> None:
    # a few hidden features large after every norm: |x| > 6 reaches the projections
    for norm in (m for n, m in model.named_modules() if n.endswith("layernorm")):
        norm.weight.data[:3] *= 40.0


def _qlora8(threshold: float = 0.0, outliers: bool = False) -> torch.nn.Module:
    model = build("llama")
    if outliers:
        _add_outliers(model)
    quantize_linear_8bit(model, threshold=threshold)
    return lora(model, "llama")


def test_int8_layers_hold_their_scales_as_a_frozen_parameter_peft_wraps_them():
    from peft.tuners.lora.bnb import Linear8bitLt as LoraLinear8bitLt

    model = _qlora8()
    layers = [m for m in model.modules() if is_8bit_linear(m)]
    assert len(layers) == 3 * 7  # every projection of the 3 blocks; lm_head is skipped
    assert sum(isinstance(m, LoraLinear8bitLt) for m in model.modules()) == 3 * 5
    layer = layers[0]
    assert {n for n, _ in layer.named_parameters(recurse=False)} == {"weight", "quant_scb"}
    assert layer.weight.dtype == torch.int8 and layer.quant_scb.dtype == torch.float32
    assert getattr(layer.quant_scb, KEEP_DTYPE_ATTR)
    assert layer.weight.CB is None and layer.weight.SCB is None  # the state reads params
    assert layer.state.SCB is layer.quant_scb
    assert layer.state.CB.data_ptr() == layer.weight.data_ptr()
    assert lift_quant_state(model) == 0  # idempotent; wrap and the planner lift this way
    # a copy drops the parameter's mark; lifting marks it again
    twin = copy.deepcopy(model)
    layer = next(m for m in twin.modules() if is_8bit_linear(m))
    assert not getattr(layer.quant_scb, KEEP_DTYPE_ATTR, False)
    lift_quant_state(twin)
    assert getattr(layer.quant_scb, KEEP_DTYPE_ATTR)


@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_qlora8_same_losses_and_adapters_as_unwrapped_with_chunks_offloaded(threshold):
    """At 0.0 in training mode (bitsandbytes' CPU training path dequantizes the weight); at
    6.0 in eval mode, whose path is LLM.int8's on the GPU: int8 matmul plus the input's
    outlier columns in 16 bits against dequantized weight columns, forward and backward."""
    base = _qlora8(threshold, outliers=threshold > 0)
    layers = [m for m in base.modules() if is_8bit_linear(m)]
    assert {m.state.threshold for m in layers} == {threshold}
    if threshold > 0:
        base.eval()  # no dropout in the model: the same loss, on the outlier path
    data = batches("llama", STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses, ref_norms = train_plain(reference, data)
    ref_state = {k: v for k, v in reference.state_dict().items() if "lora_" in k}
    assert ref_state
    ref_layers = [m for m in reference.modules() if is_8bit_linear(m)]
    # the last call's outlier columns (bitsandbytes sets state.idx on its outlier path)
    n_outliers = [0 if m.state.idx is None else m.state.idx.numel() for m in ref_layers]
    if threshold > 0:
        assert sum(n > 0 for n in n_outliers) >= 3 * 4  # q, k, v, gate or up of every block
    else:
        assert not any(n_outliers)

    # one block recomputed in backward: the state is bound again at the recomputing call
    model, optimizer, layout = protrain.wrap(
        copy.deepcopy(base), n_persist=1, n_checkpoint=1, lr=LR, weight_decay=WD, device="cpu"
    )
    assert layout.n_chunks >= 3 and layout.n_persist < layout.n_chunks
    # the int8 weights are stored as int8, the scales in fp32, whatever the compute dtype
    dtypes = {pl.dtype for c in layout.chunks for pl in c.placements}
    assert {torch.int8, torch.float32} <= dtypes
    last = [m for m in model.modules() if is_8bit_linear(m)][-1]  # in an offloaded chunk
    assert last.quant_scb.untyped_storage().nbytes() == 0  # released: no bytes
    assert last.weight.untyped_storage().nbytes() == 0
    losses, norms = train_engine(model, data, optimizer)
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    assert norms == pytest.approx(ref_norms, abs=1e-6, rel=1e-6)
    state = protrain.state_dict(model)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    # the weight and the state read the chunk's storage (bitsandbytes' forward sets
    # weight.data = state.CB: a state bound before placement would pull the weight out of
    # its chunk): released again, then gathered by the next call
    assert last.weight.untyped_storage().nbytes() == 0
    assert last.quant_scb.untyped_storage().nbytes() == 0
    assert last.state.SCB is last.quant_scb
    assert last.state.CB.untyped_storage().data_ptr() == last.weight.untyped_storage().data_ptr()
    batch = batches("llama", 1, seed=7)[0]
    with torch.no_grad():
        again = model(**batch).loss
        expected = reference(**batch).loss
    assert again.item() == pytest.approx(expected.item(), abs=1e-6, rel=1e-6)
    protrain.close(model)


def test_peft_merge_requantizes_and_the_next_call_takes_the_new_scales():
    """PEFT's 8-bit merge de- and re-quantizes the weight (new scales in ``weight.SCB``,
    the state reset): the layer's next call lifts them, as bitsandbytes' forward would."""
    merged = _qlora8().merge_and_unload()
    layer = next(m for m in merged.modules() if is_8bit_linear(m))
    fresh = layer.weight.SCB
    assert fresh is not None and layer.state.SCB is None
    x = torch.randn(2, layer.in_features)
    y = layer(x)  # training mode on the CPU: bitsandbytes dequantizes, then a linear
    assert layer.weight.SCB is None and layer.state.SCB is layer.quant_scb
    assert torch.equal(layer.quant_scb, fresh)
    expected = x @ (layer.weight.float() * (fresh / 127).unsqueeze(1)).t()
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-6)


def test_an_int8_chunk_table_is_about_half_a_bf16_one():
    """The planner reads bytes from the real tensors: 1 byte a weight plus 4 a row."""
    fp = build("llama")
    int8 = quantize_linear_8bit(build("llama"), skip=())  # the head too: every linear
    n_weights = sum(m.weight.numel() for m in int8.modules() if is_8bit_linear(m))
    n_rows = sum(m.weight.shape[0] for m in int8.modules() if is_8bit_linear(m))
    bf16 = sum(chunk_table(fp, compute_dtype=torch.bfloat16).used_bytes)
    q8 = sum(chunk_table(int8, compute_dtype=torch.bfloat16).used_bytes)
    assert bf16 - q8 == n_weights - 4 * n_rows  # 2 -> 1 byte a weight, fp32 scales added
    assert 0.5 < q8 / bf16 < 0.7  # the embeddings and norms stay bf16


def test_int8_refusals():
    with torch.device("meta"):
        meta = build("llama")
    with pytest.raises(ValueError, match="meta device"):
        quantize_linear_8bit(meta)
    with pytest.raises(ValueError, match="threshold=-1.0 is not allowed"):
        quantize_linear_8bit(build("llama"), threshold=-1.0)
    trained16 = torch.nn.Sequential(bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=True))
    with pytest.raises(ValueError, match="has_fp16_weights=True"):
        protrain.wrap(trained16, device="cpu")
    unquantized = torch.nn.Sequential(bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False))
    with pytest.raises(ValueError, match="not quantized yet"):
        protrain.wrap(unquantized, device="cpu")
    cast = _qlora8()
    cast.to(torch.bfloat16)  # casts the lifted fp32 scales too
    with pytest.raises(ValueError, match="was the model cast"):
        protrain.wrap(cast, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_qlora8_on_gpu_matches_unwrapped_with_every_chunk_offloaded(threshold):
    """bf16 compute, int8 weights and scales on the host between uses: bitsandbytes' own
    CUDA kernels on the same bytes as the unwrapped model on the GPU (at 6.0 with inputs
    that hold outliers: their columns in 16 bits)."""
    torch.manual_seed(0)
    base = build("llama")
    if threshold > 0:
        _add_outliers(base)
    quantize_linear_8bit(base, threshold=threshold, quant_device="cuda")
    base = lora(base, "llama")
    for p in base.parameters():
        if p.is_floating_point() and not getattr(p, KEEP_DTYPE_ATTR, False):
            p.data = p.data.to(torch.bfloat16)
    data = [{k: v.cuda() for k, v in b.items()} for b in batches("llama", STEPS * ACCUM)]
    reference = copy.deepcopy(base).cuda()
    ref_losses, _ = train_plain(reference, data)
    ref_layers = [m for m in reference.modules() if is_8bit_linear(m)]
    n_outliers = sum(m.state.idx is not None and m.state.idx.numel() > 0 for m in ref_layers)
    assert n_outliers >= 3 * 4 if threshold > 0 else n_outliers == 0
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, n_buffer=2, lr=LR, weight_decay=WD, device="cuda"
    )
    layer = next(m for m in model.modules() if is_8bit_linear(m))
    assert layer.quant_scb.device.type == "cuda" and layer.quant_scb.dtype == torch.float32
    losses, _ = train_engine(model, data, optimizer)
    # the first optimizer step: the same bf16 math; after it the engine's fp32 masters
    # differ from plain AdamW on bf16 adapters
    assert losses[:ACCUM] == pytest.approx(ref_losses[:ACCUM], rel=1e-3)
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    protrain.close(model)
