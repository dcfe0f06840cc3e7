"""Offload-checkpoint on the CPU: the block inputs it takes off the device, in tensor bytes.

On the CPU the "device" and the host are one memory, so the counter is paused while the
transfer makes host copies: what it counts is what would be device memory on CUDA.

[Note: where offload-checkpoint saves memory]
Checkpoint holds every block's input from its forward to the end of its backward;
offload-checkpoint holds none between forward and backward, and in backward only the input
being recomputed and the one prefetched. The saving is therefore the whole stack of inputs at
the end of forward, and shrinks by one input per block as backward proceeds: at the step's
peak, in the last block's backward where every weight gradient exists, it is at most one
input. The step's peak must not be higher than checkpoint's; it cannot be much lower.
"""

from __future__ import annotations

import torch

from protrain.activations import apply_activation_policies
from protrain.profile.memory_clock import TensorBytesCounter

from .models import build

N_LAYERS, BATCH, SEQ, HIDDEN = 6, 2, 128, 64


class DeviceBytesCounter(TensorBytesCounter):
    """The tensor-bytes counter, not counting what is made while ``paused``."""

    paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _step(model, ids, policy: str) -> tuple[int, int, int]:
    """(device bytes at the end of forward, device bytes peak of the step, bytes fetched back
    at once at most), all relative to the start of the step."""
    handle = apply_activation_policies(model, [policy] * N_LAYERS, device="cpu")
    counter = DeviceBytesCounter()
    if handle.swapper is not None:
        transfer = handle.swapper.transfer
        to_host = transfer.to_host

        def to_host_uncounted(source):
            counter.paused = True
            try:
                return to_host(source)
            finally:
                counter.paused = False

        transfer.to_host = to_host_uncounted
    try:
        with counter:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            end_of_forward = counter.live_bytes
            loss.backward()
        fetched = handle.swapper.transfer.peak_device_bytes if handle.swapper else 0
        return end_of_forward, counter.peak_bytes, fetched
    finally:
        model.zero_grad(set_to_none=True)
        handle.remove()


def test_offload_checkpoint_holds_no_block_input_on_the_device():
    model = build(
        "llama",
        num_hidden_layers=N_LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    ids = torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    block_input = BATCH * SEQ * HIDDEN * 4
    ckpt_end, ckpt_peak, _ = _step(model, ids, "checkpoint")
    offload_end, offload_peak, fetched = _step(model, ids, "offload_checkpoint")
    # see [Note: where offload-checkpoint saves memory]
    assert ckpt_end - offload_end == N_LAYERS * block_input
    assert offload_peak <= ckpt_peak
    assert fetched <= 2 * block_input  # the input recomputed and the one prefetched
