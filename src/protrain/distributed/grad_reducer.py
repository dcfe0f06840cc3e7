"""Gradients reduced across ranks, chunk by chunk, as backward produces them.

[Note: gradient buckets]
Each chunk with trainable parameters has, during backward, a bucket: a buffer of the chunk's
size in the compute dtype (every trainable parameter is stored in it, so a parameter's
gradient sits at the parameter's own offset). The gradient sink copies each gradient into
its chunk's bucket as autograd completes it; when the chunk's last trainable parameter has
its gradient, the bucket is reduced on ``grad_reduce_stream`` (overlapping the backward of
the layers before it): all-reduced for a replicated chunk (persistent chunks, and every
chunk of the replicated mode), reduce-scattered for a sharded one, so that each rank gets
the sum over ranks of its own shard. The reduced gradients then go down the single-device
path (``GradSink.deliver``): accumulated on the device, or normed and copied to the host.

The sum is what the application wants (its loss is already divided by the tokens of the
whole global batch); ``mean=True`` divides by the world size, as DDP does. Buckets are
zero-filled, so a parameter without a gradient on some rank adds nothing there. A chunk
whose bucket is not complete when backward ends (a parameter used by no node of this
graph) is reduced by a callback at the end of backward, in chunk order on every rank,
together with a mask of which of its parameters got a gradient on any rank: those, and only
those, are delivered, on every rank alike.
"""

from __future__ import annotations

import torch
from torch.autograd import Variable

from protrain.chunks.chunk import ParamSlot


class _Bucket:
    __slots__ = ("flat", "missing", "landed")

    def __init__(self, flat: torch.Tensor, missing: set[int]):
        self.flat = flat
        self.missing = missing
        self.landed: list[ParamSlot] = []


class GradReducer:
    def __init__(self, manager, collectives, deliver, *, mean: bool = False):
        self.manager = manager
        self.collectives = collectives
        self._deliver = deliver
        self._scale = 1.0 / collectives.world_size if mean else None
        self._slots = {c.index: c.trainable_slots for c in manager.chunks if c.trainable_slots}
        self._pending: dict[int, _Bucket] = {}
        self._end_queued = False
        self.grad_reduce_stream = torch.cuda.Stream(manager.device) if manager.is_cuda else None

    def add(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Put ``grad`` in its chunk's bucket; reduce the bucket once it is complete."""
        if not self._end_queued:  # see [Note: gradient buckets]: incomplete buckets
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True
        ci = slot.chunk
        bucket = self._pending.get(ci)
        if bucket is None:
            size = grad.dtype.itemsize
            flat = torch.zeros(
                self.manager.layout.chunk_size_bytes // size, dtype=grad.dtype, device=grad.device
            )
            bucket = self._pending[ci] = _Bucket(flat, {id(s) for s in self._slots[ci]})
        if id(slot) not in bucket.missing:
            raise RuntimeError(
                f"protrain: parameter {slot.name} got a second gradient in one backward while "
                "its chunk's gradients were being reduced across ranks; reentrant checkpointing "
                "of a parameter used in two segments is not supported with several ranks"
            )
        pl = slot.placement
        at = pl.offset_bytes // pl.dtype.itemsize
        with torch.no_grad():
            bucket.flat[at : at + pl.numel].copy_(grad.reshape(-1))
        bucket.missing.discard(id(slot))
        bucket.landed.append(slot)
        if not bucket.missing:
            del self._pending[ci]
            self._reduce(ci, bucket, bucket.landed)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        for ci in sorted(self._pending):
            bucket = self._pending.pop(ci)
            slots = self._slots[ci]
            landed = {id(s) for s in bucket.landed}
            mask = torch.tensor(
                [1.0 if id(s) in landed else 0.0 for s in slots],
                device=self.collectives.comm_device,
            )
            self.collectives.all_reduce_sum(mask)
            got = [s for s, m in zip(slots, mask.tolist()) if m > 0]
            self._reduce(ci, bucket, got)

    @torch.no_grad()
    def _reduce(self, ci: int, bucket: _Bucket, deliver: list[ParamSlot]) -> None:
        stream = self.grad_reduce_stream
        if stream is None:
            self._reduce_now(ci, bucket, deliver)
            return
        compute = torch.cuda.current_stream(self.manager.device)
        stream.wait_stream(compute)
        bucket.flat.record_stream(stream)
        with torch.cuda.stream(stream):
            self._reduce_now(ci, bucket, deliver)
        if self.manager.chunks[ci].persistent:
            # accumulators made on this stream are read by the optimizer on the compute one
            for s in deliver:
                s.grad_acc.record_stream(compute)

    def _reduce_now(self, ci: int, bucket: _Bucket, deliver: list[ParamSlot]) -> None:
        c = self.manager.chunks[ci]
        flat = bucket.flat
        size = flat.dtype.itemsize
        if c.shard is None:
            self.collectives.all_reduce_sum(flat)
            if self._scale is not None:
                flat.mul_(self._scale)
            for s in deliver:
                pl = s.placement
                at = pl.offset_bytes // size
                self._deliver(s, flat[at : at + pl.numel].view(pl.shape))
            return
        sh = c.shard
        out = torch.empty(sh.nbytes // size, dtype=flat.dtype, device=flat.device)
        self.collectives.reduce_scatter_sum(out, flat)
        if self._scale is not None:
            out.mul_(self._scale)
        for s in deliver:
            lo, hi = s.shard
            at = (s.placement.offset_bytes - sh.start) // size + lo
            self._deliver(s, out[at : at + hi - lo])

    def wait(self) -> None:
        """The current stream waits for every reduction enqueued so far."""
        if self.grad_reduce_stream is not None:
            torch.cuda.current_stream(self.manager.device).wait_stream(self.grad_reduce_stream)
