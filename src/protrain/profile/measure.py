"""Measured peak device memory and time of real training steps (for the closed loop, the
accuracy benchmark and the CPU tests).

On CUDA: the allocator's peak allocated and reserved bytes over the steps. On the CPU the
device is the host, so the wrapped engine's device-side bytes are counted instead: its
persistent chunks, their fp32 masters and gradient accumulators, the offloaded chunks
resident in the buffer pool at each op, and every storage the main thread's ops create
(activations, gradients, the device optimizer's state, which the first step creates).
Call it on a freshly wrapped model, so that the device optimizer's state is created under
the count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from protrain.profile.memory_clock import TensorBytesCounter


@dataclass
class StepMeasurement:
    peak_allocated_bytes: int
    peak_reserved_bytes: int  # equals allocated on the CPU (no caching allocator counted)
    step_s: float  # mean over the measured steps
    steps: int


def engine_static_device_bytes(model: nn.Module) -> int:
    """Device bytes a wrapped model holds for good: persistent chunks, masters, accumulators."""
    manager = model._protrain_engine.manager
    total = 0
    for c in manager.chunks:
        if c.persistent:
            total += c.device_buffer.untyped_storage().nbytes()
            for s in c.slots:
                for t in (s.master, s.grad_acc):
                    if t is not None:
                        total += t.untyped_storage().nbytes()
    return total


def measure_steps(
    model: nn.Module,
    step: Callable[[], None],
    *,
    steps: int = 3,
    warmup: int = 1,
    device: torch.device | str,
) -> StepMeasurement:
    """Run ``step()`` ``warmup + steps`` times; peak memory over all, time over the last."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
        dt = (time.perf_counter() - t0) / steps
        return StepMeasurement(
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
            dt,
            steps,
        )
    manager = model._protrain_engine.manager
    static = engine_static_device_bytes(model)
    chunk = manager.layout.chunk_size_bytes
    peak = [0]

    def sample(counter: TensorBytesCounter) -> None:
        now = static + counter.live_bytes + len(manager.resident) * chunk
        peak[0] = max(peak[0], now)

    with TensorBytesCounter(on_op=sample):
        for _ in range(warmup):
            step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        dt = (time.perf_counter() - t0) / steps
    return StepMeasurement(peak[0], peak[0], dt, steps)
