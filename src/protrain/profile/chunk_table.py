"""Per-chunk byte and parameter counts for a chunk size, computed without moving anything.

The plan needs, for every chunk in execution order, the bytes it holds, its trainable
parameters (which carry fp32 masters, gradient accumulators and Adam state) and its frozen
bytes; and the most offloaded chunks one module needs at once. :func:`chunk_table` reads
them from :func:`protrain.chunks.layout.plan_layout`, which only looks at shapes and dtypes,
so it works on a model on the meta device and for any candidate chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from protrain.chunks.buffers import min_resident_chunks
from protrain.chunks.layout import choose_chunk_size, plan_layout, storage_dtype
from protrain.profile.param_index import ParamIndex, param_index


@dataclass
class ChunkTable:
    chunk_size_bytes: int
    used_bytes: list[int]  # per chunk, in execution order
    trainable_numel: list[int]  # per chunk
    trainable_bytes: list[int]  # per chunk, in the compute dtype
    trainable_tensors: list[int]  # per chunk
    max_trainable_numel: list[int]  # per chunk: its largest trainable tensor
    # Most offloaded chunks one module or one block needs resident at once (all offloaded):
    # chunks.buffers.min_resident_chunks, the same rule protrain.wrap checks.
    min_buffers: int

    @property
    def n_chunks(self) -> int:
        return len(self.used_bytes)

    @property
    def frozen_bytes(self) -> list[int]:
        """Bytes of each chunk that are not trainable parameters (in the compute dtype)."""
        return [u - t for u, t in zip(self.used_bytes, self.trainable_bytes)]


def chunk_table(
    model: nn.Module, *, compute_dtype: torch.dtype, chunk_size_bytes: int | None = None
) -> ChunkTable:
    return chunk_table_and_index(
        model, compute_dtype=compute_dtype, chunk_size_bytes=chunk_size_bytes
    )[0]


def chunk_table_and_index(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype,
    chunk_size_bytes: int | None = None,
    index: ParamIndex | None = None,
) -> tuple[ChunkTable, dict[str, int]]:
    """The table, and the chunk index of every parameter name. ``index``: the model's
    :func:`~protrain.profile.param_index.param_index`, when the caller has it (it lifts
    4-bit layers' scales first, so that the table counts what the chunks will hold)."""
    if index is None:
        index = param_index(model)
    params = index.params
    if chunk_size_bytes is None:
        sizes = [p.numel() * storage_dtype(p, compute_dtype).itemsize for _, p in params]
        chunk_size_bytes = choose_chunk_size(sizes)
    layout = plan_layout(
        params,
        compute_dtype=compute_dtype,
        device=torch.device("meta"),
        n_persist=0,
        n_buffer=None,
        chunk_size_bytes=chunk_size_bytes,
    )
    chunk_of: dict[str, int] = {}
    used, tr_numel, tr_tensors, tr_bytes, tr_max = [], [], [], [], []
    for c in layout.chunks:
        used.append(c.used_bytes)
        tr = [pl for pl in c.placements if pl.trainable]
        tr_numel.append(sum(pl.numel for pl in tr))
        tr_tensors.append(len(tr))
        tr_bytes.append(sum(pl.nbytes for pl in tr))
        tr_max.append(max((pl.numel for pl in tr), default=0))
        for pl in c.placements:
            for n in pl.names:
                chunk_of[n] = c.index
    need = min_resident_chunks(model, chunk_of, index.groups)
    table = ChunkTable(
        chunk_size_bytes=layout.chunk_size_bytes,
        used_bytes=used,
        trainable_numel=tr_numel,
        trainable_bytes=tr_bytes,
        trainable_tensors=tr_tensors,
        max_trainable_numel=tr_max,
        min_buffers=max(need, 1),
    )
    return table, chunk_of
