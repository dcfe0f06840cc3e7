"""CUDA: swap on its copy streams, memory actually saved, exactness on the GPU.

Not run on the CPU machine (skipped without a GPU). No timing is asserted: ordering is checked
through events, memory through the allocator's peak.
"""

from __future__ import annotations

import copy

import pytest
import torch

from protrain.activations import (
    apply_activation_policies,
    chunked_causal_lm_loss_sum,
)
from protrain.activations.transfer import HostTransfer, storage_bytes

from .models import batches, build

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _grads(model, data):
    loss = model(**data).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "policies",
    [
        ["swap"] * 4,
        ["offload_checkpoint"] * 4,
        ["swap", "offload_checkpoint", "checkpoint", "keep"],
    ],
)
def test_same_gradients_as_keep_on_cuda(policies):
    base = build("llama").to(CUDA)
    data = {k: v.to(CUDA) for k, v in batches(1)[0].items()}
    ref_loss, ref = _grads(copy.deepcopy(base), data)
    model = copy.deepcopy(base)
    handle = apply_activation_policies(model, policies, device=CUDA, tiled_mlp_tokens=5)
    loss, got = _grads(model, data)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, atol=1e-5, rtol=1e-5, msg=name)
    assert handle.swapper.transfer.device_bytes == 0
    handle.remove()


def test_recomputed_dropout_draws_the_forward_masks_on_cuda():
    """Dropout in recomputed blocks: the CUDA random state of forward is replayed."""
    base = build("llama", attention_dropout=0.5).to(CUDA)
    data = {k: v.to(CUDA) for k, v in batches(1)[0].items()}
    torch.manual_seed(7)
    ref_loss, ref = _grads(copy.deepcopy(base), data)
    for policies in (["checkpoint"] * 4, ["offload_checkpoint"] * 4):
        model = copy.deepcopy(base)
        handle = apply_activation_policies(model, policies, device=CUDA)
        torch.manual_seed(7)
        loss, got = _grads(model, data)
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g, atol=1e-5, rtol=1e-5, msg=name)
        handle.remove()


def test_copies_run_on_copy_streams_after_the_compute_that_made_them():
    transfer = HostTransfer(CUDA, min_piece_bytes=1 << 20)
    x = torch.randn((1 << 20) + (1 << 18) + 1000, device=CUDA)  # pieces of 4 MiB, 1 MiB, 4000 B
    torch.cuda._sleep(1_000_000_000)  # keeps the compute stream busy for a while
    y = x * 2  # enqueued after the sleep
    copy_ = transfer.to_host(storage_bytes(y))
    assert not copy_.d2h_event.query()  # waits for the compute stream, not done yet
    assert [p.numel() for p in copy_.pieces] == [4 << 20, 1 << 20, 4000]
    assert all(p.is_pinned() for p in copy_.pieces)
    transfer.synchronize()
    assert copy_.d2h_event.query()
    transfer.to_device(copy_)
    back = transfer.wait_ready(copy_)
    torch.testing.assert_close(back.view(torch.float32), y, atol=0, rtol=0)
    assert transfer.d2h_stream != torch.cuda.current_stream()
    assert transfer.h2d_stream != torch.cuda.current_stream()


def _requested_bytes() -> tuple[int, int]:
    """Bytes the caching allocator was asked for: (now, peak since the last reset). Unlike
    ``memory_allocated`` this leaves out the allocator's rounding (a large block is handed
    out whole when splitting it would leave 1 MiB or less), which differs from run to run by
    a few MiB, as much as one block input here."""
    stats = torch.cuda.memory_stats()
    return stats["requested_bytes.all.current"], stats["requested_bytes.all.peak"]


def test_swap_and_offload_lower_the_memory():
    n_layers, seq = 8, 1024
    model = build(
        "llama",
        num_hidden_layers=n_layers,
        hidden_size=512,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=seq,
    ).to(CUDA, torch.bfloat16)
    ids = torch.randint(0, 96, (2, seq), device=CUDA)

    def step(policies) -> tuple[int, int]:
        """(bytes at the end of forward, peak bytes of the step), from the step's start."""
        handle = apply_activation_policies(model, policies, device=CUDA)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start, _ = _requested_bytes()
        # no key-value cache: it would keep every layer's keys and values on the device
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        end_of_forward, _ = _requested_bytes()
        loss.backward()
        torch.cuda.synchronize()
        _, step_peak = _requested_bytes()
        del loss
        model.zero_grad(set_to_none=True)
        handle.remove()
        return end_of_forward - start, step_peak - start

    from protrain.activations.estimate import LlamaLayerShape, saved_bytes

    per_block = saved_bytes(LlamaLayerShape(2, seq, 512, 8, 8, 1536), dtype=torch.bfloat16)
    block_input = 2 * seq * 512 * 2
    _, keep = step(["keep"] * n_layers)
    _, swap = step(["swap"] * n_layers)
    offload_end, offload = step(["offload_checkpoint"] * n_layers)
    ckpt_end, ckpt = step(["checkpoint"] * n_layers)
    # swap holds at most two blocks' saved tensors on the device at once (prefetch 1)
    assert keep - swap > (n_layers - 3) * per_block
    # Offload-checkpoint's promise is about the block inputs: checkpoint holds one per block
    # from forward to that block's backward, offload-checkpoint none. The difference is the
    # whole stack at the end of forward. The step's peak is in the last block's backward,
    # where every weight gradient exists and checkpoint holds just that block's input, so
    # there the two are about equal: offload-checkpoint's may only not be higher (see
    # [Note: where offload-checkpoint saves memory] in test_offload_checkpoint_memory.py).
    assert ckpt_end - offload_end >= (n_layers - 0.5) * block_input
    # slack of a quarter input for allocations other than block inputs; in tensor bytes on
    # the CPU offload-checkpoint's peak is equal to checkpoint's or one input lower
    assert offload <= ckpt + block_input // 4


def test_chunked_loss_peak_is_one_chunk_of_logits():
    vocab, tokens, hidden, chunk = 32000, 8192, 256, 256
    head = torch.nn.Linear(hidden, vocab, bias=False, device=CUDA, dtype=torch.bfloat16)
    h = torch.randn(1, tokens, hidden, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    chunked_causal_lm_loss_sum(h, head, labels, chunk_tokens=chunk).backward()
    torch.cuda.synchronize()
    full_fp32_logits = tokens * vocab * 4
    assert torch.cuda.max_memory_allocated() - start < full_fp32_logits / 2


def test_with_the_chunk_engine_on_cuda():
    import protrain

    base = build("llama")
    data = [{k: v.to(CUDA) for k, v in b.items()} for b in batches(2)]
    reference = copy.deepcopy(base).to(CUDA)
    ref_losses = []
    for b in data:
        loss = reference(**b).loss
        loss.backward()
        ref_losses.append(loss.item())
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, device=CUDA, compute_dtype=torch.float32
    )
    handle = apply_activation_policies(model, ["swap", "checkpoint", "offload_checkpoint", "keep"])
    try:
        losses = []
        for b in data:
            loss = model(**b).loss
            loss.backward()
            losses.append(loss.item())
        assert losses == pytest.approx(ref_losses, abs=1e-5)
    finally:
        handle.remove()
        protrain.close(model)
