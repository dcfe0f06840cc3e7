"""Chunked causal-LM loss: exactly the full cross-entropy, without full-sequence fp32 logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from protrain.activations import apply_activation_policies, chunked_causal_lm_loss_sum

from .memory import LargestOutputs
from .models import (
    ACCUM,
    STEPS,
    VOCAB,
    assert_same_gradients,
    batches,
    build,
    first_gradients,
    lora,
    train,
)

BATCH, SEQ, HIDDEN = 2, 12, 32


def _full_loss_sum(hidden, lm_head, labels):
    logits = lm_head(hidden).float()
    shifted = F.pad(labels[..., 1:], (0, 1), value=-100)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        shifted.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def _case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :4] = -100
    labels[1, -3:] = -100
    return hidden, lm_head, labels


@pytest.mark.parametrize("chunk_tokens", [1, 5, 7, BATCH * SEQ, 1000])
def test_value_and_gradients_match_full_cross_entropy(chunk_tokens):
    hidden, lm_head, labels = _case()
    ref = _full_loss_sum(hidden, lm_head, labels)
    ref_dh, ref_dw = torch.autograd.grad(ref, [hidden, lm_head.weight])
    loss = chunked_causal_lm_loss_sum(hidden, lm_head, labels, chunk_tokens=chunk_tokens)
    dh, dw = torch.autograd.grad(loss, [hidden, lm_head.weight])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(dh, ref_dh, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dw, ref_dw, atol=1e-6, rtol=1e-6)


def test_chunks_cross_the_batch_boundary_and_shift_per_row():
    """A chunk spanning two rows must not score row 0's last position against row 1's first."""
    hidden, lm_head, labels = _case()
    labels = torch.randint(0, VOCAB, labels.shape)  # nothing ignored
    ref = _full_loss_sum(hidden, lm_head, labels)
    loss = chunked_causal_lm_loss_sum(hidden, lm_head, labels, chunk_tokens=SEQ + 3)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)


def test_full_logits_never_exist_in_fp32():
    """bf16 head: the largest fp32 tensor in forward and backward is one chunk of logits."""
    chunk = 5
    hidden, lm_head, labels = _case(torch.bfloat16)
    with LargestOutputs() as full:
        _full_loss_sum(hidden, lm_head, labels).backward()
    assert full.largest[torch.float32] == BATCH * SEQ * VOCAB  # the thing avoided
    hidden.grad = None
    with LargestOutputs() as chunked:
        chunked_causal_lm_loss_sum(hidden, lm_head, labels, chunk_tokens=chunk).backward()
    assert chunked.largest[torch.float32] == chunk * VOCAB
    # and bf16 logits of a chunk at most, not of the sequence
    assert chunked.largest[torch.bfloat16] <= max(
        chunk * VOCAB, HIDDEN * VOCAB, BATCH * SEQ * HIDDEN
    )


def test_nothing_of_the_size_of_logits_is_saved_for_backward():
    hidden, lm_head, labels = _case()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        chunked_causal_lm_loss_sum(hidden, lm_head, labels, chunk_tokens=5)
    assert max(saved, default=0) < 5 * VOCAB


def test_lm_head_module_is_called_per_chunk_with_its_hooks():
    hidden, lm_head, labels = _case()
    calls = []
    lm_head.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    loss = chunked_causal_lm_loss_sum(hidden, lm_head, labels, chunk_tokens=10)
    assert calls == [10, 10, 4]
    loss.backward()
    assert calls[3:] == [4, 10, 10]  # recomputed chunk by chunk, the last first


def test_no_grad_and_errors():
    hidden, lm_head, labels = _case()
    with torch.no_grad():
        ref = _full_loss_sum(hidden, lm_head, labels)
        loss = chunked_causal_lm_loss_sum(hidden, lm_head, labels, chunk_tokens=7)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_causal_lm_loss_sum(hidden, lm_head, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="do not match"):
        chunked_causal_lm_loss_sum(hidden, lm_head, labels[:, :-1])


def _model_loss(model, batch):
    """What an application's loss looks like: backbone, then the chunked loss over the head."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = inner.model(input_ids=batch["input_ids"]).last_hidden_state
    n_targets = (batch["labels"][:, 1:] != -100).sum()
    loss_sum = chunked_causal_lm_loss_sum(
        hidden, inner.get_output_embeddings(), batch["labels"], chunk_tokens=7
    )
    return loss_sum / n_targets


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_trains_like_the_models_own_loss_with_policies(mode):
    """Losses and the gradients before a step match the model's own loss to 1e-6.

    The chunked loss sums over the vocabulary chunk by chunk, another order than torch's
    cross-entropy kernels, whose own order follows the CPU's vector width: the gradients
    differ in the last bits (3e-8 here), and AdamW's first steps turn a near-zero gradient's
    last bits into updates of up to ``lr``. So the weights after the steps are compared with
    the same chunked loss without the policies: the same order, bit for bit.
    """
    base = build("llama")
    if mode == "lora":
        base = lora(base)
    data = batches(STEPS * ACCUM)
    policies = ["swap", "checkpoint", "offload_checkpoint", "keep"]
    own_grads = first_gradients(copy.deepcopy(base), data[0])
    model = copy.deepcopy(base)
    handle = apply_activation_policies(model, policies)
    assert_same_gradients(first_gradients(model, data[0], _model_loss), own_grads)
    own_losses = train(copy.deepcopy(base), data)
    reference = copy.deepcopy(base)
    train(reference, data, loss_fn=_model_loss)
    losses = train(model, data, loss_fn=_model_loss)
    assert losses == pytest.approx(own_losses, abs=1e-6, rel=1e-6)
    ref_state = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], atol=0, rtol=0, msg=name)
    handle.remove()
