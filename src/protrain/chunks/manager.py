"""The chunk manager: builds chunk storage from a layout and moves offloaded chunks.

Persistent chunks live on the compute device for good. Offloaded chunks live in host memory
(pinned when the device is CUDA) and are gathered into device storage on demand, at most
``n_buffer`` at a time, prefetched ahead of use in execution order (forward) or its reverse
(backward), and released least-recently-used first when room is needed.

On a CPU compute device the same code runs: "device" storage is host memory, copies are
host-to-host and synchronous, and there are no streams or events.

[Note: stream ordering]
``param_gather_stream`` runs host-to-device copies; ``grad_offload_stream`` runs every
device-to-host copy (gradients in backward, the write-back of updated host copies in
forward), so that both PCIe directions work at once. Before compute uses a chunk, the
compute stream waits on the chunk's ``gathered_event``. Device storage is allocated under the
gather stream, so its blocks belong to that stream: before a chunk's storage is freed, the
gather stream waits on an event recorded on the compute stream at release time (and on the
chunk's write-back, if one reads the storage), which orders every use already enqueued
before any later copy into the same memory. The host optimizer writes a chunk's masters only
after that chunk's last copy-in finished (it synchronizes on ``gathered_event``), and a
gather of a chunk whose masters are being updated waits for the update (``update_future``)
before copying; a prefetch never blocks on an update, it leaves the chunk for later.

[Note: gathering an updating chunk]
A host update runs in pieces of a few parameters (see ``HybridAdamW``), and a gather that
needs a chunk whose update is still running copies each parameter's master as soon as the
piece that writes it is done (``Chunk.update_progress``), instead of waiting for the whole
update and then copying the whole chunk. When the forward catches up with the host
optimizer (full fine-tuning, no clipping: it waits for every offloaded chunk in turn), the
copy then hides under the update of the next piece, and only the last piece's copy is
exposed: on a 769 MiB chunk of full-3b, about 5 ms instead of the 28 ms of the chunk's fp32
masters.

[Note: write-back on the device]
The host optimizer's update reaches the device's bf16 (or fp16) chunk in one of two ways.
With the one-pass kernel (``optim/host_one_pass.py``) the update itself writes the rounded
weights into the host copy as it steps (``Chunk.host_updating``), and the next gather copies
the host copy as it is, 2 bytes a parameter, piece by piece as the update writes it ([Note:
gathering an updating chunk]); nothing is cast or written back. With torch's fused AdamW
(the fallback), the update writes fp32 masters only (``Chunk.host_stale``): the first gather
after a step copies the masters (fp32, in pieces of ``_PIECE_NUMEL``) to the device and
casts them into the chunk there, and the device-to-host stream copies the cast parameters
back into the host copy (the trainable byte runs only: frozen bytes never change), which
later gathers of the same step read. Either way the bytes are those of ``.to()``
(round to nearest even). Casting on the device costs link bytes (4 a trainable parameter
in and 2 back) but no host time; a cast as a host pass of its own would cost about 45% of
torch's AdamW per parameter (one thread: 0.5 ns against 1.1), while inside the one pass it
costs nothing measurable (1.14 ns against 1.14). A device-stepped chunk
(``optim/device_step.py``) is cast on the device by its step instead, which copies the bf16
bytes into the host copy: its next gather reads them (after ``note_host_write``'s event),
and writes nothing back.

[Note: the one pass writes the host copy in backward]
An update started from inside a backward (``HybridAdamW.step_in_backward``) marks its
chunk's host copy neither stale nor updating until ``step()``, so a gather later in that
backward (recomputation, a LoRA chunk's frozen weights, a tied embedding) copies the host
copy as it is. torch's path leaves the host copy alone until then; the one pass writes it
while that gather may read it, but only the bytes of parameters whose gradients are
complete (a piece starts once every gradient of it has landed), and nothing later in the
same backward reads those: autograd accumulates a parameter's gradient once, after every
node that uses it (tied weights included), recomputation re-runs the forward of a segment
before that segment's gradients, and frozen bytes are never written. (Reentrant
checkpointing, which hands over a parameter's gradient once per segment, is refused at
the second gradient: [Note: chunks complete in backward] in runtime/grad_offload.py.) What
such a gather reads of those parameters may be half written and is never used: ``step()``
releases every offloaded chunk, and the next gather waits for the update's pieces.

[Note: prefetch by recorded use]
The first step records, per phase, the offloaded chunks in the order they are first used
(recomputation is part of backward) and, for each chunk, how far that order had got when
the chunk was last used (``UseOrder``). Later passes prefetch the ``n_buffer - 1`` chunks
after the furthest point they have reached, and a prefetch never evicts a chunk whose last
use lies at or beyond that point. A block uses its chunks out of order (a Llama layer's
norms run first but are registered last, so the block's last chunk is used first and again
at the end), and backward does not use them in the forward's order reversed: evicting by
recency alone, or protecting only the chunk before the current one, evicted chunks the block
still needed and gathered them again. With 256 MiB chunks of Mistral-7B LoRA (each block
over two chunks, ``n_buffer=3``) that was 220 gathers a step where the runtime model counts
128 (1.36 s a step measured, 0.84 s predicted); on a tiny model of the same shape, 52 where
32 suffice (``tests/engine/test_copy_times.py``). So each offloaded chunk is gathered once
in forward and once in backward, except those resident at the turn and those backward never
uses, as the runtime model counts. A head tied to the embedding uses the first chunk again
at the end of forward: with too few buffers to keep it, one gather more in forward, and
the turn's resident set shifts by one; the runtime model counts these too (its [Note: a
tied head]). The first pass of a phase prefetches in the forward's
recorded order (reversed in backward) or the chunks' own, protecting the chunk before the
current one.

[Note: discarded gradients]
The profiler's traced steps (``protrain.profile.trace``) move every byte a training step
moves but never update an offloaded chunk (``HybridAdamW.step_without_host_updates``), so
nothing reads an offloaded gradient's value: only its 2-norm, taken on the device as it
leaves (on the CPU, right after its copy). With ``discard_offloaded_grads`` every offloaded
gradient accumulator is a view of one shared scratch area the size of the largest one, so
the device-to-host copies write the same bytes to pinned memory as in training while the
arena loses 4 bytes a trainable offloaded parameter (of 10 in bf16 full fine-tuning), the part
of the trace's plan time that goes to touching and pinning fresh host memory. Anything that
would read those values (a host update, an accumulation over micro-batches, a norm other
than the 2-norm) is refused.

[Note: sharded chunks]
With several ranks in the sharded mode (``collectives`` given, ``sharded=True``), every
offloaded chunk's parameter bytes are split into equal shards (``chunks/shard.py``; the
padding after its last parameter belongs to no rank): a rank's host copy, fp32
masters, gradient accumulators and Adam state hold the bytes and elements of its own shard
only. A gather copies the own shard into its place in the device buffer (or, after an
update, the own masters, cast there) and all-gathers the rest from the other ranks into the
same buffer; the write-back after an update writes the own shard only. Persistent chunks
stay whole on every rank (replicated), their gradients all-reduced. Collectives must be
issued in the same order on every rank, so a prefetch of a sharded chunk never depends on
timing: where a single rank would skip a prefetch whose host update is still running, a
sharded one waits for the update.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections import OrderedDict

import torch

from protrain.chunks.chunk import Chunk, ChunkState, ParamSlot
from protrain.chunks.copy_times import D2H, H2D, CopyTimes
from protrain.chunks.layout import ChunkLayout
from protrain.chunks.shard import ShardRange, shard_range, shard_span

_PIECE_NUMEL = 1 << 26  # fp32 elements per master copy-in piece (256 MiB of staging)
_registered_host_bytes = 0  # host memory this process pinned with cudaHostRegister, live


def registered_host_bytes() -> int:
    """Host bytes currently pinned by live chunk managers (0 once every engine is closed)."""
    return _registered_host_bytes


class Phase:
    FORWARD = "forward"
    BACKWARD = "backward"


class UseOrder:
    """The offloaded chunks one phase of a step uses, recorded in the first step that runs
    the phase: their first-use order, and for each chunk the furthest position of that
    order reached when it was last used. The passes after it track how far they are
    (``reached``). See [Note: prefetch by recorded use]."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.position: dict[int, int] = {}
        self.last_needed: dict[int, int] = {}
        self.recorded = False
        self._furthest = -1  # in this pass

    def note(self, ci: int) -> None:
        """Chunk ``ci`` is used now (recorded only in the first pass)."""
        if self.recorded:
            return
        if ci not in self.position:
            self.position[ci] = len(self.order)
            self.order.append(ci)
        self.last_needed[ci] = len(self.order) - 1

    def begin_pass(self) -> None:
        """A new step begins: what the last pass used is the record."""
        self.recorded = self.recorded or bool(self.order)
        self._furthest = -1

    def reached(self, ci: int) -> int | None:
        """The furthest position of the order this pass has reached, now that it uses
        ``ci`` (None: ``ci`` is not in the record)."""
        pos = self.position.get(ci)
        if pos is None:
            return None
        self._furthest = max(self._furthest, pos)
        return self._furthest


class ChunkManager:
    def __init__(
        self,
        layout: ChunkLayout,
        params: list[tuple[list[str], torch.nn.Parameter]],
        device: torch.device,
        trainable_index: dict[torch.nn.Parameter, int],
        *,
        discard_offloaded_grads: bool = False,
        collectives=None,
        sharded: bool = False,
    ):
        self.layout = layout
        # protrain.distributed.ChunkCollectives of the ranks training together (None: one);
        # with ``sharded``, offloaded chunks are split across them ([Note: sharded chunks]).
        self.collectives = collectives
        self.sharded = bool(sharded and collectives is not None)
        # See [Note: discarded gradients]: offloaded gradients all land in one scratch area.
        self.discard_offloaded_grads = discard_offloaded_grads
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.n_buffer = layout.n_buffer
        self.chunks: list[Chunk] = []
        self.resident: OrderedDict[int, Chunk] = OrderedDict()  # offloaded, LRU first
        self.phase = Phase.FORWARD
        # each phase's use of offloaded chunks, recorded in the first step (see [Note:
        # prefetch by recorded use]); forward_order: the forward's first-use order
        self.uses = {Phase.FORWARD: UseOrder(), Phase.BACKWARD: UseOrder()}
        self.forward_order: list[int] = self.uses[Phase.FORWARD].order
        self._host_arena: torch.Tensor | None = None
        self._registered: list[torch.Tensor] = []  # arenas this manager pinned (close unpins)
        self._staging_ready = False  # see ensure_grad_staging
        # chunk -> event after which its host copy and masters hold a device step's result
        # (optim/device_step.py): its next gather copies in after that
        self._host_writes: dict[int, object] = {}
        self.param_gather_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.grad_offload_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.stats = {"gathers": 0, "wait_cpu_optimizer_s": 0.0}
        # bytes and seconds of every copy, and the compute stream's waits for gathers
        # ([Note: reading copy times without a sync] in chunks/copy_times.py)
        self.copy_times = CopyTimes(device, self.stats)
        self._copy_wait_read = 0.0  # wait_copy_s at the last copy_wait_s() call
        # counters kept elsewhere that settle with the copies' (optim/device_step.py)
        self.settle_hooks: list = []
        # Seconds of the build's parts (host arena allocated, pinned; parameters copied in):
        # where a large model's wrap time goes.
        self.build_s: dict[str, float] = {}
        # A sharded chunk keeps only this rank's shard: a failed build gives the parameters
        # their own storage back, since the rest of their values is on other ranks.
        originals = {id(p): p.data for _, p in params} if self.sharded else None
        try:
            self._build_storage(params, trainable_index)
        except BaseException:  # no parameter stays in a half-built chunk
            self.restore_params(originals)
            self.close()
            raise
        self.offloaded = [c for c in self.chunks if not c.persistent]

    # ---- construction -------------------------------------------------------------------

    def _build_storage(self, params, trainable_index) -> None:
        """Copy every parameter into its chunk and make ``param.data`` a view of it."""
        by_name = {names[0]: p for names, p in params}
        t0 = time.perf_counter()
        host_bytes = 0
        size = self.layout.chunk_size_bytes
        shards: dict[int, ShardRange] = {}
        if self.sharded:
            coll = self.collectives
            shards = {
                spec.index: shard_range(
                    shard_span(_end_bytes(spec), size, coll.world_size), coll.rank, coll.world_size
                )
                for spec in self.layout.chunks
                if not spec.persistent
            }

        def owned_numel(spec, pl) -> int:
            sh = shards.get(spec.index)
            if sh is None:
                return pl.numel
            lo, hi = sh.owned_elements(pl)
            return hi - lo

        for spec in self.layout.chunks:
            if not spec.persistent:
                # aligned, so that the views after it start on a 64-byte boundary whatever
                # the chunk size (a view as fp32 needs an offset divisible by 4)
                sh = shards.get(spec.index)
                host_bytes += _align64(size if sh is None else sh.nbytes)
                host_bytes += sum(
                    _host_extra_nbytes(owned_numel(spec, pl), self.discard_offloaded_grads)
                    for pl in spec.placements
                    if pl.trainable
                )
        scratch_bytes = 0
        if self.discard_offloaded_grads:
            scratch_bytes = max(
                (
                    _align64(owned_numel(spec, pl) * 4)
                    for spec in self.layout.chunks
                    if not spec.persistent
                    for pl in spec.placements
                    if pl.trainable
                ),
                default=0,
            )
            host_bytes += scratch_bytes
        t_touched = t0
        if host_bytes:
            # One arena for every host copy, master and gradient accumulator, pinned in place
            # with cudaHostRegister, so that close() can unpin exactly what wrap pinned
            # (memory from pin_memory=True stays cached by torch's host allocator after it is
            # freed). The landing places of accumulated gradients come later, if ever (see
            # ensure_grad_staging).
            self._host_arena = host_arena(host_bytes)
            t_touched = time.perf_counter()
            self._pin(self._host_arena)
        t1 = time.perf_counter()
        arena_off = 0
        scratch = None
        if scratch_bytes:
            scratch = self._host_arena[:scratch_bytes]
            arena_off = scratch_bytes

        def take(nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
            nonlocal arena_off
            view, arena_off = _carve(self._host_arena, arena_off, nbytes, dtype, shape)
            return view

        for spec in self.layout.chunks:
            c = Chunk(spec, self.layout.chunk_size_bytes, self.device)
            self.chunks.append(c)
            c.shard = shards.get(c.index)
            if not c.persistent:
                host_nbytes = c.nbytes if c.shard is None else c.shard.nbytes
                c.host_buffer = self._host_arena[arena_off : arena_off + host_nbytes]
                arena_off += _align64(host_nbytes)
            needs_grad_acc: list[ParamSlot] = []
            for pl in c.spec.placements:
                p = by_name[pl.names[0]]
                src = p.detach()
                slot = ParamSlot(
                    param=p,
                    placement=pl,
                    chunk=c.index,
                    index=trainable_index.get(p, -1),
                    orig_dtype=p.dtype,
                    orig_device=p.device,
                    device_view=c.view(c.device_buffer, pl),
                )
                if c.persistent:
                    if pl.trainable:
                        slot.master = src.to(self.device, torch.float32, copy=True)
                        # Cast from the device copy, so the host weights cross the link
                        # once (pageable: 7-8 GB/s). The same rounding: the fp32 master
                        # holds any bf16, fp16 or fp32 weight exactly.
                        slot.device_view.copy_(slot.master)
                    else:
                        slot.device_view.copy_(src)
                elif c.shard is not None:
                    self._build_shard_slot(c, slot, src, take)
                else:
                    slot.host_view = c.view(c.host_buffer, pl)
                    slot.host_view.copy_(src)
                    if pl.trainable:
                        slot.master = take(pl.numel * 4, torch.float32, pl.shape)
                        slot.master.copy_(src)
                if slot.master is not None and not c.persistent:
                    needs_grad_acc.append(slot)
                p.data = slot.device_view
                c.slots.append(slot)
            # The accumulators after all the chunk's masters: masters back to back, and
            # accumulators too, which the host AdamW steps as flat views ([Note: flat runs]
            # in optim/flat_adamw.py). Not zeroed: a step's first gradient is copied in.
            for slot in needs_grad_acc:
                shape = slot.master.shape
                if scratch is not None:
                    slot.grad_acc, _ = _carve(scratch, 0, slot.master.numel() * 4,
                                              torch.float32, shape)  # fmt: skip
                else:
                    slot.grad_acc = take(slot.master.numel() * 4, torch.float32, shape)
            c.drop_build_storage()  # views are made; one offloaded chunk at a time on device
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.build_s = {
            "host_alloc": round(t_touched - t0, 3),  # mapped and every page written
            "host_pin": round(t1 - t_touched, 3),
            "copy_in": round(time.perf_counter() - t1, 3),
        }

    def _build_shard_slot(self, c: Chunk, slot: ParamSlot, src: torch.Tensor, take):
        """A parameter of a sharded chunk: host copy and master of the elements this rank
        owns, flat (see [Note: sharded chunks]); its accumulator comes after the chunk's
        masters."""
        pl = slot.placement
        lo, hi = c.shard.owned_elements(pl)
        slot.shard = (lo, hi)
        a = pl.offset_bytes + lo * pl.dtype.itemsize - c.shard.start
        slot.host_view = c.host_buffer[a : a + (hi - lo) * pl.dtype.itemsize].view(pl.dtype)
        own = src.reshape(-1)[lo:hi]
        slot.host_view.copy_(own)
        if pl.trainable:
            slot.master = take((hi - lo) * 4, torch.float32, (hi - lo,))
            slot.master.copy_(own)

    # ---- moving chunks ------------------------------------------------------------------

    def use(self, chunk_ids: list[int], pin: bool) -> None:
        """Make chunks resident for compute about to be enqueued; prefetch what comes next."""
        for ci in chunk_ids:
            c = self.chunks[ci]
            if c.persistent:
                continue
            self.uses[self.phase].note(ci)
            self._gather(c, blocking_update=True, required=True, keep=set(chunk_ids))
            self._wait_gathered(c)
            self.resident.move_to_end(ci)
            if pin:
                c.users += 1
        if chunk_ids:
            self._prefetch_after(chunk_ids[-1], keep=set(chunk_ids))

    def unpin(self, chunk_ids: list[int]) -> None:
        for ci in chunk_ids:
            c = self.chunks[ci]
            if not c.persistent and c.users > 0:
                c.users -= 1

    def begin_forward(self) -> None:
        self.copy_times.harvest()  # the copies before this forward, if all are done
        for uses in self.uses.values():
            uses.begin_pass()
        self.phase = Phase.FORWARD
        for c in self.offloaded:
            c.users = 0
        if self.uses[Phase.FORWARD].recorded:
            first = self.forward_order[: self.n_buffer]
            for ci in first:
                c = self.chunks[ci]
                if not self._gather(c, blocking_update=False, required=False, keep=set(first)):
                    break

    def begin_backward(self) -> None:
        self.phase = Phase.BACKWARD

    def _prefetch_after(self, ci: int, keep: set[int]) -> None:
        """Gather the chunks after ``ci`` in this phase's order, never evicting ``keep``."""
        uses = self.uses[self.phase]
        if uses.recorded:
            pos = uses.reached(ci)
            if pos is None:
                return
            order = uses.order
            # never evict a chunk this pass uses again: [Note: prefetch by recorded use]
            later = {i for i in self.resident if uses.last_needed.get(i, -1) >= pos}
        else:  # the first pass of this phase: the forward's order once recorded, else the
            # chunks' own
            recorded = self.uses[Phase.FORWARD].recorded
            order = self.forward_order if recorded else [c.index for c in self.offloaded]
            if self.phase is Phase.BACKWARD:
                order = order[::-1]
            if ci not in order:
                return
            pos = order.index(ci)
            # a block across a chunk boundary alternates between the two
            later = {order[pos - 1]} if pos > 0 else set()
        window = order[pos + 1 : pos + self.n_buffer]
        # A prefetch never evicts a chunk of its own window (needed before the one it
        # brings in), nor one this pass still uses.
        protect = keep | set(window) | {ci} | later
        for nxt in window:
            if not self._gather(self.chunks[nxt], blocking_update=False, required=False,
                                keep=protect):  # fmt: skip
                break

    def _gather(
        self, c: Chunk, *, blocking_update: bool, required: bool, keep: set[int] = frozenset()
    ) -> bool:
        """Start the copy-in of ``c`` if it is not on the device. False if there is no room."""
        if c.state in (ChunkState.RESIDENT, ChunkState.IN_FLIGHT):
            return True
        # An update started in backward (step_in_backward) is not waited for until step()
        # marks the chunk: gathers before then read the weights this backward still uses
        # ([Note: the one pass writes the host copy in backward]).
        updating = c.update_future is not None and (c.host_stale or c.host_updating)
        if c.shard is not None:  # collectives never depend on timing: [Note: sharded chunks]
            blocking_update = True
        if updating and not blocking_update and not c.update_future.done():
            return False
        if len(self.resident) >= self.n_buffer and not self._evict_one(keep | {c.index}):
            if required:
                raise RuntimeError(
                    f"protrain: no room to gather chunk {c.index}: all n_buffer={self.n_buffer} "
                    f"buffers hold chunks in use by running modules; raise n_buffer"
                )
            return False
        if updating and c.update_progress is None:
            self._wait_update(c)
        if self.is_cuda:
            written = self._host_writes.pop(c.index, None)
            if written is not None:
                self.param_gather_stream.wait_event(written)
            with torch.cuda.stream(self.param_gather_stream):
                c._set_state(ChunkState.IN_FLIGHT)
                self._copy_in_or_release(c)
                c.gathered_event = self.param_gather_stream.record_event()
            if c.host_stale:
                d2h = self.grad_offload_stream
                d2h.wait_event(c.gathered_event)
                with torch.cuda.stream(d2h), self.copy_times.span(D2H, d2h) as span:
                    for a, b, h in self._write_back_runs(c):
                        span.add(b - a)
                        c.host_buffer[h : h + b - a].copy_(c.device_buffer[a:b], non_blocking=True)
                    c.host_written_event = d2h.record_event()
        else:
            c._set_state(ChunkState.IN_FLIGHT)
            self._copy_in_or_release(c)
            if c.host_stale:
                with self.copy_times.span(D2H) as span:
                    for a, b, h in self._write_back_runs(c):
                        span.add(b - a)
                        c.host_buffer[h : h + b - a].copy_(c.device_buffer[a:b])
        if c.update_future is not None and updating:  # all pieces copied: surface errors
            try:
                self._wait_update(c)
            except BaseException:  # a failed update: released, raised at every gather
                c._set_state(ChunkState.RELEASED)
                raise
        c.host_stale = c.host_updating = False
        self.resident[c.index] = c
        self.stats["gathers"] += 1
        return True

    def note_host_write(self, ci: int, event) -> None:
        """Chunk ``ci``'s host copy and masters are being written on the device's side
        until ``event`` (a device step, CUDA): its next gather waits for it."""
        self._host_writes[ci] = event

    @staticmethod
    def _write_back_runs(c: Chunk) -> list[tuple[int, int, int]]:
        """``(start, end, host offset)`` of the trainable bytes the host copy keeps."""
        runs = c.byte_runs(trainable=True)
        if c.shard is None:
            return [(a, b, a) for a, b in runs]
        return [(a, b, a - c.shard.start) for a, b in c.shard.clip_runs(runs)]

    def _wait_update(self, c: Chunk, pieces: int | None = None) -> None:
        """Wait for ``c``'s host update: all of it, or its first ``pieces`` pieces."""
        t0 = time.perf_counter()
        if pieces is None or not c.update_progress.wait(pieces):
            c.update_future.result()  # raises the task's error, if it ended with one
            c.update_future = c.update_progress = None
        self.stats["wait_cpu_optimizer_s"] += time.perf_counter() - t0

    def _copy_in_or_release(self, c: Chunk) -> None:
        """``_copy_in``; if the host update it waits for failed, the chunk goes back to
        released (its device storage freed) and the update's error is raised, at this
        gather and at every later one."""
        try:
            self._copy_in(c)
        except BaseException:
            c._set_state(ChunkState.RELEASED)
            raise

    def _copy_in(self, c: Chunk) -> None:
        """Enqueue the copy of ``c`` into its device storage (on the current stream)."""
        with self.copy_times.span(H2D, self.param_gather_stream) as span:
            if c.shard is not None:
                self._copy_in_shard(c, span)
                return
            updating = c.update_future is not None and c.update_progress is not None
            if c.host_updating and updating and not c.update_future.done():
                self._copy_in_updating(c, span)
                return
            if not c.host_stale:
                span.add(c.used_bytes)
                c.device_buffer[: c.used_bytes].copy_(
                    c.host_buffer[: c.used_bytes], non_blocking=self.is_cuda
                )
                return
            # See [Note: write-back on the device] and [Note: gathering an updating chunk].
            for a, b in c.byte_runs(trainable=False):
                span.add(b - a)
                c.device_buffer[a:b].copy_(c.host_buffer[a:b], non_blocking=self.is_cuda)
            waited = -1
            for s in c.trainable_slots:
                if updating and c.update_future is not None:
                    waited = self._wait_piece(c, s.update_piece, waited, span)
                span.add(4 * s.master.numel())
                if not self.is_cuda:
                    s.device_view.copy_(s.master)
                else:
                    master, dev = s.master.view(-1), s.device_view.view(-1)
                    for a in range(0, master.numel(), _PIECE_NUMEL):
                        piece = master[a : a + _PIECE_NUMEL].to(self.device, non_blocking=True)
                        dev[a : a + _PIECE_NUMEL].copy_(piece)

    def _copy_in_updating(self, c: Chunk, span) -> None:
        """The frozen bytes at once, then each trainable parameter's bytes of the host copy
        as soon as the piece of the one-pass update that writes them is done ([Note:
        gathering an updating chunk]); nothing is cast or written back."""
        for a, b in c.byte_runs(trainable=False):
            span.add(b - a)
            c.device_buffer[a:b].copy_(c.host_buffer[a:b], non_blocking=self.is_cuda)
        waited = -1
        for s in c.trainable_slots:
            if c.update_future is not None:
                waited = self._wait_piece(c, s.update_piece, waited, span)
            pl = s.placement
            a, b = pl.offset_bytes, pl.offset_bytes + pl.nbytes
            span.add(b - a)
            c.device_buffer[a:b].copy_(c.host_buffer[a:b], non_blocking=self.is_cuda)

    def _wait_piece(self, c: Chunk, piece: int, waited: int, span) -> int:
        """Wait for the update's pieces up to ``piece`` (``waited``: the last one waited
        for); the copy span pauses before a new piece's wait, which may block the host
        thread ([Note: reading copy times without a sync] in chunks/copy_times.py)."""
        if piece != waited:
            span.pause()
        self._wait_update(c, piece + 1)
        return piece

    def _copy_in_shard(self, c: Chunk, span) -> None:
        """The own shard into its place in the device buffer, then the all-gather of every
        rank's shard (see [Note: sharded chunks]); ``span`` times the copies, not the
        all-gather."""
        sh = c.shard
        own = c.device_buffer[sh.start : sh.end]
        if c.host_updating:  # the one pass writes the host copy: the whole update first
            if c.update_future is not None:
                span.pause()
                self._wait_update(c)
            n = min(sh.end, c.used_bytes) - sh.start
            if n > 0:
                span.add(n)
                own[:n].copy_(c.host_buffer[:n], non_blocking=self.is_cuda)
        elif not c.host_stale:
            # the shard's parameter bytes only: the alignment padding past the chunk's last
            # parameter is never read
            n = min(sh.end, c.used_bytes) - sh.start
            if n > 0:
                span.add(n)
                own[:n].copy_(c.host_buffer[:n], non_blocking=self.is_cuda)
        else:
            updating = c.update_future is not None and c.update_progress is not None
            for a, b in sh.clip_runs(c.byte_runs(trainable=False)):
                span.add(b - a)
                c.device_buffer[a:b].copy_(
                    c.host_buffer[a - sh.start : b - sh.start], non_blocking=self.is_cuda
                )
            waited = -1
            for s in c.trainable_slots:
                if updating and c.update_future is not None:
                    waited = self._wait_piece(c, s.update_piece, waited, span)
                lo, hi = s.shard
                if hi == lo:
                    continue
                span.add(4 * (hi - lo))
                dev = s.device_view.view(-1)[lo:hi]
                if not self.is_cuda:
                    dev.copy_(s.master)
                    continue
                for a in range(0, hi - lo, _PIECE_NUMEL):
                    piece = s.master[a : a + _PIECE_NUMEL].to(self.device, non_blocking=True)
                    dev[a : a + _PIECE_NUMEL].copy_(piece)
        span.pause()
        self.collectives.all_gather_chunk(c.device_buffer, own)

    def _wait_gathered(self, c: Chunk) -> None:
        if c.state is ChunkState.IN_FLIGHT:
            if self.is_cuda:
                self.copy_times.wait(torch.cuda.current_stream(self.device), c.gathered_event)
            c._set_state(ChunkState.RESIDENT)

    def _evict_one(self, keep: set[int]) -> bool:
        """Release the least recently used chunk that is neither pinned nor in ``keep``."""
        for ci, c in self.resident.items():
            if ci not in keep and c.users == 0:
                self._release(c)
                return True
        return False

    def _release(self, c: Chunk) -> None:
        if self.is_cuda:
            # Order every use enqueued so far before any later copy into this memory.
            self.param_gather_stream.wait_event(
                torch.cuda.current_stream(self.device).record_event()
            )
            if c.host_written_event is not None:
                self.param_gather_stream.wait_event(c.host_written_event)
                c.host_written_event = None
        c._set_state(ChunkState.RELEASED)
        self.resident.pop(c.index, None)

    def release_all(self) -> None:
        for c in list(self.resident.values()):
            self._release(c)

    def settle_counters(self) -> None:
        """Count every copy enqueued so far into ``stats`` (synchronizes the device: call
        it between steps; see chunks/copy_times.py)."""
        self.copy_times.settle()
        for hook in self.settle_hooks:
            hook()

    def copy_wait_s(self) -> float:
        """Seconds the compute stream stalled on gathers since the last call (synchronizes
        the device)."""
        self.settle_counters()
        total = self.stats["wait_copy_s"] - self._copy_wait_read
        self._copy_wait_read = self.stats["wait_copy_s"]
        return total

    # ---- slots --------------------------------------------------------------------------

    def slots(self) -> list[ParamSlot]:
        return [s for c in self.chunks for s in c.slots]

    def _pin(self, arena: torch.Tensor) -> None:
        """Page-lock ``arena`` for asynchronous copies (CUDA); close() unpins it."""
        if not self.is_cuda:
            return
        nbytes = arena.numel()
        err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
        self._registered.append(arena)
        _count_registered(nbytes)

    def ensure_grad_staging(self) -> None:
        """Give every offloaded trainable parameter its landing place for the gradients of
        later micro-batches (low precision, pinned), all in one arena, the first time a
        gradient is accumulated. Made on demand: a run that steps after every backward (and
        the profiler's trace) never needs them, which keeps 2 bytes a parameter of bf16
        (17% of full fine-tuning's arena) out of pinned memory; the plan's host-memory
        figure still counts them. The first accumulating backward pays for it (mapped and
        pinned at the measured 14 GiB/s: about 1 s for 8B full fine-tuning)."""
        if self._staging_ready:
            return
        if self.discard_offloaded_grads:
            raise RuntimeError(
                "protrain: this engine discards offloaded gradients (the profiler's wrap: "
                "see [Note: discarded gradients]); it cannot accumulate them over micro-batches"
            )
        slots = [s for c in self.offloaded for s in c.trainable_slots]
        # a sharded chunk's gradients land as the rank's own elements, flat
        shapes = [s.placement.shape if s.shard is None else (s.shard[1] - s.shard[0],)
                  for s in slots]  # fmt: skip
        sizes = [int(torch.Size(sh).numel()) * s.placement.dtype.itemsize
                 for s, sh in zip(slots, shapes)]  # fmt: skip
        nbytes = sum(_align64(n) for n in sizes)
        arena = torch.empty(0, dtype=torch.uint8)  # parameters of no elements alone
        if nbytes:
            arena = host_arena(nbytes)
            self._pin(arena)
        off = 0
        for s, shape, n in zip(slots, shapes, sizes):
            s.grad_staging, off = _carve(arena, off, n, s.placement.dtype, shape)
        self._staging_ready = True

    def restore_params(self, kept: dict[int, torch.Tensor] | None = None) -> None:
        """Every parameter back in storage of its own, on its own device and dtype, with its
        current value (its fp32 master, else its host or device copy); ``kept``: id(param)
        -> a storage to give back as is instead (the caller vouches for its value)."""
        kept = kept or {}
        with torch.no_grad():
            whole = self._gather_sharded_values(kept)
            for s in self.slots():
                s.param.grad = None
                if id(s.param) in kept:
                    s.param.data = kept[id(s.param)]
                    continue
                if id(s) in whole:
                    s.param.data = whole[id(s)].to(s.orig_device, s.orig_dtype, copy=True)
                    continue
                src = s.master
                if src is None:
                    src = s.host_view if s.host_view is not None else s.device_view
                s.param.data = src.to(s.orig_device, s.orig_dtype, copy=True)

    def _gather_sharded_values(self, kept: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``id(slot) -> whole value`` (the fp32 master of a trainable parameter, else its
        bytes) of every parameter of a sharded chunk not in ``kept``: a collective."""
        out: dict[int, torch.Tensor] = {}
        for c in self.chunks:
            if c.shard is None or c.host_buffer is None:
                continue
            slots = [s for s in c.slots if id(s.param) not in kept]
            if not slots:
                continue
            out.update(self.whole_values(c))
        return out

    def whole_values(self, c: Chunk, masters: bool = True) -> dict[int, torch.Tensor]:
        """Every parameter of sharded chunk ``c`` put back together, on the CPU:
        ``id(slot) -> tensor`` (trainable ones as their fp32 masters with ``masters``, else
        in the storage dtype). A collective: every rank calls it for the same chunks."""
        full = self.collectives.gather_bytes(c)
        out = {id(s): full[s.placement.offset_bytes : s.placement.offset_bytes + s.placement.nbytes]
               .view(s.placement.dtype).view(s.placement.shape) for s in c.slots}  # fmt: skip
        if masters:
            out.update(
                self.collectives.gather_fp32(c, {id(s): s.master for s in c.trainable_slots})
            )
        return out

    def close(self) -> None:
        """Free device storage and unpin host memory. Parameters must be restored first."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        self.resident.clear()
        self._host_writes.clear()
        for c in self.chunks:
            for s in c.slots:
                s.device_view = s.host_view = s.master = s.grad_acc = s.grad_staging = None
            c.slots.clear()
            c.device_buffer = c.host_buffer = None
            c.gathered_event = c.update_future = c.host_written_event = None
        for arena in self._registered:
            torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
            _count_registered(-arena.numel())
        self._registered = []
        self._host_arena = None
        self.copy_times.close()
        self.settle_hooks = []
        self.param_gather_stream = self.grad_offload_stream = None


def host_arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed host memory on 2 MiB pages where the kernel allows, every page
    already faulted in (ready to pin).

    Written by hand because neither torch allocator does this: ``cudaHostRegister`` of a fresh
    ``torch.empty`` ran at 1.8 GiB/s on the H100 host (the driver faults in and pins 4 KiB
    pages one at a time), ``pin_memory=True`` at 2.7; an anonymous mapping advised
    ``MADV_HUGEPAGE``, touched with torch's threads, then registered, at 14 GiB/s
    (``benchmarks/host_pinning.py``, 16 GiB; the hosts' transparent huge pages are
    ``madvise``). The mapping lives as long as any view of the tensor; a forked child
    process does not have it."""
    # Private: Python's default for an anonymous mapping is MAP_SHARED, which Linux backs
    # with shmem, where transparent huge pages are off by default (shmem_enabled=never):
    # such a mapping pins at the 4 KiB pages' rate.
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: torch's own allocation
        return torch.zeros(nbytes, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere plain pages
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            mm.madvise(mmap.MADV_HUGEPAGE)
    if hasattr(mmap, "MADV_DONTFORK"):
        # A forked child (a DataLoader worker) does not inherit the arena: Linux copies
        # DMA-pinned private pages into the child at fork instead of sharing them, tens of
        # GB per worker. Only the engine in the parent reads it: engine state (state_dict,
        # the optimizer) is not readable in a forked child.
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_DONTFORK)
    arena = torch.frombuffer(mm, dtype=torch.uint8)
    # One write per page faults every page in, on torch's threads; the kernel zero-fills
    # them, so a full zero_ would only write all of it a second time (full-8b's 70 GB
    # arena: 8 s to map and touch with zero_).
    arena[:: mmap.PAGESIZE].zero_()
    return arena


def _carve(arena: torch.Tensor, off: int, nbytes: int, dtype: torch.dtype, shape):
    """The view of ``nbytes`` of ``arena`` at ``off`` as ``dtype`` and ``shape``, and the
    offset after it, aligned so that any next view starts on a 64-byte boundary."""
    return arena[off : off + nbytes].view(dtype).view(shape), off + _align64(nbytes)


def _end_bytes(spec) -> int:
    """Where a chunk's last parameter ends (``Chunk.used_bytes``; a ``ChunkSpec``'s
    ``used_bytes`` leaves out the alignment gaps between its parameters)."""
    return max((pl.offset_bytes + pl.nbytes for pl in spec.placements), default=0)


def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


def _host_extra_nbytes(numel: int, discard_grads: bool = False) -> int:
    """Pinned host bytes of a trainable offloaded parameter (``numel`` elements of it on
    this rank) beyond its host copy, in the arena wrap makes: the fp32 master and the fp32
    gradient accumulator (the low-precision landing place comes with the first
    accumulation: ``ensure_grad_staging``; with discarded gradients the accumulator is a
    view of the shared scratch area)."""
    return (1 if discard_grads else 2) * _align64(numel * 4)


def _count_registered(n: int) -> None:
    global _registered_host_bytes
    _registered_host_bytes += n
