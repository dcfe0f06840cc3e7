"""Measured peaks of real runs on the CPU device, for the memory-model tests."""

from __future__ import annotations

import protrain
from protrain.activations import apply_activation_knobs
from protrain.knobs import Knobs
from protrain.profile.measure import measure_steps
from protrain.profile.trace import hf_loss, trace_model


def measured_peak(model, batch, knobs, chunk_size_bytes: int | None = None) -> int:
    """Peak device bytes of one step (after one warm-up) under ``(n_persist, n_buffer,
    n_swap, n_checkpoint)``, the model unwrapped again afterwards."""
    n_persist, n_buffer, n_swap, n_checkpoint = knobs
    model, opt, _ = protrain.wrap(
        model,
        n_persist=n_persist,
        n_buffer=n_buffer or None,
        device="cpu",
        lr=1e-3,
        chunk_size_bytes=chunk_size_bytes,
    )
    handle = apply_activation_knobs(model, n_swap, n_checkpoint, device="cpu")

    def step():
        hf_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

    try:
        return measure_steps(model, step, steps=1, warmup=1, device="cpu").peak_allocated_bytes
    finally:
        handle.remove()
        protrain.close(model)


def model_and_traces(seed: int):
    """A tiny Llama, its batch, and its traces with every chunk persistent and with none."""
    import tiny_llama  # tests/profile, on the path of the test modules that use this

    model = tiny_llama.build(seed=seed)
    batch = tiny_llama.batch()
    persistent = trace_model(model, batch, device="cpu")
    offloaded = trace_model(model, batch, device="cpu", knobs=Knobs(n_persist=0))
    return model, batch, persistent, offloaded
