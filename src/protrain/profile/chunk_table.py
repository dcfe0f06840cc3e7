"""Per-chunk byte and parameter counts for a chunk size, computed without moving anything.

The plan needs, for every chunk in execution order, the bytes it holds, its trainable
parameters (which carry fp32 masters, gradient accumulators and Adam state) and its frozen
bytes; and the most offloaded chunks one module needs at once. :func:`chunk_table` packs
them by the rule of :func:`protrain.chunks.layout.plan_layout`, which only looks at shapes
and dtypes, so it works on a model on the meta device and for any candidate chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from protrain.chunks.buffers import (
    min_resident_chunks,
    recompute_extra_chunks,
    tied_head_chunk,
)
from protrain.chunks.layout import choose_chunk_size, pack_arrays
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
    # The chunk holding the output head's weight where the head shares it with another
    # parameter (a tied head: the input embedding's chunk), else None. The engine gathers
    # that chunk again for the head ([Note: a tied head] in plan/runtime.py). Saved
    # profiles without it load as untied.
    tied_head_chunk: int | None = None
    # The same with recomputed blocks, which plans with n_checkpoint > 0 need
    # (chunks.buffers.recompute_extra_chunks), and with a tied head's chunk offloaded
    # besides (tied_head_chunk >= n_persist). Saved profiles without them: min_buffers.
    min_buffers_recompute: int | None = None
    min_buffers_recompute_tied: int | None = None

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
    4-bit layers' scales first, so that the table counts what the chunks will hold).

    The parameters are packed by ``layout.pack_arrays``, the rule ``protrain.wrap`` lays them out
    by, and summed per chunk over arrays: the chunk-size search builds a table for every
    candidate size, and building the whole layout (a placement object per parameter) for
    each was a fifth of qlora-70b's search (1,843 tensors, 6 sizes)."""
    if index is None:
        index = param_index(model)
    if not index.params:
        raise ValueError("the model has no parameters to place in chunks")
    numel, nbytes, trainable = index.arrays(compute_dtype)
    if chunk_size_bytes is None:
        chunk_size_bytes = choose_chunk_size(nbytes.tolist())
    if (not isinstance(chunk_size_bytes, int) or isinstance(chunk_size_bytes, bool)
            or chunk_size_bytes < int(nbytes.max())):  # fmt: skip
        raise ValueError(
            f"chunk_size_bytes={chunk_size_bytes!r} is too small: it must be an int of at "
            f"least {int(nbytes.max())} bytes, the largest parameter in the compute dtype"
        )
    chunk = pack_arrays(nbytes, chunk_size_bytes)[0]
    n = int(chunk[-1]) + 1

    def per_chunk(values: np.ndarray, ufunc=np.add) -> list[int]:
        out = np.zeros(n, dtype=np.int64)
        ufunc.at(out, chunk, values)
        return out.tolist()

    tr_numel = numel * trainable
    chunk_of = {name: c for (names, _), c in zip(index.params, chunk.tolist()) for name in names}
    need = min_resident_chunks(model, chunk_of, index.groups)
    table = ChunkTable(
        chunk_size_bytes=chunk_size_bytes,
        used_bytes=per_chunk(nbytes),
        trainable_numel=per_chunk(tr_numel),
        trainable_bytes=per_chunk(nbytes * trainable),
        trainable_tensors=per_chunk(trainable.astype(np.int64)),
        max_trainable_numel=per_chunk(tr_numel, np.maximum),
        min_buffers=max(need, 1),
        tied_head_chunk=tied_head_chunk(model, chunk_of),
        min_buffers_recompute=max(
            min_resident_chunks(model, chunk_of, index.groups, recompute_extra_chunks(False)), 1
        ),
        min_buffers_recompute_tied=max(
            min_resident_chunks(model, chunk_of, index.groups, recompute_extra_chunks(True)), 1
        ),
    )
    return table, chunk_of
