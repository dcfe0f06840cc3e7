"""Whole tensors of a sharded chunk, put back together from every rank's shard.

For ``state_dict``, ``close`` and the optimizer's state: each is a collective over the
chunk (every rank calls it for the same chunks in the same order). The parameter bytes come
back with one all-gather of the host shards; fp32 values of the trainable elements (masters,
Adam moments) with one all-gather over the chunk's element space in the compute dtype's
units, where rank ``r``'s shard holds the fp32 values of the elements it owns.
"""

from __future__ import annotations

import torch

from protrain.chunks.chunk import Chunk, ParamSlot
from protrain.chunks.shard import shard_range


@torch.no_grad()
def gather_bytes(coll, chunk: Chunk) -> torch.Tensor:
    """The chunk's whole host copy (uint8, on the CPU) from every rank's host shard
    (``coll``: the group's ``ChunkCollectives``)."""
    comm = coll.comm_device
    shard = chunk.host_buffer.to(comm)
    full = torch.empty(chunk.nbytes, dtype=torch.uint8, device=comm)
    coll.all_gather_chunk(full, shard)
    return full.cpu()


@torch.no_grad()
def gather_fp32(coll, chunk: Chunk, fragments: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """``id(slot) -> whole fp32 tensor`` (the parameter's shape, on the CPU) from each rank's
    ``fragments`` (``id(slot) -> its owned elements``) of the chunk's trainable slots.
    A slot missing from ``fragments`` on this rank contributes zeros."""
    slots = [s for s in chunk.trainable_slots]
    if not slots:
        return {}
    size = slots[0].placement.dtype.itemsize  # trainable parameters: the compute dtype
    sh = chunk.shard
    comm = coll.comm_device
    local = torch.zeros(sh.nbytes // size, dtype=torch.float32)
    for s in slots:
        lo, hi = s.shard
        frag = fragments.get(id(s))
        if hi > lo and frag is not None:
            at = (s.placement.offset_bytes - sh.start) // size + lo
            local[at : at + hi - lo].copy_(frag.reshape(-1))
    full = torch.empty(chunk.nbytes // size, dtype=torch.float32, device=comm)
    coll.all_gather_chunk(full, local.to(comm))
    full = full.cpu()
    out = {}
    for s in slots:
        at = s.placement.offset_bytes // size
        out[id(s)] = full[at : at + s.placement.numel].view(s.placement.shape)
    return out


@torch.no_grad()
def gather_param(coll, chunk: Chunk, slot: ParamSlot, own: torch.Tensor) -> torch.Tensor:
    """One parameter of sharded ``chunk`` put back together on every rank (its shape, on the
    CPU) from each rank's ``own`` elements (``slot.shard``, flat): the masters of a
    trainable one, the host bytes of a frozen one. A collective over the group; only this
    parameter's elements travel (as bytes, whatever the dtype), each rank's run padded to
    the longest (the runs of all ranks are known from the chunk's shard ranges)."""
    pl = slot.placement
    size = own.dtype.itemsize
    world = coll.world_size
    span = chunk.shard.nbytes * world  # the bytes the shards split (chunks/shard.py)
    runs = [shard_range(span, r, world).owned_elements(pl) for r in range(world)]
    longest = max(hi - lo for lo, hi in runs) * size
    comm = coll.comm_device
    mine = own.reshape(-1).view(torch.uint8)
    if mine.numel() == longest and mine.device == comm:
        piece = mine  # no padding to add: sent as it is
    else:
        piece = torch.zeros(longest, dtype=torch.uint8, device=comm)
        piece[: mine.numel()].copy_(mine)
    every = torch.empty(world * longest, dtype=torch.uint8, device=comm)
    coll.all_gather_chunk(every, piece)
    del piece
    whole = torch.empty(pl.numel * size, dtype=torch.uint8)
    at = 0
    for r, (lo, hi) in enumerate(runs):
        n = (hi - lo) * size
        whole[at : at + n].copy_(every[r * longest : r * longest + n])
        at += n
    return whole.view(own.dtype).view(pl.shape)
