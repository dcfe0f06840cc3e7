"""The collectives the engine issues, in one place.

Every collective of the chunked engine is issued from the thread that runs forward and
backward, in an order that depends only on the model and the knobs (never on timing), so
that every rank issues the same sequence: a gather of a sharded chunk never depends on
whether a host update has finished (see ``ChunkManager._gather``), and gradient buckets are
reduced in the order autograd completes them, which is the same on every rank for the same
graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from protrain.distributed.process_group import DistContext
from protrain.distributed.sharded_state import gather_bytes, gather_fp32, gather_param

# torch 2.13 renamed the tensor-in, tensor-out collectives (the old names warn); the GPU
# hosts run torch 2.11, which has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    """``out``: every rank's ``shard``, in rank order."""
    _all_gather(out, shard, group=group)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group) -> None:
    """``out``: this rank's shard of the sum of every rank's ``full``."""
    _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group)


class ChunkCollectives:
    """The group's collectives on the compute device (NCCL: CUDA tensors; gloo: CPU)."""

    def __init__(self, ctx: DistContext, device: torch.device):
        ctx.check_device(device)
        self.ctx = ctx
        self.device = device
        self.comm_device = device  # check_device: the group's backend serves this device

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    def all_gather_chunk(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """The first ``world_size * len(shard)`` elements of ``out`` (a chunk's span,
        ``chunks/shard.py``; the rest, its padding, is left as it is) from every rank's
        ``shard``, which may be this rank's own slice of ``out`` (in place)."""
        all_gather_into(out[: shard.numel() * self.world_size], shard, self.ctx.group)

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out``: this rank's shard of the sum of every rank's ``full``, of which the first
        ``world_size * len(out)`` elements (a chunk's span) are reduced."""
        reduce_scatter_into(out, full[: out.numel() * self.world_size], self.ctx.group)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.ctx.group)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctx.group)
        return t

    def gather_bytes(self, chunk) -> torch.Tensor:
        return gather_bytes(self, chunk)

    def gather_fp32(self, chunk, fragments: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return gather_fp32(self, chunk, fragments)

    def gather_param(self, chunk, slot, own: torch.Tensor) -> torch.Tensor:
        return gather_param(self, chunk, slot, own)
