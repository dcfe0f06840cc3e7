"""The order in which training rows are visited, and the position a checkpoint resumes from.

The stream of micro-batches runs across epochs: epoch `e` visits a permutation of the rows
drawn from a generator seeded with `seed + e`, cut into micro-batches (the last one may be
short). A position is `(epoch, micro_batch)`, so a resumed run reproduces the exact batches
that the uninterrupted run would have seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class StreamPosition:
    epoch: int = 0
    micro_batch: int = 0  # micro-batches already consumed in `epoch`


class MicroBatchStream:
    def __init__(self, n_rows: int, micro_batch_size: int, seed: int, shuffle: bool = True):
        if n_rows <= 0:
            raise ValueError("the training dataset is empty")
        self.n_rows = n_rows
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.shuffle = shuffle

    @property
    def micro_batches_per_epoch(self) -> int:
        return math.ceil(self.n_rows / self.micro_batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n_rows))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n_rows, generator=generator).tolist()

    def iterate(self, start: StreamPosition) -> Iterator[tuple[StreamPosition, list[int]]]:
        """Yield (position after this micro-batch, row indices) forever, from `start`."""
        epoch, index = start.epoch, start.micro_batch
        while True:
            order = self.epoch_order(epoch)
            mbs = self.micro_batch_size
            while index < self.micro_batches_per_epoch:
                rows = order[index * mbs : (index + 1) * mbs]
                index += 1
                yield StreamPosition(epoch, index), rows
            epoch, index = epoch + 1, 0

    def fractional_epoch(self, position: StreamPosition) -> float:
        return position.epoch + position.micro_batch / self.micro_batches_per_epoch
