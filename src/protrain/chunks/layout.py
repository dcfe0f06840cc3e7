"""Chunk layout: which parameter lives at which byte offset of which chunk.

The layout is a plain value computed from a list of parameters in execution order. It moves
nothing; :mod:`protrain.chunks.manager` builds storage from it.

Parameters are packed greedily, in order, into equal-size chunks of bytes; a parameter that
does not fit in the rest of the current chunk starts the next one. One chunk may hold
tensors of several dtypes (each placed at an offset aligned to ``ALIGN_BYTES``). A parameter
shared by several modules (tied embeddings) is placed once, under all of its names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

# Offsets are multiples of this, so that every view is aligned for vectorized kernels.
ALIGN_BYTES = 64
# Candidate chunk sizes tried when none is given: the largest parameter times 1, 1 + 1/16, ...
# up to 2. Larger chunks waste fewer bytes at the end of each chunk but move in coarser steps.
_CANDIDATE_STEPS = 16
# A floating parameter with this attribute set to True is stored in its own dtype, not the
# compute dtype (the fp32 scales of 4-bit weights: protrain.quant.four_bit).
KEEP_DTYPE_ATTR = "protrain_keep_dtype"


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass
class ParamPlacement:
    """One parameter's place in a chunk (in the compute dtype it is stored in)."""

    names: list[str]
    chunk: int
    offset_bytes: int
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class ChunkSpec:
    index: int
    persistent: bool
    placements: list[ParamPlacement] = field(default_factory=list)

    @property
    def used_bytes(self) -> int:
        return sum(p.nbytes for p in self.placements)

    @property
    def param_names(self) -> list[str]:
        return [p.names[0] for p in self.placements]


@dataclass
class ChunkLayout:
    """Where every parameter lives. A plain value: knobs and per-chunk contents."""

    chunk_size_bytes: int
    n_persist: int
    n_buffer: int
    chunks: list[ChunkSpec]
    compute_dtype: torch.dtype
    device: str

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def n_offloaded(self) -> int:
        return self.n_chunks - self.n_persist

    @property
    def wasted_bytes(self) -> int:
        return self.n_chunks * self.chunk_size_bytes - sum(c.used_bytes for c in self.chunks)

    def __str__(self) -> str:
        mib = 1 << 20
        lines = [
            f"ChunkLayout: {self.n_chunks} chunks of {self.chunk_size_bytes / mib:.2f} MiB "
            f"on {self.device}, compute {str(self.compute_dtype).removeprefix('torch.')}; "
            f"n_persist={self.n_persist}, n_buffer={self.n_buffer}, "
            f"wasted {self.wasted_bytes / mib:.2f} MiB"
        ]
        for c in self.chunks:
            names = c.param_names
            shown = ", ".join(names[:3]) + (
                f", ... ({len(names)} params)" if len(names) > 3 else ""
            )
            where = "persistent" if c.persistent else "offloaded"
            lines.append(
                f"  chunk {c.index:3d} {where:10s} {c.used_bytes / mib:9.2f} MiB used: {shown}"
            )
        return "\n".join(lines)


def _pack(sizes: list[int], chunk_size_bytes: int) -> list[tuple[int, int]]:
    """(chunk index, offset) for each size, greedy in order."""
    chunk, offset = pack_arrays(sizes, chunk_size_bytes)
    return list(zip(chunk.tolist(), offset.tolist()))


def pack_arrays(sizes, chunk_size_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk index and byte offset of each size (bytes, each at most ``chunk_size_bytes``),
    packed greedily in order: a size that does not fit in the rest of the current chunk
    starts the next one, each offset aligned to ``ALIGN_BYTES``.

    One array search per chunk instead of a Python step per parameter: the planner packs
    every candidate chunk size (a 70B QLoRA model has 1,843 tensors; its 22 packings were a
    sixth of its search on the GPU host). In a chunk starting at parameter ``s``, parameter ``i`` lies at
    ``A[i] - A[s]`` (``A``: the prefix sums of the aligned sizes) and fits while
    ``A[i] + size[i] <= A[s] + chunk_size_bytes``; the left side never decreases in ``i``."""
    n = np.asarray(sizes, dtype=np.int64)
    aligned = (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
    start = np.concatenate([[0], np.cumsum(aligned)])[:-1]  # A
    end = start + n
    chunk = np.empty(len(n), dtype=np.int64)
    offset = np.empty(len(n), dtype=np.int64)
    s, c = 0, 0
    while s < len(n):
        e = max(int(np.searchsorted(end, start[s] + chunk_size_bytes, side="right")), s + 1)
        chunk[s:e] = c
        offset[s:e] = start[s:e] - start[s]
        s, c = e, c + 1
    return chunk, offset


def choose_chunk_size(sizes: list[int]) -> int:
    """Chunk size that wastes the fewest bytes among the candidates (ties: the smaller)."""
    largest = _align(max(sizes))
    best, best_waste, total = largest, None, sum(sizes)
    for k in range(_CANDIDATE_STEPS + 1):
        size = _align(largest + largest * k // _CANDIDATE_STEPS)
        n_chunks = int(pack_arrays(sizes, size)[0][-1]) + 1
        waste = n_chunks * size - total
        if best_waste is None or waste < best_waste:
            best, best_waste = size, waste
    return best


def storage_dtype(param: torch.Tensor, compute_dtype: torch.dtype) -> torch.dtype:
    """Floating parameters are stored in the compute dtype; others (quantized weights) and
    those marked to keep their dtype (the fp32 scales of quantized weights, see
    :mod:`protrain.quant.four_bit`) as they are."""
    if not param.is_floating_point() or getattr(param, KEEP_DTYPE_ATTR, False):
        return param.dtype
    return compute_dtype


def plan_layout(
    named_params: list[tuple[list[str], torch.nn.Parameter]],
    *,
    compute_dtype: torch.dtype,
    device: torch.device,
    n_persist: int | None,
    n_buffer: int | None,
    chunk_size_bytes: int | None,
    min_buffers: int = 1,
    size_multiple: int = 1,
) -> ChunkLayout:
    """Pack parameters (in execution order, each once, with all its names) into chunks.

    ``min_buffers`` is the number of offloaded chunks some single module needs at once; the
    knobs are checked against it here, before anything is moved. ``size_multiple``: the chunk
    size is rounded up to a multiple of it (the sharded mode splits every chunk into equal,
    aligned shards: ``protrain.distributed.sharding``).
    """
    if not named_params:
        raise ValueError("protrain.wrap: the model has no parameters to place in chunks")
    sizes = [p.numel() * storage_dtype(p, compute_dtype).itemsize for _, p in named_params]
    largest = max(sizes)
    if chunk_size_bytes is None:
        chunk_size_bytes = choose_chunk_size(sizes)
    elif not isinstance(chunk_size_bytes, int) or chunk_size_bytes < largest:
        raise ValueError(
            f"chunk_size_bytes={chunk_size_bytes!r} is too small: it must be an int of at least "
            f"{largest} bytes, the largest parameter in the compute dtype"
        )
    chunk_size_bytes = -(-chunk_size_bytes // size_multiple) * size_multiple
    packed = _pack(sizes, chunk_size_bytes)
    n_chunks = packed[-1][0] + 1
    if n_persist is None:
        n_persist = n_chunks
    if not isinstance(n_persist, int) or not 0 <= n_persist <= n_chunks:
        raise ValueError(
            f"n_persist={n_persist!r} is not allowed: it must be an int from 0 to {n_chunks}, "
            f"the number of chunks of {chunk_size_bytes} bytes this model packs into"
        )
    n_offloaded = n_chunks - n_persist
    needed = min(n_offloaded, max(min_buffers, 2))
    if n_buffer is None:
        n_buffer = min(n_offloaded, max(needed, 3))
    if not isinstance(n_buffer, int) or n_buffer < needed or n_buffer < 0:
        raise ValueError(
            f"n_buffer={n_buffer!r} is not allowed: with {n_offloaded} offloaded chunks it must "
            f"be an int of at least {needed} (one module needs {min_buffers} offloaded chunk(s) "
            f"at once, and backward needs 2 when 2 or more chunks are offloaded)"
        )
    n_buffer = min(n_buffer, n_offloaded)

    chunks = [ChunkSpec(index=i, persistent=i < n_persist) for i in range(n_chunks)]
    for (names, p), (ci, off) in zip(named_params, packed):
        chunks[ci].placements.append(
            ParamPlacement(
                names=list(names),
                chunk=ci,
                offset_bytes=off,
                numel=p.numel(),
                shape=tuple(p.shape),
                dtype=storage_dtype(p, compute_dtype),
                trainable=p.requires_grad,
            )
        )
    return ChunkLayout(
        chunk_size_bytes=chunk_size_bytes,
        n_persist=n_persist,
        n_buffer=n_buffer,
        chunks=chunks,
        compute_dtype=compute_dtype,
        device=str(device),
    )


def params_in_order(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each parameter once, with all its names, in module registration order.

    Registration order is execution order for the models this engine targets (embeddings,
    blocks, final norm, head); where it is not, only prefetch locality suffers: the runtime
    gathers whatever a module needs, and prefetches in the chunk order it observed in the
    first forward.
    """
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return [(names[k], params[k]) for k in params]
