"""``World``: the ranks a plan is made for.

A plan is per rank. With several ranks every rank runs the same knobs (their collectives
must match), on its own GPU, and ranks on one host share its memory and cores. What changes
per rank with the mode (``protrain.wrap(distributed_mode=...)``, [Note: sharded chunks] in
``chunks/manager.py``):

- ``sharded``: an offloaded chunk's host copy, fp32 masters, gradient accumulators and Adam
  state are split into ``size`` equal shards; a rank copies its shard to the device and
  all-gathers the rest, reduce-scatters the chunk's gradients and steps its shard on the
  host. Persistent chunks stay whole on every rank, their gradients all-reduced.
- ``replicated``: every chunk is whole on every rank (host memory ``local_size`` times over
  on a host) and every gradient is all-reduced, as DDP does.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("sharded", "replicated")


@dataclass(frozen=True)
class World:
    size: int = 1
    local_size: int = 1  # ranks on this host: they share its memory and cores
    mode: str = "sharded"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not allowed: use one of {MODES}")
        if not 1 <= self.local_size <= self.size:
            raise ValueError(f"local_size={self.local_size} is not in 1..size={self.size}")

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def shards(self) -> int:
        """How many ranks an offloaded chunk's host state is split over."""
        return self.size if self.distributed and self.mode == "sharded" else 1

    @property
    def distributed_mode(self) -> str | None:
        """``protrain.wrap``'s ``distributed_mode`` for this world (None: one rank)."""
        return self.mode if self.distributed else None

    def with_mode(self, mode: str) -> World:
        return World(self.size, self.local_size, mode)


SINGLE = World()
