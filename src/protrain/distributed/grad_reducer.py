"""Gradients reduced across ranks, chunk by chunk, as backward produces them.

[Note: gradient buckets]
Each chunk with trainable parameters has, during backward, a bucket: a buffer of the chunk's
size in the compute dtype (every trainable parameter is stored in it, so a parameter's
gradient sits at the parameter's own offset). The gradient sink copies each gradient into
its chunk's bucket as autograd completes it. Buckets are reduced on ``grad_reduce_stream``
(overlapping the backward of the layers before them): all-reduced for a replicated chunk
(persistent chunks, and every chunk of the replicated mode), reduce-scattered for a
sharded one, so that each rank gets the sum over ranks of its own shard. The reduced
gradients then go down the single-device path (``GradSink.deliver``): accumulated on the
device, or normed and copied to the host.

Every rank must issue the same collectives in the same order, whatever its own batch used,
so buckets are reduced in one fixed order, the same on every rank: chunks from the last to
the first (the order backward completes them). A bucket is reduced once it is complete (its
last trainable parameter has its gradient) and every bucket before it in that order has
been reduced. A bucket still incomplete when backward ends (a parameter used by no node of
this rank's graph: a module that a rank's batch does not use, or that no rank uses), and
every bucket after it, are reduced by a callback at the end of backward, zero-filled where
this rank has no gradient; then one all-reduce of which parameters got a gradient on any
rank decides which of those parameters are delivered, on every rank alike. A parameter
that got a gradient on no rank gets none (``has_grad`` stays false), as in PyTorch. In the
replicated mode ranks may thus run different modules (a batch without images skips the
vision tower); in the sharded mode gathers are collectives too, so every rank must run the
same modules, as with FSDP.

The sum is what the application wants (its loss is already divided by the tokens of the
whole global batch); ``mean=True`` divides by the world size, as DDP does.
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
        self._order = sorted(self._slots, reverse=True)  # the reduction order, every rank's
        self._all_slots = [s for ci in self._order for s in self._slots[ci]]
        self._pending: dict[int, _Bucket] = {}
        self._next = 0  # position in _order of the next bucket to reduce
        self._landed: set[int] = set()  # id(slot) with a gradient in this backward
        self._end_queued = False
        self.grad_reduce_stream = torch.cuda.Stream(manager.device) if manager.is_cuda else None

    def add(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Put ``grad`` in its chunk's bucket; reduce the buckets whose turn has come."""
        if not self._end_queued:  # see [Note: gradient buckets]: incomplete buckets
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True
        ci = slot.chunk
        bucket = self._pending.get(ci)
        if bucket is None:
            bucket = self._pending[ci] = self._new_bucket(ci, grad.dtype, grad.device)
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
        self._landed.add(id(slot))
        while self._next < len(self._order):  # in order: [Note: gradient buckets]
            bucket = self._pending.get(self._order[self._next])
            if bucket is None or bucket.missing:
                break
            del self._pending[self._order[self._next]]
            self._reduce(self._order[self._next], bucket, bucket.landed)
            self._next += 1

    def abandon_backward(self) -> None:
        """Forget a backward that raised before its end: its end-of-backward callback never
        ran, so its unreduced buckets, its place in the reduction order and its landed set
        would carry into the next backward, which then reduced nothing and delivered no
        gradient (a step that changed no weight, or a false "second gradient" error). The
        hooks call this at every forward that begins outside a backward; after a backward
        that ended, there is nothing to forget. Every rank must have raised at the same
        point (otherwise the collectives have already diverged)."""
        self._pending.clear()
        self._next = 0
        self._landed = set()
        self._end_queued = False

    def _new_bucket(self, ci: int, dtype: torch.dtype, device: torch.device) -> _Bucket:
        flat = torch.zeros(self.manager.layout.chunk_size_bytes // dtype.itemsize, dtype=dtype,
                           device=device)  # fmt: skip
        return _Bucket(flat, {id(s) for s in self._slots[ci]})

    def _end_of_backward(self) -> None:
        self._end_queued = False
        rest, self._next = self._order[self._next :], 0
        held = []
        for ci in rest:
            bucket = self._pending.pop(ci, None)
            if bucket is None:  # no gradient of this chunk on this rank: zeros
                dtype = self._slots[ci][0].placement.dtype  # trainable: the compute dtype
                bucket = self._new_bucket(ci, dtype, self.manager.device)
            held.append((ci, self._reduce(ci, bucket, None)))
        landed, self._landed = self._landed, set()
        # issued by every rank at this point, held buckets or not (another rank may have some)
        mask = torch.tensor(
            [1.0 if id(s) in landed else 0.0 for s in self._all_slots],
            device=self.collectives.comm_device,
        )
        got = {id(s) for s, m in zip(self._all_slots, self.collectives.all_reduce_max(mask).tolist())
               if m > 0}  # fmt: skip
        for ci, reduced in held:
            self._in_stream(ci, self._deliver_from, ci, reduced,
                            [s for s in self._slots[ci] if id(s) in got])  # fmt: skip

    @torch.no_grad()
    def _reduce(self, ci: int, bucket: _Bucket, deliver: list[ParamSlot] | None):
        """Reduce ``ci``'s bucket; deliver ``deliver`` from it (None: return the reduced
        tensor, for the caller to deliver from)."""

        def run():
            reduced = self._collective(ci, bucket.flat)
            if deliver is None:
                return reduced
            self._deliver_from(ci, reduced, deliver)
            return None

        if self.grad_reduce_stream is not None:
            bucket.flat.record_stream(self.grad_reduce_stream)
        return self._in_stream(ci, run)

    def _in_stream(self, ci: int, fn, *args):
        """``fn(*args)`` on ``grad_reduce_stream`` after the compute enqueued so far."""
        stream = self.grad_reduce_stream
        if stream is None:
            return fn(*args)
        compute = torch.cuda.current_stream(self.manager.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            out = fn(*args)
        if self.manager.chunks[ci].persistent:
            # accumulators made on this stream are read by the optimizer on the compute one
            for s in self._slots[ci]:
                if s.grad_acc is not None:
                    s.grad_acc.record_stream(compute)
        return out

    def _collective(self, ci: int, flat: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``flat`` (the whole chunk; a sharded chunk: this rank's
        shard of it), divided by the world size with ``mean``."""
        sh = self.manager.chunks[ci].shard
        if sh is None:
            out = self.collectives.all_reduce_sum(flat)
        else:
            out = torch.empty(sh.nbytes // flat.dtype.itemsize, dtype=flat.dtype,
                              device=flat.device)  # fmt: skip
            self.collectives.reduce_scatter_sum(out, flat)
        if self._scale is not None:
            out.mul_(self._scale)
        return out

    @torch.no_grad()
    def _deliver_from(self, ci: int, reduced: torch.Tensor, deliver: list[ParamSlot]) -> None:
        sh = self.manager.chunks[ci].shard
        size = reduced.dtype.itemsize
        for s in deliver:
            pl = s.placement
            if sh is None:
                at = pl.offset_bytes // size
                self._deliver(s, reduced[at : at + pl.numel].view(pl.shape))
            else:
                lo, hi = s.shard
                at = (pl.offset_bytes - sh.start) // size + lo
                self._deliver(s, reduced[at : at + hi - lo])

    def wait(self) -> None:
        """The current stream waits for every reduction enqueued so far."""
        if self.grad_reduce_stream is not None:
            torch.cuda.current_stream(self.manager.device).wait_stream(self.grad_reduce_stream)
