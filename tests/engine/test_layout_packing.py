"""Chunk packing (``chunks.layout.pack_arrays``) against the greedy rule, one step a size."""

from __future__ import annotations

import random

import pytest

from protrain.chunks.layout import ALIGN_BYTES, choose_chunk_size, pack_arrays


def _greedy(sizes: list[int], chunk_size: int) -> list[tuple[int, int]]:
    """The rule written out: a size that does not fit in the rest of the chunk (after the
    aligned end of the one before) starts the next chunk; the first of a chunk always fits."""
    out, chunk, used = [], 0, 0
    align = lambda n: (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES  # noqa: E731
    for n in sizes:
        if used and align(used) + n > chunk_size:
            chunk, used = chunk + 1, 0
        off = align(used)
        out.append((chunk, off))
        used = off + n
    return out


@pytest.mark.parametrize("seed", range(20))
def test_pack_arrays_is_the_greedy_rule(seed):
    rng = random.Random(seed)
    # unaligned and zero sizes, runs of small ones (norms, LoRA factors) between large ones
    sizes = [rng.choice([0, rng.randint(1, 300), rng.randint(1, 5000), rng.randint(4000, 9000)])
             for _ in range(rng.randint(1, 400))]  # fmt: skip
    sizes[0] = max(sizes[0], 1)  # the largest size is positive (a chunk size at least it)
    for chunk_size in (max(sizes), max(sizes) + 63, 2 * max(sizes), 3 * max(sizes) + 1,
                       sum(sizes) + 4096, choose_chunk_size(sizes)):  # fmt: skip
        chunk, offset = pack_arrays(sizes, chunk_size)
        assert list(zip(chunk.tolist(), offset.tolist())) == _greedy(sizes, chunk_size)


def test_a_size_that_fills_the_chunk_exactly_stays_in_it():
    for sizes, chunk_size in (([64, 64], 128), ([100, 28], 192), ([10, 64, 64, 1], 192)):
        chunk, offset = pack_arrays(sizes, chunk_size)
        assert list(zip(chunk.tolist(), offset.tolist())) == _greedy(sizes, chunk_size)
    assert pack_arrays([64, 64], 128)[0].tolist() == [0, 0]
