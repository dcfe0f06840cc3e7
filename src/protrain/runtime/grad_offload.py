"""Gradient sink: takes each parameter's gradient as soon as autograd has accumulated it.

Called from ``Parameter.register_post_accumulate_grad_hook``, once per parameter per backward
(or once per use under reentrant checkpointing). The low-precision ``param.grad`` is folded
into the fp32 accumulator of the parameter's slot and dropped:

- persistent chunk: copied (into a new fp32 tensor, which ``zero_grad`` frees, so that it
  takes no device memory during forward) or added on the compute device, at once, on the
  compute stream;
- offloaded chunk, first gradient since ``zero_grad``: on ``grad_offload_stream``, its 2-norm
  is taken on the device (for global clipping) and it is cast to fp32 on the device, in
  pieces, and copied straight into the pinned fp32 accumulator. The host does nothing;
- offloaded chunk, later micro-batches: copied in low precision to a pinned landing place
  and added into the accumulator by the CPU worker, which then takes the norm on the host.

On one rank the first gradients of an offloaded chunk are not offloaded one by one but in
batches; see [Note: batched first gradients].

A device-stepped offloaded chunk's gradients (``optim/device_step.py``) take the same path:
its step streams the host accumulator back to the device with the masters and moments, so
no gradient of it stays on the device.

The first gradient is copied rather than added, so accumulation over micro-batches does the
same arithmetic as PyTorch's ``param.grad += grad``; the fp32 cast is exact either side. It
is cast on the device because the host optimizer reads fp32: a bf16 copy would halve the
first gradient's bytes but cost the host a cast pass of about 45% of its AdamW per parameter
([Note: write-back on the device] in chunks/manager.py has the figures).

[Note: gradients for the one pass]
Where the host runs the one-pass AdamW (``optim/host_one_pass.py``), a first gradient of an
offloaded chunk in ``one_pass_chunks`` lands in low precision in ``grad_staging``, not cast
to fp32 into ``grad_acc``: the pass reads it there (2 bytes a parameter instead of 4, and no
fp32 accumulator written). Its norm is taken on the device as before. If a later gradient
comes for it (accumulation), the hook first makes ``grad_acc`` the fp32 value of the landed
one (exact: every bf16 or fp16 value is an fp32 value) and the later gradients are added
there as below, so the sums are torch's. Once a window has accumulated, first gradients of
later windows go to ``grad_acc`` at once, as without the pass (``accumulates``), so that the
conversion runs once; the last backward of a step armed by ``step_in_backward()`` lands
low regardless when it brings the first gradient. A one-pass step unscales and clips as it
reads; the stored gradient keeps its value, and the multipliers are applied to it before a
backward adds onto it (torch changes ``.grad`` in place: ``ParamSlot.grad_pending_mul``).

[Note: reusing a landing place]
A parameter's landing place is reused by its next gradient (next micro-batch); before the
device-to-host copy into it, the previous host accumulation of that parameter must have read
it, so the hook waits on ``slot.accumulate_future`` first. Host work on ``grad_acc`` waits
for the device-to-host copy of the first gradient (``slot.grad_event``). Gradient tensors
are kept alive for the side stream with ``record_stream``. The accumulator itself is read
by the chunk's step task, which every gather of the chunk in the next forward waits for, so
the next step's first copy into it comes after that read; a device-stepped chunk's
accumulator is read by its step's copy-in, which that copy waits for on the stream
(``DeviceStep.grads_read``).

[Note: chunks complete in backward]
For ``HybridAdamW.step_in_backward`` the sink can *watch* groups of slots (the pieces of the
offloaded chunks' host updates): for each, the trainable slots whose gradient has not landed
in this backward. When a group's set empties, every gradient of the group is complete
(autograd accumulates a parameter once per backward, after every node that used it), and the
sink calls the watcher with the group's key, from inside the hook, right after handing off
the last gradient (and the held ones: [Note: batched first gradients]). A piece completes after the backward of its own layers, not of its whole
chunk: the host starts updating a chunk's last layers while the device still computes the
gradients of its first ones. Once a chunk's update has begun in this backward, its later
gradients do not wait for that update (they are what it waits for); the first gradient of a
chunk still waits for the previous step's update, which reads the same accumulators. A slot
that gets a second gradient in the same watched backward (reentrant checkpointing of a
parameter used in two segments, or a watched window with two backwards) is an error: its
piece may already be updating with the first part only.

[Note: batched first gradients]
Offloaded one by one, a first gradient cost the host about 0.5 ms in the hook (events, stream
switch, norm, cast, copy, timing marks: on qlora-70b on an H100, a median of 502 us for each
of 1,120 LoRA parameters a step, 0.58 s of a 2.44 s backward whose kernels ran 1.10 s), while
all their copies took the copy stream 35 ms: the backward was bound by the hook. So on one
rank (the reducer hands several ranks' gradients over already in buckets) a first gradient
of an offloaded chunk is held in ``_pending`` and a batch is offloaded at once by
``flush()``: one wait of the side stream on the compute stream, one stream switch, one copy
timing, one event that becomes every slot's ``grad_event``; per tensor the same norm, cast
and copy as one by one, so the same bits (``stats["grad_batches"]`` counts the batches). A
gradient of over ``_DIRECT_NUMEL`` elements (full fine-tuning's) goes at once, alone: its
host overhead is negligible beside its copy. On the CPU nothing is held (``_HOLD_ON_CPU``):
its copies are synchronous, so there is nothing to amortize.
Every gradient is produced on the compute stream, so one event recorded on it at the flush
orders the whole batch (the engine runs every op that reads a parameter on that stream; a
model whose forward spreads over several streams would need each gradient's own event). Whatever reads ``grad_event``, ``grad_norm`` or ``grad_acc`` sees a
flushed batch: the sink flushes before a watched group completes, before a later gradient of
a held slot, and at the end of every backward (a callback queued on the backward in which
the first gradient was held); the optimizer flushes before it reads gradients, in case a
backward raised before its end. A held gradient's device memory is not in the planner's
peak, so a batch is flushed once it holds ``_BATCH_TENSORS`` tensors or ``_BATCH_NUMEL``
elements.
"""

from __future__ import annotations

import time

import torch
from torch.autograd import Variable

from protrain.chunks.chunk import ParamSlot
from protrain.chunks.copy_times import D2H
from protrain.chunks.manager import ChunkManager, Phase
from protrain.runtime.host_worker import URGENT, HostWorker

_PIECE_NUMEL = 1 << 26  # elements cast to fp32 at a time on the device (256 MiB)
# [Note: batched first gradients]: a larger first gradient is offloaded at once; a batch is
# flushed at this many tensors or elements (held device memory the planner does not count:
# at most about 9M elements, 36 MiB in fp32)
_DIRECT_NUMEL = 1 << 20
# On the CPU a first gradient's copy is synchronous, with no stream or event to amortize, so
# nothing is held there: the planner's CPU traces and runs keep the memory they always had
# (a tiny model's gradients all fall under the caps: held, they put 13% onto the peaks
# its traces measured). Tests set it to run the flush logic on the CPU.
_HOLD_ON_CPU = False
_BATCH_TENSORS = 64
_BATCH_NUMEL = 1 << 23


class GradSink:
    def __init__(self, manager: ChunkManager, worker: HostWorker):
        self.manager = manager
        self.worker = worker
        # With several ranks: the protrain.distributed.GradReducer that reduces gradients
        # chunk by chunk and hands them to ``deliver`` (see [Note: gradient buckets]).
        self.reducer = None
        # protrain.optim.device_step.DeviceStep: the offloaded chunks stepped on the device,
        # whose step reads the host accumulators (None: none)
        self.device_step = None
        self._slot_of = {s.param: s for s in manager.slots() if s.master is not None}
        self._watched: dict[object, set[int]] | None = None  # key -> id(slot) still missing
        self._key_of: dict[int, object] = {}  # id(slot) -> its group's key
        self._landed: set[int] = set()
        self._begun: set[int] = set()  # chunks a group of which completed in this backward
        self._on_complete = None
        # held first gradients: [Note: batched first gradients]
        self._pending: list[tuple[ParamSlot, torch.Tensor]] = []
        self._pending_ids: set[int] = set()
        self._pending_numel = 0
        self._flush_queued_for: int | None = None  # the backward whose end flushes
        # chunks whose first gradients may land in low precision for the host's one-pass
        # AdamW (set by the optimizer; see [Note: gradients for the one pass])
        self.one_pass_chunks: frozenset[int] = frozenset()
        self.accumulates = False  # a window has added a later gradient

    def watch(self, groups: dict[object, list[ParamSlot]], on_complete) -> None:
        """Call ``on_complete(key)`` once each group's slots (of one chunk each) all have
        their gradient in this backward; see [Note: chunks complete in backward]."""
        self.flush()
        self._watched = {k: {id(s) for s in slots} for k, slots in groups.items() if slots}
        self._key_of = {id(s): k for k, slots in groups.items() for s in slots}
        self._landed, self._begun = set(), set()
        self._on_complete = on_complete

    def unwatch(self) -> None:
        self._watched, self._key_of, self._on_complete = None, {}, None
        self._landed, self._begun = set(), set()

    def on_grad_accumulated(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        self.manager.phase = Phase.BACKWARD
        slot = self._slot_of[param]
        try:
            if self.reducer is not None:
                self.reducer.add(slot, grad)
            else:
                self.deliver(slot, grad)
        finally:
            param.grad = None  # also when refused: nothing stale stays

    def deliver(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Fold ``grad`` (the parameter's gradient, or with a sharded chunk the elements
        this rank owns, reduced over ranks) into the slot's accumulator."""
        first = not slot.has_grad
        chunk = self.manager.chunks[slot.chunk]
        if not first and not chunk.persistent and self.manager.discard_offloaded_grads:
            self.manager.ensure_grad_staging()  # raises: see [Note: discarded gradients]
        slot.has_grad = True
        with torch.no_grad():
            if chunk.persistent:
                if first:  # allocated here, freed by zero_grad: no room taken in forward
                    slot.grad_acc = grad.to(torch.float32, copy=True)
                else:
                    slot.grad_acc.add_(grad)
                return
            key = self._landing(slot)
            # the last step's update reads grad_acc (not this step's, begun in this backward)
            if chunk.update_future is not None and slot.chunk not in self._begun:
                self._wait(chunk.update_future)
                chunk.update_future = chunk.update_progress = None
            if first:
                slot.grad_low = self._lands_low(slot)
                slot.grad_pending_mul = None
                if not self._hold(slot, grad):
                    self.flush()  # batches stay in backward order
                    self._offload_first([(slot, grad)])
            else:
                if id(slot) in self._pending_ids:  # its first gradient must land first
                    self.flush()
                if slot.grad_low or slot.grad_pending_mul is not None:
                    self._materialize(slot)
                self._offload_later(slot, grad)
            self._landed_in(key, slot)

    def _lands_low(self, slot: ParamSlot) -> bool:
        """Whether ``slot``'s first gradient lands in low precision for the one pass."""
        if slot.chunk not in self.one_pass_chunks or slot.grad_staging is None:
            return False
        return not self.accumulates or self._watched is not None

    def _materialize(self, slot: ParamSlot) -> None:
        """Before a later gradient is added: ``grad_acc`` holds the gradient so far as torch's
        ``.grad`` would (the landed low-precision one in fp32, then any unscale and clip a
        step applied); see [Note: gradients for the one pass]. On this thread: it runs once
        per window, at the first accumulation."""
        if slot.accumulate_future is not None:
            self._wait(slot.accumulate_future)
            slot.accumulate_future = None
        if slot.grad_event is not None:
            slot.grad_event.synchronize()
        if slot.grad_low:
            self.accumulates = True
        slot.apply_pending()

    def flush(self) -> None:
        """Offload the first gradients held since the last flush, as one batch (see
        [Note: batched first gradients]); nothing to do if none is held."""
        batch, self._pending = self._pending, []
        self._pending_ids, self._pending_numel = set(), 0
        if not batch:
            return
        self.manager.stats["grad_batches"] = self.manager.stats.get("grad_batches", 0) + 1
        try:
            self._offload_first(batch)
        except BaseException:
            # its waits come before any copy, so none landed: no slot may count last step's
            # accumulator as this step's gradient (a caller that catches and steps)
            for slot, _ in batch:
                slot.has_grad = False
            raise

    def _hold(self, slot: ParamSlot, grad: torch.Tensor) -> bool:
        """Hold ``slot``'s first gradient for the next batch; False where it must go at once
        (several ranks, a large gradient, the CPU, no backward running to flush at its end)."""
        if self.reducer is not None or grad.numel() > _DIRECT_NUMEL:
            return False
        if not (self.manager.is_cuda or _HOLD_ON_CPU):
            return False
        task = torch._C._current_graph_task_id()  # -1: not inside a backward
        if task < 0:
            return False
        if task != self._flush_queued_for:  # also after a backward that raised before its end
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._flush_queued_for = task
        self._pending.append((slot, grad))
        self._pending_ids.add(id(slot))
        self._pending_numel += grad.numel()
        if len(self._pending) >= _BATCH_TENSORS or self._pending_numel >= _BATCH_NUMEL:
            self.flush()
        return True

    def _end_of_backward(self) -> None:
        self._flush_queued_for = None
        self.flush()

    def _landing(self, slot: ParamSlot):
        """The watched group ``slot`` belongs to (None if not watched), refusing a second
        gradient of it in a watched backward ([Note: chunks complete in backward])."""
        if self._watched is None:
            return None
        if id(slot) in self._landed:
            raise RuntimeError(
                f"protrain: parameter {slot.name} of chunk {slot.chunk} got a "
                "second gradient in a backward armed by step_in_backward(); arm only "
                "the last backward of an accumulation window, and not with reentrant "
                "checkpointing of a parameter used in two segments"
            )
        self._landed.add(id(slot))
        key = self._key_of.get(id(slot))
        return key if key in self._watched else None

    def _landed_in(self, key, slot: ParamSlot) -> None:
        """``slot``'s gradient is handed off: complete its group if it was the last."""
        if key is None or self._watched is None or key not in self._watched:
            return
        missing = self._watched[key]
        missing.discard(id(slot))
        if not missing:
            del self._watched[key]
            self._begun.add(slot.chunk)
            self.flush()  # the update reads the group's grad_event and grad_acc
            self._on_complete(key)

    def _wait(self, future) -> None:
        t0 = time.perf_counter()
        future.result()
        self.manager.stats["wait_cpu_optimizer_s"] += time.perf_counter() - t0

    def _offload_first(self, batch: list[tuple[ParamSlot, torch.Tensor]]) -> None:
        """Copy first gradients into their slots' accumulators and take their norms (on
        the device: on ``grad_offload_stream``, one event for the batch)."""
        for slot, _ in batch:
            if slot.accumulate_future is not None:
                self._wait(slot.accumulate_future)
                slot.accumulate_future = None
        times = self.manager.copy_times
        if not self.manager.is_cuda:
            for slot, grad in batch:
                dst = slot.grad_staging if slot.grad_low else slot.grad_acc
                with times.span(D2H) as span:
                    span.add(dst.element_size() * grad.numel())
                    dst.copy_(grad)
                # the norm of the fp32 values, as of an fp32 accumulator
                slot.grad_norm = torch.linalg.vector_norm(dst.float())
            return
        stream = self.manager.grad_offload_stream
        stream.wait_event(torch.cuda.current_stream(self.manager.device).record_event())
        if self.device_step is not None:  # the last device step's copy-in of grad_acc
            for chunk in dict.fromkeys(slot.chunk for slot, _ in batch):
                read = self.device_step.grads_read(chunk)
                if read is not None:
                    stream.wait_event(read)
        with torch.cuda.stream(stream):
            for slot, grad in batch:
                slot.grad_norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
            with times.span(D2H, stream) as span:  # the fp32 cast is part of the copy
                for slot, grad in batch:
                    if slot.grad_low:  # as it is: [Note: gradients for the one pass]
                        span.add(grad.numel() * grad.element_size())
                        slot.grad_staging.copy_(grad, non_blocking=True)
                        continue
                    span.add(4 * grad.numel())
                    src, dst = grad.reshape(-1), slot.grad_acc.view(-1)
                    for a in range(0, src.numel(), _PIECE_NUMEL):
                        dst[a : a + _PIECE_NUMEL].copy_(
                            src[a : a + _PIECE_NUMEL].to(torch.float32), non_blocking=True
                        )
            for _, grad in batch:
                grad.record_stream(stream)
            landed = stream.record_event()
        for slot, _ in batch:
            slot.grad_event = landed

    def _offload_later(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        if slot.accumulate_future is not None:
            self._wait(slot.accumulate_future)
        if slot.grad_staging is None:  # the run's first accumulation
            self.manager.ensure_grad_staging()
        done_event = None
        nbytes = grad.numel() * grad.element_size()
        if self.manager.is_cuda:
            stream = self.manager.grad_offload_stream
            stream.wait_event(torch.cuda.current_stream(self.manager.device).record_event())
            with torch.cuda.stream(stream):
                with self.manager.copy_times.span(D2H, stream) as span:
                    span.add(nbytes)
                    slot.grad_staging.copy_(grad, non_blocking=True)
                grad.record_stream(stream)
                done_event = stream.record_event()
        else:
            with self.manager.copy_times.span(D2H) as span:
                span.add(nbytes)
                slot.grad_staging.copy_(grad)
        slot.accumulate_future = self.worker.submit(
            _accumulate, slot, done_event, self.manager.stats, priority=URGENT
        )


def _accumulate(slot: ParamSlot, done_event, stats: dict) -> None:
    """Runs on the CPU worker: add a later micro-batch's gradient, take the norm."""
    if slot.grad_event is not None:
        slot.grad_event.synchronize()
    if done_event is not None:
        done_event.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        slot.grad_acc.add_(slot.grad_staging)
        # Only the value after the last micro-batch is used.
        slot.grad_norm = torch.linalg.vector_norm(slot.grad_acc)
    stats["host_accumulate_s"] = stats.get("host_accumulate_s", 0.0) + time.perf_counter() - t0
