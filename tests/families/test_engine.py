"""Every family of the matrix (``configs.FAMILIES``) trains through the engine as through
plain PyTorch: fp32 on the CPU, the model's default ``use_cache``, a padded
``attention_mask``, 3 AdamW steps of gradient accumulation 2 with global-norm clipping.

One engine run per family and mode (full fine-tuning, LoRA ``all-linear``), which holds
persistent and offloaded chunks (the first two of at least four persistent, a chunk no larger
than the model's largest parameter) and swapped and checkpointed blocks (the first block
swapped, the others checkpointed): losses, gradient norms and parameters to 1e-6. Block
discovery finds every layer, and a MoE layer's experts sit in chunks of their own layer, in
layer order.

The plain run calls the blocks the engine recomputes without a key-value cache, as the
engine does ([Note: key-value caches and recomputation] in ``activations/checkpoint.py``):
a family whose layer takes another code path with a cache (Qwen3-Next's and Jamba's
convolutions) rounds differently there, however the layer is run (docs/design.md,
"Recomputed blocks and the cache").
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.engine.test_equivalence import ACCUM, LR, STEPS, WD, train_engine, train_plain
from torch import nn

import protrain
from protrain.activations.checkpoint import without_cache
from protrain.activations.forward_wrap import wrap_forward
from protrain.activations.policy import ActivationPolicy
from protrain.model.blocks import discover_blocks

from .configs import FAMILIES, batches, build, lora_all_linear, n_layers


def largest_param_bytes(model: nn.Module) -> int:
    return max(p.numel() * p.element_size() for p in model.parameters())


def base_model(name: str, mode: str) -> nn.Module:
    model = build(name)
    return lora_all_linear(model, name) if mode == "lora" else model


def recomputed_without_cache(model: nn.Module, engine_model: nn.Module) -> nn.Module:
    """``model`` with the blocks that ``engine_model`` recomputes called without a cache."""
    recomputed = (ActivationPolicy.CHECKPOINT, ActivationPolicy.OFFLOAD_CHECKPOINT)
    for name, policy in engine_model._protrain_activations.policy_of().items():
        if policy in recomputed:
            wrap_forward(model.get_submodule(name), _called_without_cache)
    return model


def _called_without_cache(forward):
    def run(*args, **kwargs):
        args, kwargs = without_cache(args, kwargs)
        return forward(*args, **kwargs)

    return run


def _wrap_mixed(base: nn.Module):
    """The engine's run: two persistent chunks, the first block swapped, the others
    checkpointed."""
    return protrain.wrap(
        copy.deepcopy(base),
        n_persist=2,
        chunk_size_bytes=largest_param_bytes(base),
        n_swap=1,
        n_checkpoint=len(discover_blocks(base).blocks) - 1,
        lr=LR,
        weight_decay=WD,
        device="cpu",
    )


def _trains_as_in_plain_pytorch(name, base, data, model, optimizer) -> None:
    reference = recomputed_without_cache(copy.deepcopy(base), model)
    ref_losses, ref_norms = train_plain(reference, data)
    ref_state = reference.state_dict()
    losses, norms = train_engine(model, data, optimizer)
    assert model._protrain_engine.manager.stats["gathers"] > 0
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    assert norms == pytest.approx(ref_norms, abs=1e-6, rel=1e-6)
    state = protrain.state_dict(model)
    assert state.keys() == ref_state.keys()
    for key, ref in ref_state.items():
        torch.testing.assert_close(state[key], ref, atol=1e-6, rtol=0, msg=f"{name} {key}")


def _experts_in_layer_order(model: nn.Module, layout) -> None:
    """Each layer's expert parameters lie in chunks no later than the next layer's."""
    chunk_of = {n: c.index for c in layout.chunks for pl in c.placements for n in pl.names}
    spans = []
    for block in discover_blocks(model).blocks:
        idx = [chunk_of[n] for n in chunk_of if n.startswith(f"{block.name}.") and ".experts." in n]
        assert idx, f"{block.name}: no expert parameters in the chunks"
        spans.append((min(idx), max(idx)))
    for (_, last), (first, _) in zip(spans, spans[1:]):
        assert last <= first, spans


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_as_in_plain_pytorch(name, mode):
    base = base_model(name, mode)
    blocks = discover_blocks(base).blocks
    assert len(blocks) == n_layers(base), [b.name for b in blocks]
    model, optimizer, layout = _wrap_mixed(base)
    try:
        assert layout.n_chunks >= 4, f"{name}: want several chunks, got {layout.n_chunks}"
        if FAMILIES[name].kind == "moe":
            _experts_in_layer_order(model, layout)
        _trains_as_in_plain_pytorch(name, base, batches(name, STEPS * ACCUM), model, optimizer)
    finally:
        protrain.close(model)


@pytest.mark.parametrize("name", ["qwen3_next", "jamba"])
def test_hybrid_layers_past_a_chunk_train_as_in_plain_pytorch(name):
    """LoRA over 70 tokens: Qwen3-Next's chunked linear attention runs two chunks of 64, the
    second padded. Bit for bit; against a plain run with the cache in every layer, gradient
    norms differed by up to 2e-5 and parameters by 5e-6 (AVX-512 and AVX2 alike), which is
    how far these families' own cache and no-cache paths are apart."""
    base = base_model(name, "lora")
    model, optimizer, _ = _wrap_mixed(base)
    try:
        data = batches(name, STEPS * ACCUM, seq=70)
        _trains_as_in_plain_pytorch(name, base, data, model, optimizer)
    finally:
        protrain.close(model)


def test_modules_reading_their_childrens_weights_bring_them_in():
    """Mamba's mixer passes ``conv1d.weight`` to a function and ``nn.MultiheadAttention``
    (SigLIP's pooling head) reads ``out_proj.weight``, neither calling the child: their
    calls bring the child's parameters in (offloaded, these failed with "storage of size
    0")."""
    from protrain.model.readers import direct_reads

    groups = direct_reads(build("mamba")).groups
    assert "backbone.layers.0.mixer.conv1d.weight" in groups["backbone.layers.0.mixer"]
    groups = direct_reads(build("paligemma")).groups
    head = "model.vision_tower.head.attention"
    assert f"{head}.out_proj.weight" in groups[head]
    assert direct_reads(build("llama")).groups == {}


def test_a_recompute_counts_every_chunk_its_starting_module_holds():
    """Jamba, every chunk offloaded: the backward of layer 1's experts (two chunks) starts
    the layer's recompute, whose Mamba mixer holds two other chunks; wrap and the planner's
    table count the four (they counted three, and the first backward ran out)."""
    from protrain.model.readers import direct_reads
    from protrain.profile.chunk_table import chunk_table_and_index

    base = build("jamba")
    table, chunk_of = chunk_table_and_index(
        base, compute_dtype=torch.float32, chunk_size_bytes=largest_param_bytes(base)
    )
    layer = "model.layers.1"
    experts = {c for n, c in chunk_of.items() if n.startswith(f"{layer}.feed_forward.experts.")}
    mixer = [
        f"{layer}.mamba.A_log",
        f"{layer}.mamba.D",
        *direct_reads(base).groups[f"{layer}.mamba"],
    ]
    held = experts | {chunk_of[n] for n in mixer}
    assert len(experts) == 2 and len(held) == 4, (experts, held)
    assert table.min_buffers_recompute == len(held)
    model, _, _ = protrain.wrap(copy.deepcopy(base), n_persist=0, n_buffer=None, lr=LR,
                                chunk_size_bytes=largest_param_bytes(base), device="cpu",
                                n_checkpoint=len(discover_blocks(base).blocks))  # fmt: skip
    try:
        assert model._protrain_engine.manager.n_buffer == len(held)
    finally:
        protrain.close(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_recomputed_blocks_get_the_buffers_they_hold(name):
    """Every chunk offloaded, every block checkpointed, chunks the size of the largest
    parameter: whatever n_buffer wrap accepts (picked, or 2) carries the steps, and what it
    refuses it refuses up front. A recompute holds one chunk beyond a module's, two with an
    offloaded tied head, and the chunks of the module that started it where it holds more
    (Jamba's experts): Pegasus, Marian, Jamba and the MoE families ran out of buffers in
    their first backward with buffers wrap had accepted."""
    base = build(name)
    n_blocks = len(discover_blocks(base).blocks)
    knobs = dict(n_persist=0, chunk_size_bytes=largest_param_bytes(base), n_checkpoint=n_blocks,
                 lr=LR, device="cpu")  # fmt: skip
    for n_buffer in (None, 2):
        try:
            model, optimizer, _ = protrain.wrap(copy.deepcopy(base), n_buffer=n_buffer, **knobs)
        except ValueError as exc:
            assert n_buffer == 2 and "recomputed blocks hold more" in str(exc), exc
            continue
        try:
            train_engine(model, batches(name, STEPS * ACCUM), optimizer)
        finally:
            protrain.close(model)
