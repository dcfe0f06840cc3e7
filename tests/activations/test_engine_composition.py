"""Policies on a model wrapped by the chunk engine (``protrain.wrap``), every chunk offloaded.

With ``n_persist=0`` every parameter lives in host chunks and is gathered by the runtime's
module hooks, also when a checkpointed block is recomputed inside backward. Losses and
parameters after AdamW steps with gradient accumulation match plain PyTorch to 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch

import protrain
from protrain.activations import apply_activation_policies, apply_tiled_mlp

from .models import ACCUM, LR, STEPS, WD, batches, build, lora, train

POLICIES = {
    "checkpoint": ["checkpoint"] * 4,
    "swap": ["swap"] * 4,
    "mix": ["swap", "checkpoint", "offload_checkpoint", "keep"],
}


def _reference(base, data, loss_fn=None, tile_tokens=None):
    reference = copy.deepcopy(base)
    if tile_tokens is not None:
        apply_tiled_mlp(reference, tile_tokens=tile_tokens)
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    return train(reference, data, optimizer=opt, loss_fn=loss_fn), reference.state_dict()


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_policies_with_all_chunks_offloaded(mode, policy):
    base = build("llama")
    if mode == "lora":
        base = lora(base)
    data = batches(STEPS * ACCUM)
    ref_losses, ref_state = _reference(base, data)

    model, optimizer, layout = protrain.wrap(
        copy.deepcopy(base), n_persist=0, device="cpu", lr=LR, weight_decay=WD
    )
    assert layout.n_chunks >= 3 and layout.n_persist == 0
    handle = apply_activation_policies(model, POLICIES[policy], device="cpu")
    try:
        losses = train(model, data, optimizer=optimizer)
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), policy
        state = protrain.state_dict(model)
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=f"{policy} {name}")
    finally:
        handle.remove()
        protrain.close(model)


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_tiled_mlp_and_chunked_loss_with_all_chunks_offloaded(mode):
    """The head is called per chunk (and again per chunk in backward): the runtime gathers it.

    Losses match plain PyTorch's own loss to 1e-6; the weights after AdamW match plain
    PyTorch computing the same tiles and the same chunked loss bit for bit: tiles and chunks
    sum in another order than the whole sequence (see test_tiled_mlp.py and
    test_chunked_loss.py), which AdamW's first steps amplify where a gradient is near zero.
    """
    from .test_chunked_loss import _model_loss

    base = build("llama")
    if mode == "lora":
        base = lora(base)
    data = batches(STEPS * ACCUM)
    plain_losses, _ = _reference(base, data)
    _, ref_state = _reference(base, data, loss_fn=_model_loss, tile_tokens=5)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, device="cpu", lr=LR, weight_decay=WD
    )
    handle = apply_activation_policies(model, POLICIES["mix"], device="cpu", tiled_mlp_tokens=5)
    try:
        losses = train(model, data, optimizer=optimizer, loss_fn=_model_loss)
        assert losses == pytest.approx(plain_losses, abs=1e-6, rel=1e-6)
        state = protrain.state_dict(model)
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, atol=0, rtol=0, msg=name)
    finally:
        handle.remove()
        protrain.close(model)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_parameters_in_chunk_storage_are_not_swapped(mode):
    """Parameters are views of chunk buffers under the engine: swap leaves them to the runtime."""
    base = build("llama")
    if mode == "lora":
        base = lora(base)
    data = batches(1)[0]
    plain = copy.deepcopy(base)
    handle = apply_activation_policies(plain, ["swap"] * 4, device="cpu")
    plain(**data).loss.backward()
    expected = handle.swapper.transfer.bytes_to_host
    handle.remove()
    model, _, _ = protrain.wrap(copy.deepcopy(base), n_persist=0, device="cpu")
    handle = apply_activation_policies(model, ["swap"] * 4, device="cpu")
    try:
        model(**data).loss.backward()
        assert handle.swapper.transfer.bytes_to_host == expected
    finally:
        handle.remove()
        protrain.close(model)
