"""Synthetic profiles and hardware for search tests: no model, no trace."""

from __future__ import annotations

import dataclasses

import numpy as np

from protrain.profile.chunk_table import ChunkTable
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import BlockProfile, Interval, ModelProfile

MIB = 1 << 20


def hardware(device: str = "cuda") -> HardwareProfile:
    return HardwareProfile(
        device=device,
        device_name="synthetic",
        h2d_bytes_per_s=50e9,
        d2h_bytes_per_s=50e9,
        duplex_bytes_per_s=90e9,
        cpu_adam_params_per_s=4e9,
        device_adam_params_per_s=120e9,
        collective_bytes_per_s=None,
        cpu_threads=16,
    )


def profile(n_blocks: int, n_chunks: int, *, seed: int = 0, chunk_mib: int = 64) -> ModelProfile:
    """Blocks with saved > input bytes, chunks in execution order (embedding, blocks, head)."""
    rng = np.random.default_rng(seed)
    chunk = chunk_mib * MIB
    blocks = []
    for i in range(n_blocks):
        inp = int(rng.integers(8, 16)) * MIB
        saved = inp * int(rng.integers(4, 12))
        fwd = float(rng.uniform(2e-3, 4e-3))
        blocks.append(
            BlockProfile(
                name=f"layers.{i}",
                fwd_s=fwd,
                bwd_s=2 * fwd,
                recompute_s=fwd,
                saved_bytes=saved,
                input_bytes=inp,
                input_in_saved=bool(rng.integers(0, 2)),
                fwd_peak_keep_bytes=saved + 2 * inp,
                fwd_peak_checkpoint_bytes=3 * inp,
            )
        )
    per_block = max(1, (n_chunks - 2) // max(n_blocks, 1))
    first = [min(1 + i * per_block, n_chunks - 1) for i in range(n_blocks)]
    # backward accumulates one "parameter" per chunk, last chunk first
    done_before = [n_chunks - min(first[i] + per_block, n_chunks) for i in range(n_blocks)]
    intervals = [Interval("pre", -1, 0, 0.001, 4 * MIB, 2 * MIB, 0, 0, 0)]
    t, held = 0.001, 2 * MIB
    for i, b in enumerate(blocks):
        intervals.append(
            Interval("fwd", i, t, t + b.fwd_s, held + b.fwd_peak_checkpoint_bytes,
                     held + b.input_bytes, 0, 0, 0)
        )  # fmt: skip
        t += b.fwd_s
        held += b.input_bytes
    intervals.append(Interval("head", -1, t, t + 0.01, held + 300 * MIB, held, 0, 0, 0))
    t += 0.01
    for i in reversed(range(n_blocks)):
        b = blocks[i]
        held -= b.input_bytes
        intervals.append(
            Interval("bwd", i, t, t + 3 * b.fwd_s, held + b.input_bytes + b.saved_bytes + 40 * MIB,
                     held, 0, 0, done_before[i])
        )  # fmt: skip
        t += 3 * b.fwd_s
    intervals.append(Interval("opt", -1, t, t + 0.01, 10 * MIB, 0, 0, 0, 0))
    used = [int(chunk * rng.uniform(0.8, 1.0)) for _ in range(n_chunks)]
    trainable = [u // 2 for u in used]  # bf16, every parameter trainable
    table = ChunkTable(
        chunk_size_bytes=chunk,
        used_bytes=used,
        trainable_numel=trainable,
        trainable_bytes=[2 * n for n in trainable],
        trainable_tensors=[4] * n_chunks,
        max_trainable_numel=[n // 4 for n in trainable],
        min_buffers=1,
    )
    return ModelProfile(
        blocks=blocks,
        intervals=intervals,
        chunks=table,
        batch_size=4,
        seq_len=2048,
        device="cuda",
        compute_dtype="bfloat16",
        trace_n_persist=0,
        trace_n_buffer=2,
        step_s=t,
        pre_fwd_s=0.001,
        head_s=0.01,
        post_bwd_s=0.0,
        optimizer_step_s=0.01,
        allocator_overhead_bytes=64 * MIB,
        grad_order=[(c, trainable[c]) for c in reversed(range(n_chunks))],
        step_start_bytes=100 * MIB,  # traced with nothing persistent: all of it is "other"
        chunk_first_block=[
            -1
            if c == 0
            else min(
                (i for i in range(n_blocks) if first[i] <= c < first[i] + per_block),
                default=n_blocks,
            )
            for c in range(n_chunks)
        ],  # fmt: skip
    )


def frozen_first(n_frozen: int, **table_fields) -> ModelProfile:
    """:func:`profile` of 8 blocks in 10 chunks whose first ``n_frozen`` chunks hold no
    trainable parameter (an embedding, as LoRA leaves it); ``table_fields`` replace further
    fields of its chunk table."""
    p = profile(n_blocks=8, n_chunks=10)
    trn = list(p.chunks.trainable_numel)
    trn[:n_frozen] = [0] * n_frozen
    table = dataclasses.replace(
        p.chunks, trainable_numel=trn, trainable_bytes=[2 * n for n in trn],
        trainable_tensors=[int(n > 0) for n in trn], max_trainable_numel=trn, **table_fields,
    )  # fmt: skip
    return dataclasses.replace(p, chunks=table)
