"""The chunk manager: builds chunk storage from a layout and moves offloaded chunks.

Persistent chunks live on the compute device for good. Offloaded chunks live in host memory
(pinned when the device is CUDA) and are gathered into device storage on demand, at most
``n_buffer`` at a time, prefetched ahead of use in execution order (forward) or its reverse
(backward), and released least-recently-used first when room is needed.

On a CPU compute device the same code runs: "device" storage is host memory, copies are
host-to-host and synchronous, and there are no streams or events.

[Note: stream ordering]
``param_gather_stream`` runs host-to-device copies. Before compute uses a chunk, the compute
stream waits on the chunk's ``gathered_event``. Device storage is allocated under the gather
stream, so its blocks belong to that stream: before a chunk's storage is freed, the gather
stream waits on an event recorded on the compute stream at release time, which orders every
use already enqueued before any later copy into the same memory. The host optimizer writes a
chunk's host copy only after that chunk's last copy-in finished (it synchronizes on
``gathered_event``), and a gather of a chunk whose host copy is being updated waits for the
update (``update_future``) before copying.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from protrain.chunks.chunk import Chunk, ChunkState, ParamSlot
from protrain.chunks.layout import ChunkLayout

_registered_host_bytes = 0  # host memory this process pinned with cudaHostRegister, live


def registered_host_bytes() -> int:
    """Host bytes currently pinned by live chunk managers (0 once every engine is closed)."""
    return _registered_host_bytes


class Phase:
    FORWARD = "forward"
    BACKWARD = "backward"


class ChunkManager:
    def __init__(
        self,
        layout: ChunkLayout,
        params: list[tuple[list[str], torch.nn.Parameter]],
        device: torch.device,
        trainable_index: dict[torch.nn.Parameter, int],
    ):
        self.layout = layout
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.n_buffer = layout.n_buffer
        self.chunks: list[Chunk] = []
        self.resident: OrderedDict[int, Chunk] = OrderedDict()  # offloaded, LRU first
        self.phase = Phase.FORWARD
        self.forward_order: list[int] = []  # offloaded chunks in first-use order
        self._order_recorded = False
        self._host_arena: torch.Tensor | None = None
        self._host_arena_pinned = False
        self.param_gather_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.grad_offload_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.stats = {"gathers": 0, "wait_cpu_optimizer_s": 0.0}
        self._copy_wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.time_copy_waits = False
        self._build_storage(params, trainable_index)
        self.offloaded = [c for c in self.chunks if not c.persistent]

    # ---- construction -------------------------------------------------------------------

    def _build_storage(self, params, trainable_index) -> None:
        """Copy every parameter into its chunk and make ``param.data`` a view of it."""
        by_name = {names[0]: p for names, p in params}
        host_bytes = 0
        for spec in self.layout.chunks:
            if not spec.persistent:
                host_bytes += self.layout.chunk_size_bytes
                host_bytes += sum(_staging_nbytes(pl) for pl in spec.placements if pl.trainable)
        if host_bytes:
            # One arena for every host copy and gradient landing place, pinned in place with
            # cudaHostRegister, so that close() can unpin exactly what wrap pinned (memory
            # from pin_memory=True stays cached by torch's host allocator after it is freed).
            self._host_arena = torch.empty(host_bytes, dtype=torch.uint8)
            if self.is_cuda:
                err = torch.cuda.cudart().cudaHostRegister(
                    self._host_arena.data_ptr(), host_bytes, 0
                )
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister of {host_bytes} bytes failed: {err}")
                self._host_arena_pinned = True
                _count_registered(host_bytes)
        arena_off = 0
        for spec in self.layout.chunks:
            c = Chunk(spec, self.layout.chunk_size_bytes, self.device)
            self.chunks.append(c)
            if not c.persistent:
                c.host_buffer = self._host_arena[arena_off : arena_off + c.nbytes]
                arena_off += c.nbytes
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
                if pl.trainable:
                    master_device = self.device if c.persistent else torch.device("cpu")
                    slot.master = src.to(master_device, torch.float32, copy=True)
                    slot.grad_acc = torch.zeros_like(slot.master)
                if c.persistent:
                    slot.device_view.copy_(src)
                else:
                    slot.host_view = c.view(c.host_buffer, pl)
                    slot.host_view.copy_(src)
                    if pl.trainable:
                        n = _staging_nbytes(pl)
                        raw = self._host_arena[arena_off : arena_off + n]
                        slot.grad_staging = raw[: pl.nbytes].view(pl.dtype).view(pl.shape)
                        arena_off += n
                p.data = slot.device_view
                c.slots.append(slot)
            c.drop_build_storage()  # views are made; one offloaded chunk at a time on device
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    # ---- moving chunks ------------------------------------------------------------------

    def use(self, chunk_ids: list[int], pin: bool) -> None:
        """Make chunks resident for compute about to be enqueued; prefetch what comes next."""
        for ci in chunk_ids:
            c = self.chunks[ci]
            if c.persistent:
                continue
            recording = self.phase is Phase.FORWARD and not self._order_recorded
            if recording and ci not in self.forward_order:
                self.forward_order.append(ci)
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
        if self.forward_order:
            self._order_recorded = True
        self.phase = Phase.FORWARD
        for c in self.offloaded:
            c.users = 0
        if self._order_recorded:
            for ci in self.forward_order[: self.n_buffer]:
                self._gather(self.chunks[ci], blocking_update=True, required=False)

    def begin_backward(self) -> None:
        self.phase = Phase.BACKWARD

    def _prefetch_after(self, ci: int, keep: set[int]) -> None:
        """Gather the chunks after ``ci`` in this phase's order, never evicting ``keep``."""
        order = self.forward_order if self._order_recorded else [c.index for c in self.offloaded]
        if self.phase is Phase.BACKWARD:
            order = order[::-1]
        if ci not in order:
            return
        pos = order.index(ci)
        for nxt in order[pos + 1 : pos + self.n_buffer]:
            if not self._gather(self.chunks[nxt], blocking_update=True, required=False, keep=keep):
                break

    def _gather(
        self, c: Chunk, *, blocking_update: bool, required: bool, keep: set[int] = frozenset()
    ) -> bool:
        """Start the copy-in of ``c`` if it is not on the device. False if there is no room."""
        if c.state in (ChunkState.RESIDENT, ChunkState.IN_FLIGHT):
            return True
        if len(self.resident) >= self.n_buffer and not self._evict_one(keep | {c.index}):
            if required:
                raise RuntimeError(
                    f"protrain: no room to gather chunk {c.index}: all n_buffer={self.n_buffer} "
                    f"buffers hold chunks in use by running modules; raise n_buffer"
                )
            return False
        if c.update_future is not None:
            if not blocking_update and not c.update_future.done():
                return False
            t0 = time.perf_counter()
            c.update_future.result()
            self.stats["wait_cpu_optimizer_s"] += time.perf_counter() - t0
            c.update_future = None
        if self.is_cuda:
            with torch.cuda.stream(self.param_gather_stream):
                c._set_state(ChunkState.IN_FLIGHT)
                c.device_buffer[: c.used_bytes].copy_(
                    c.host_buffer[: c.used_bytes], non_blocking=True
                )
                c.gathered_event = self.param_gather_stream.record_event()
        else:
            c._set_state(ChunkState.IN_FLIGHT)
            c.device_buffer[: c.used_bytes].copy_(c.host_buffer[: c.used_bytes])
        self.resident[c.index] = c
        self.stats["gathers"] += 1
        return True

    def _wait_gathered(self, c: Chunk) -> None:
        if c.state is ChunkState.IN_FLIGHT:
            if self.is_cuda:
                stream = torch.cuda.current_stream(self.device)
                if self.time_copy_waits:
                    before = stream.record_event(torch.cuda.Event(enable_timing=True))
                    stream.wait_event(c.gathered_event)
                    after = stream.record_event(torch.cuda.Event(enable_timing=True))
                    self._copy_wait_events.append((before, after))
                else:
                    stream.wait_event(c.gathered_event)
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
        c._set_state(ChunkState.RELEASED)
        self.resident.pop(c.index, None)

    def release_all(self) -> None:
        for c in list(self.resident.values()):
            self._release(c)

    def copy_wait_s(self) -> float:
        """Seconds the compute stream stalled on gathers since the last call (needs sync)."""
        if not self._copy_wait_events:
            return 0.0
        torch.cuda.synchronize(self.device)
        total = sum(a.elapsed_time(b) for a, b in self._copy_wait_events) / 1000.0
        self._copy_wait_events.clear()
        return total

    # ---- slots --------------------------------------------------------------------------

    def slots(self) -> list[ParamSlot]:
        return [s for c in self.chunks for s in c.slots]

    def close(self) -> None:
        """Free device storage and unpin host memory. Parameters must be restored first."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        self.resident.clear()
        for c in self.chunks:
            for s in c.slots:
                s.device_view = s.host_view = s.master = s.grad_acc = s.grad_staging = None
            c.slots.clear()
            c.device_buffer = c.host_buffer = None
            c.gathered_event = c.update_future = None
        if self._host_arena is not None and self._host_arena_pinned:
            torch.cuda.cudart().cudaHostUnregister(self._host_arena.data_ptr())
            _count_registered(-self._host_arena.numel())
        self._host_arena = None
        self._host_arena_pinned = False
        self.param_gather_stream = self.grad_offload_stream = None


def _staging_nbytes(pl) -> int:
    return (pl.nbytes + 63) // 64 * 64


def _count_registered(n: int) -> None:
    global _registered_host_bytes
    _registered_host_bytes += n
