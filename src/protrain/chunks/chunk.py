"""One chunk: a byte buffer on the compute device, its host copy, and its parameters' slots.

Every parameter placed in a chunk becomes a permanent view into the chunk's device buffer
(``param.data`` is set once, at wrap time). Releasing an offloaded chunk frees the buffer's
storage (``untyped_storage().resize_(0)``) and gathering it allocates the storage again and
copies the host bytes in.

[Note: why storage is resized instead of swapped between pool buffers]
Autograd saves views of parameters for backward (``F.linear`` saves ``weight.t()``), and such
a view keeps pointing at the storage object it was made from. If a released chunk were
re-gathered into a different buffer, the saved view would read whatever now lives in the old
buffer. Resizing the one storage object per chunk in place (as FSDP does) keeps every saved
view valid after a re-gather. The pool of ``n_buffer`` buffers is therefore a count of chunks
resident at once; the memory itself comes from the caching allocator, which hands the freed,
equal-size blocks straight back.

The chunk's state changes in one place, :meth:`Chunk._set_state`.
"""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from protrain.chunks.layout import ChunkSpec, ParamPlacement
from protrain.chunks.shard import ShardRange


class ChunkState(enum.Enum):
    ON_HOST = "on_host"  # offloaded chunk, never gathered since wrap or since its last update
    IN_FLIGHT = "in_flight"  # host-to-device copy issued on the gather stream
    RESIDENT = "resident"  # device bytes valid (persistent chunks are always here)
    RELEASED = "released"  # device storage freed after use; the host copy is the truth


_ALLOWED = {
    ChunkState.ON_HOST: {ChunkState.IN_FLIGHT},
    ChunkState.IN_FLIGHT: {ChunkState.RESIDENT, ChunkState.RELEASED},
    ChunkState.RESIDENT: {ChunkState.RELEASED},
    ChunkState.RELEASED: {ChunkState.IN_FLIGHT, ChunkState.ON_HOST},
}


@dataclass(eq=False, repr=False)
class ParamSlot:
    """One parameter's storage in every place it lives.

    ``device_view``: the parameter's bytes in the chunk's device buffer (``param.data``).
    ``host_view``: the same bytes in the host copy (offloaded chunks only).
    ``master``: fp32 master weight (trainable only; on the device for persistent chunks, in
    pinned host memory for offloaded ones); ``grad_acc`` the fp32 gradient accumulated across
    micro-batches, next to it (on the device only from the first gradient to ``zero_grad``).
    ``grad_staging``: pinned host landing place of a low-precision gradient of a later
    micro-batch, added into ``grad_acc`` on the host (offloaded trainable only, made at the
    run's first accumulation, or with the one-pass host AdamW at the start, by
    ``ChunkManager.ensure_grad_staging``). The first micro-batch's gradient lands in
    ``grad_acc`` directly, as fp32, or for the one pass in ``grad_staging`` as it is
    (``grad_low``); ``landed_grad()`` reads it wherever it is.
    """

    param: torch.nn.Parameter
    placement: ParamPlacement
    chunk: int
    index: int  # position in the optimizer's parameter order (trainable) else -1
    orig_dtype: torch.dtype
    orig_device: torch.device
    device_view: torch.Tensor
    host_view: torch.Tensor | None = None
    master: torch.Tensor | None = None
    grad_acc: torch.Tensor | None = None
    grad_staging: torch.Tensor | None = None
    has_grad: bool = False  # a gradient was accumulated since the last zero_grad
    grad_norm: torch.Tensor | None = None  # norm of grad_acc after the latest accumulation
    accumulate_future: Future | None = None  # host accumulation of the latest gradient
    grad_event: object = None  # device-to-host copy of the first gradient done (landed_grad)
    update_piece: int = 0  # which piece of its chunk's host update writes this master
    # The gradient since zero_grad is one backward's, in grad_staging as it landed (low
    # precision), not in grad_acc: the host's one-pass AdamW reads it there (see [Note:
    # gradients for the one pass] in runtime/grad_offload.py).
    grad_low: bool = False
    # (inverse loss scale, clip coefficient) a one-pass step applied to this gradient as it
    # read it, not to the stored gradient; torch's unscale_ and clip change .grad in place,
    # so a backward before zero_grad adds onto the changed gradient: the sink applies them
    # first. None: nothing pending.
    grad_pending_mul: tuple[float | None, float | None] | None = None
    # Sharded chunks (protrain.distributed.sharding): the elements [lo, hi) of the flattened
    # parameter this rank owns; host_view, master and grad_acc hold those elements only.
    shard: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        return self.placement.names[0]

    def __repr__(self) -> str:
        # Names and shapes only: a released chunk's parameter views storage of size 0, and
        # reading its elements (as a default dataclass repr would) reads freed memory.
        shape = tuple(self.device_view.shape)
        return f"ParamSlot({self.name!r}, shape={shape}, chunk={self.chunk}, index={self.index})"

    def landed_grad(self) -> torch.Tensor:
        """An offloaded slot's gradient since ``zero_grad`` in fp32, where it landed: the
        low-precision one in ``grad_staging`` (a copy, exact) or ``grad_acc``; without any
        multiplier a one-pass step applied as it read it (``grad_pending_mul``). Only once
        it has landed (``grad_event``)."""
        return self.grad_staging.float() if self.grad_low else self.grad_acc

    def apply_pending(self) -> None:
        """Make ``grad_acc`` the gradient as torch's ``.grad`` holds it now (``fold_grad``
        of the slot's own marks) and clear the marks: a backward adds onto it next."""
        self.fold_grad(self.grad_low, self.grad_pending_mul)
        self.grad_low = False
        self.grad_pending_mul = None

    def fold_grad(self, low: bool, multipliers: tuple[float | None, float | None] | None) -> None:
        """``grad_acc`` as torch's ``.grad`` after a one-pass step: the landed low-precision
        gradient in fp32 where ``low`` (exact), then each of ``multipliers`` (inverse loss
        scale, clip coefficient; None: not applied) in that order. The marks are passed, not
        read: the one pass reads them as fixed when its step was queued
        (``optim/host_one_pass.py``)."""
        if low:
            self.grad_acc.copy_(self.grad_staging)
        for factor in multipliers or ():
            if factor is not None:
                self.grad_acc.mul_(factor)


class UpdateProgress:
    """One host update of a chunk, shared between the host worker, which runs it as piece
    tasks and marks each piece done, and a gather, which copies each piece's masters as soon
    as it is written (see [Note: gathering an updating chunk] in ``chunks/manager.py``).

    Pieces may finish in any order (started in backward they become ready last piece
    first); ``wait(k)`` waits for the first ``k`` pieces. ``future`` completes when every
    piece is done, or with the first piece's error."""

    def __init__(self, n_pieces: int) -> None:
        self._cond = threading.Condition()
        self._done: set[int] = set()
        self._prefix = 0  # pieces 0 .. _prefix-1 are all done
        self._n = n_pieces
        self._over = False  # every piece done, or one failed (the future carries its error)
        self.future: Future = Future()
        if n_pieces == 0:
            self._over = True
            self.future.set_result(None)

    def advance(self, piece: int) -> None:
        with self._cond:
            self._done.add(piece)
            while self._prefix in self._done:
                self._prefix += 1
            finished = len(self._done) == self._n and not self._over
            if finished:
                self._over = True
            self._cond.notify_all()
        if finished:
            self.future.set_result(None)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            first = not self._over
            self._over = True
            self._cond.notify_all()
        if first:
            self.future.set_exception(error)

    @property
    def failed(self) -> bool:
        return self.future.done() and self.future.exception() is not None

    def wait(self, pieces: int) -> bool:
        """Block until the first ``pieces`` pieces are done; False if the update ended
        (by an error) before that."""
        with self._cond:
            self._cond.wait_for(lambda: self._prefix >= pieces or self._over)
            return self._prefix >= pieces


class Chunk:
    def __init__(self, spec: ChunkSpec, chunk_size_bytes: int, device: torch.device):
        self.spec = spec
        self.index = spec.index
        self.persistent = spec.persistent
        self.nbytes = chunk_size_bytes
        self.used_bytes = max((p.offset_bytes + p.nbytes for p in spec.placements), default=0)
        self.device_buffer = torch.empty(chunk_size_bytes, dtype=torch.uint8, device=device)
        self.host_buffer: torch.Tensor | None = None  # set by the manager for offloaded chunks
        self.slots: list[ParamSlot] = []
        self.state = ChunkState.RESIDENT if self.persistent else ChunkState.ON_HOST
        self.users = 0  # modules between their forward pre- and post-hook
        self.gathered_event = None  # gather stream event: host-to-device copy done
        self.update_future: Future | None = None  # host optimizer step writing the masters
        self.update_progress: UpdateProgress | None = None  # its pieces done so far
        # After a host step the fp32 masters are newer than the host copy: the next gather
        # copies the masters in and casts on the device, then writes the host copy back.
        self.host_stale = False
        self.host_written_event = None  # device-to-host write-back of the host copy done
        # The host update writes the host copy itself (the one-pass AdamW): the next gather
        # copies each piece's trainable bytes as soon as the piece is written, casts nothing
        # and writes nothing back (see [Note: write-back on the device] in manager.py).
        self.host_updating = False
        self._byte_runs: dict[bool, list[tuple[int, int]]] = {}  # slots are fixed once made
        # Set by the manager for an offloaded chunk of the sharded mode: the bytes this rank
        # owns (its host copy holds those bytes alone).
        self.shard: ShardRange | None = None

    def drop_build_storage(self) -> None:
        """After the parameter views are made: an offloaded chunk starts with no device bytes."""
        if not self.persistent:
            self.device_buffer.untyped_storage().resize_(0)

    @property
    def trainable_slots(self) -> list[ParamSlot]:
        return [s for s in self.slots if s.master is not None]

    def byte_runs(self, trainable: bool) -> list[tuple[int, int]]:
        """Byte ranges ``[start, end)`` of the chunk covering its trainable (or frozen)
        parameters, consecutive ones merged: a gather after a host update copies the frozen
        runs in as they are and writes only the trainable runs back (a LoRA chunk's base
        weights never change, so writing them back moved the whole chunk for nothing)."""
        cached = self._byte_runs.get(trainable)
        if cached is not None:
            return cached
        runs: list[list[int]] = []
        last = None
        for s in sorted(self.slots, key=lambda s: s.placement.offset_bytes):
            mine = (s.master is not None) == trainable
            a = s.placement.offset_bytes
            b = a + s.placement.nbytes
            if mine and last is True and runs:
                runs[-1][1] = b
            elif mine:
                runs.append([a, b])
            last = mine
        self._byte_runs[trainable] = [(a, b) for a, b in runs]
        return self._byte_runs[trainable]

    def view(self, buffer: torch.Tensor, placement: ParamPlacement) -> torch.Tensor:
        raw = buffer[placement.offset_bytes : placement.offset_bytes + placement.nbytes]
        return raw.view(placement.dtype).view(placement.shape)

    def _set_state(self, new: ChunkState) -> None:
        if self.persistent:
            raise RuntimeError(f"chunk {self.index} is persistent; its state never changes")
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"chunk {self.index}: illegal transition {self.state} -> {new}")
        if new is ChunkState.IN_FLIGHT:
            self.device_buffer.untyped_storage().resize_(self.nbytes)
        elif new is not ChunkState.RESIDENT and self.device_buffer.untyped_storage().nbytes():
            self.device_buffer.untyped_storage().resize_(0)
        self.state = new

    def __repr__(self) -> str:
        return f"Chunk({self.index}, {self.state.value}, {len(self.slots)} params)"
