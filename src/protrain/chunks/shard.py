"""Which bytes of a chunk a rank owns in the sharded mode (several ranks: ``protrain.distributed``).

A sharded chunk's *span* is its used bytes (up to the end of its last parameter) rounded up
to ``ALIGN_BYTES * world_size``; the span is split into ``world_size`` equal shards of
``S = span / world`` bytes, rank ``r`` owning ``[r * S, (r + 1) * S)``, and the padding past
the span belongs to no rank. Splitting the span, not the whole chunk, gives every rank the
same share of the parameters (the chunk's padding would otherwise all fall in the last
ranks' shards, and rank 0 would copy, reduce and step up to ``1 / world`` of the chunk more
than the average). Every parameter starts at a multiple of ``ALIGN_BYTES``, so a shard
boundary never splits an element of any dtype: each rank owns a contiguous run of elements
of each parameter it overlaps (possibly none), and the runs of all ranks, in rank order, are
the whole parameter. The same split serves the parameter bytes (all-gather), the gradient
bytes (reduce-scatter in the compute dtype, in which every trainable parameter is stored)
and the fp32 masters and Adam state (the owned elements only).
"""

from __future__ import annotations

from dataclasses import dataclass

from protrain.chunks.layout import ALIGN_BYTES, ParamPlacement


def shard_multiple(world_size: int) -> int:
    """Chunk sizes of the sharded mode are multiples of this."""
    return ALIGN_BYTES * world_size


@dataclass(frozen=True)
class ShardRange:
    """Bytes ``[start, end)`` of a chunk owned by one rank."""

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def owned_elements(self, pl: ParamPlacement) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of ``pl`` (flattened) inside this shard; ``lo == hi``
        when none are."""
        a = max(pl.offset_bytes, self.start)
        b = min(pl.offset_bytes + pl.nbytes, self.end)
        if b <= a:
            return 0, 0
        size = pl.dtype.itemsize
        return (a - pl.offset_bytes) // size, (b - pl.offset_bytes) // size

    def clip_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Byte runs of the chunk intersected with this shard (chunk offsets)."""
        out = []
        for a, b in runs:
            a, b = max(a, self.start), min(b, self.end)
            if a < b:
                out.append((a, b))
        return out


def shard_span(used_bytes: int, chunk_size_bytes: int, world_size: int) -> int:
    """The bytes of a chunk that its shards split: ``used_bytes`` rounded up to
    :func:`shard_multiple` (the chunk size is a multiple of it)."""
    m = shard_multiple(world_size)
    return min(chunk_size_bytes, -(-used_bytes // m) * m)


def shard_range(span_bytes: int, rank: int, world_size: int) -> ShardRange:
    """Rank ``rank``'s shard of a chunk whose span is ``span_bytes`` (:func:`shard_span`)."""
    if span_bytes % shard_multiple(world_size):
        raise ValueError(f"span {span_bytes} is not a multiple of {shard_multiple(world_size)}")
    s = span_bytes // world_size
    return ShardRange(rank * s, (rank + 1) * s)
