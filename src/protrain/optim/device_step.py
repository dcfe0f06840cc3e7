"""Device-stepped offloaded chunks: the AdamW of a few offloaded chunks on the device.

An offloaded chunk keeps its fp32 masters and Adam moments in pinned host memory, and its
update normally runs on the host worker (``optim/hybrid_adamw.py``). On full fine-tuning
that host AdamW bounds the step while the host-device link sits partly idle. For the last
``n_chunks`` offloaded chunks in forward order, :class:`DeviceStep` moves the update to the
device instead: their gradients take the host path of every offloaded chunk
(``runtime/grad_offload.py``: copied out to the slot's pinned fp32 accumulator
``grad_acc``, accumulated over micro-batches and normed there), and at ``step()`` their
gradients, masters and moments cross the link in pieces, are stepped by torch's fused AdamW
on the device, and the masters and moments go back. The moments stay the host tensors the
chunk's ``FlatAdamW`` owns, so ``state_dict`` and checkpoints do not change. Nothing of a
chunk stays on the device between steps: the staging sets are the device step's only
device memory.

Why the *last* chunks: the host worker steps offloaded chunks in forward order and the next
forward waits for them in that order, so the chunks the next forward needs first are best
left to it, and the chunks it needs last have the whole host backlog, and the forward of the
first layers, to hide their link traffic under. (Their gradients are also the first to
complete in backward.)

[Note: device step pipeline]
A step cuts the stepped tensors into pieces of at most ``piece_numel`` elements (a tensor
split only at multiples of 16 elements, so that on the CPU each part keeps the fused
kernel's arithmetic: see [Note: flat runs] in ``optim/flat_adamw.py``) and runs every piece
through one of ``_N_SETS`` reused sets of device staging buffers (fp32 gradient, master and
two moments, and the cast weights: 20 bytes an element), on three streams: ``h2d`` copies
piece k's gradients, masters and moments in from pinned host memory, ``compute`` unscales
and clips its gradients, steps it (torch's functional fused AdamW, one tensor per part, so
the bits are those of the per-tensor AdamW) and casts the new masters to the parameters'
dtype, ``d2h`` copies masters, moments and the cast weights back. Piece k+1's copy-in
overlaps piece k's step and piece k-1's copy-out; a set is refilled only after its last
copy-out (``_Set.free``). The chunk's next gather copies the cast weights in (2 bytes a bf16
parameter, not the 4 of its master) after the chunk's last copy-out
(``ChunkManager.note_host_write``). The next step's copy-in waits for this step's copy-out.
On the CPU the same code runs synchronously, with no streams.

The copy-in of a gradient waits for its host accumulator to be complete: the host
accumulations of later micro-batches (``slot.accumulate_future``, on the host before the
copy is enqueued) and the device-to-host copy of the first one (``slot.grad_event``, on the
``h2d`` stream). The next backward's first copy into the accumulator waits for this step's
copy-in of it (:meth:`DeviceStep.grads_read`, on ``grad_offload_stream``).

Unscaling (fp16) and clipping are done on each staged piece of gradients, on the device,
with the kernels and the order of the host step task (unscale, then the clip coefficient,
each one fp32 multiplication an element), so the result equals the host path's. The host
accumulator is not changed (the host task scales its chunk's in place), so a gradient norm
read after ``step()`` and before ``zero_grad()`` sees these chunks' gradients unclipped.

Several ranks: gradients arrive from the reducer (``distributed/grad_reducer.py``), chunk
by chunk as backward's reductions end, and take the host path as a host-stepped chunk's do.
``step()`` steps these chunks after the reductions; armed by ``step_in_backward()`` (one
micro-batch in the window, no clipping), a chunk steps from inside the backward once its
reduced gradient is on its way to the host, its streams waiting for the reducer's, so that
its link traffic runs under the backward of the layers before it rather than at the step,
where it would meet the next forward's gathers (on two H100s, stepped at ``step()``,
three such chunks of full-8b made the step 2.21 s against 1.96 s). In the sharded mode a
slot's master, host copy, accumulator and moments are this rank's own elements of the
parameter (``chunks/shard.py``): the pieces stream only the own elements, and the next
gather copies the own cast shard in and all-gathers the rest, as after a host update.
Clipping combines the shards' squared norms over ranks as for host-stepped shards
(``HybridAdamW._total_norm``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from protrain.chunks.chunk import ParamSlot
from protrain.chunks.manager import ChunkManager
from protrain.optim.flat_adamw import FlatAdamW, fused_adamw

_N_SETS = 3  # staging sets: one copying in, one stepping, one copying out
_LANE_UNIT = 16  # a tensor is cut only at multiples of this ([Note: flat runs])
PIECE_NUMEL = 1 << 23  # fp32 elements of a piece: 32 MiB per staging buffer
COUNTERS = ("device_step_h2d_bytes", "device_step_d2h_bytes", "device_step_s")


_STAGED = ("grad", "param", "exp_avg", "exp_avg_sq")  # fp32 buffers of a staging set
_MOVED = _STAGED[1:]  # what goes back to the host (the gradient does not)


def staging_bytes(piece_numel: int = PIECE_NUMEL) -> int:
    """Device bytes of the staging sets (gradients, masters, two moments and the cast
    weights, fp32 sized), for the memory model: the device step's only device memory."""
    return _N_SETS * piece_numel * 4 * (len(_STAGED) + 1)


@dataclass
class _Segment:
    """Elements ``lo .. hi`` of one slot's flat master, at element ``off`` of a piece."""

    slot: ParamSlot
    adam: FlatAdamW
    group: int
    lo: int
    hi: int
    off: int


class _Set:
    def __init__(self, numel: int, device: torch.device, cuda: bool) -> None:
        self.fp32 = {k: torch.empty(numel, dtype=torch.float32, device=device) for k in _STAGED}
        # the updated masters cast to the parameters' dtype (CUDA: copied out as such)
        self.cast = torch.empty(numel * 4, dtype=torch.uint8, device=device) if cuda else None
        self.free = None  # CUDA event: the last copy-out from this set is done


def split_pieces(items: list[tuple[ParamSlot, FlatAdamW, int]], piece_numel: int):
    """``items`` (slot, its FlatAdamW, its group) packed into pieces of at most
    ``piece_numel`` elements; a tensor is cut only at a multiple of ``_LANE_UNIT``."""
    if piece_numel <= 0 or piece_numel % _LANE_UNIT:
        raise ValueError(f"piece_numel={piece_numel} must be a positive multiple of 16")
    pieces: list[list[_Segment]] = [[]]
    room = piece_numel
    for slot, adam, group in items:
        n, lo = slot.master.numel(), 0
        while lo < n:
            take = min(n - lo, room)
            if take < n - lo:
                take -= take % _LANE_UNIT
            if take == 0:
                pieces.append([])
                room = piece_numel
                continue
            pieces[-1].append(_Segment(slot, adam, group, lo, lo + take, piece_numel - room))
            lo += take
            room -= take
    return [p for p in pieces if p]


class DeviceStep:
    """The device AdamW of the last ``n_chunks`` offloaded chunks with trainable
    parameters (forward order); see the module note."""

    def __init__(self, manager: ChunkManager, n_chunks: int, piece_numel: int | None = None):
        piece_numel = PIECE_NUMEL if piece_numel is None else piece_numel
        trainable = [c for c in manager.offloaded if c.trainable_slots]
        if not isinstance(n_chunks, int) or not 0 <= n_chunks <= len(trainable):
            raise ValueError(
                f"n_device_step={n_chunks!r} is not allowed: use an integer from 0 to "
                f"{len(trainable)} (the offloaded chunks with trainable parameters)"
            )
        if piece_numel <= 0 or piece_numel % _LANE_UNIT:
            raise ValueError(f"piece_numel={piece_numel} must be a positive multiple of 16")
        self.manager = manager
        self.n_chunks = n_chunks
        self.piece_numel = piece_numel
        self._chosen: frozenset[int] | None = None
        self._sets: list[_Set] = []
        # chunk -> CUDA event: the last step's copy-in of its gradients is done
        self._grads_read: dict[int, torch.cuda.Event] = {}
        self._last_done = None  # CUDA event: the last step's final copy-out
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        cuda = manager.is_cuda
        self._h2d = torch.cuda.Stream(manager.device) if cuda and n_chunks else None
        self._compute = torch.cuda.Stream(manager.device) if cuda and n_chunks else None
        self._d2h = torch.cuda.Stream(manager.device) if cuda and n_chunks else None
        for key in COUNTERS:
            manager.stats.setdefault(key, 0 if key.endswith("_bytes") else 0.0)
        if n_chunks:
            manager.settle_hooks.append(self.settle)

    # ---- which chunks ---------------------------------------------------------------------

    def chunk_ids(self) -> frozenset[int]:
        """The device-stepped chunks, chosen at the first call and fixed from then on: by
        the forward order the first forward recorded (the first gradient comes after it),
        else by the layout's order, which is the parameters' execution order too (a first
        ``step_in_backward()`` comes before the first forward)."""
        if self._chosen is None:
            m = self.manager
            order = [ci for ci in m.forward_order]
            order += [c.index for c in m.offloaded if c.index not in order]
            trainable = [ci for ci in order if m.chunks[ci].trainable_slots]
            chosen = trainable[len(trainable) - self.n_chunks :] if self.n_chunks else []
            self._chosen = frozenset(chosen)
        return self._chosen

    def takes(self, chunk: int) -> bool:
        return self.n_chunks > 0 and chunk in self.chunk_ids()

    # ---- gradients ------------------------------------------------------------------------

    def grads_read(self, chunk: int):
        """The CUDA event after which the last step no longer reads ``chunk``'s host
        gradient accumulators (None: no such step, or on the CPU): the next copy into them
        waits for it."""
        return self._grads_read.get(chunk)

    # ---- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(
        self,
        items: list[tuple[ParamSlot, FlatAdamW, int]],
        hyper: list[dict],
        inv_scale: torch.Tensor | None,
        clip_coef: torch.Tensor | None,
    ) -> None:
        """One AdamW step of ``items`` (slot with a gradient, its FlatAdamW, its group) at
        the groups' hyperparameters ``hyper``; ``inv_scale``: fp16's inverse loss scale,
        ``clip_coef``: the clip coefficient to apply (None: none), both on the device. The
        gradients are read from the slots' host accumulators (``grad_acc``)."""
        if not items:
            return
        m = self.manager
        m.stats["device_steps"] = m.stats.get("device_steps", 0) + 1
        cuda = m.is_cuda
        t0 = time.perf_counter()
        self.harvest()
        for s, _, _ in items:  # the host accumulations of later micro-batches
            if s.accumulate_future is not None:
                t_wait = time.perf_counter()
                s.accumulate_future.result()
                m.stats["wait_cpu_optimizer_s"] += time.perf_counter() - t_wait
        start = None
        if cuda:
            self._compute.wait_stream(torch.cuda.current_stream(m.device))
            if self._last_done is not None:  # the last step's copy-out into the same masters
                self._h2d.wait_event(self._last_done)
            for s, _, _ in items:  # the first gradient's copy into grad_acc
                if s.grad_event is not None:
                    self._h2d.wait_event(s.grad_event)
            start = self._h2d.record_event(torch.cuda.Event(enable_timing=True))
            for t in (inv_scale, clip_coef):
                if t is not None:
                    t.record_stream(self._compute)
        scale = (inv_scale, clip_coef)
        by_adam: dict[int, tuple[FlatAdamW, set[int]]] = {}
        for s, adam, _ in items:
            by_adam.setdefault(id(adam), (adam, set()))[1].add(id(s))
        for adam, ids in by_adam.values():
            adam.ensure_state(ids)
            if cuda:
                adam.pin_moments()
        counts = {id(s): adam.step_count(s) for s, adam, _ in items}
        pieces = split_pieces(items, self.piece_numel)
        last_piece_of = {}
        for k, piece in enumerate(pieces):
            for seg in piece:
                last_piece_of[seg.slot.chunk] = k
        self._ensure_sets()
        for k, piece in enumerate(pieces):
            read, done = self._step_piece(piece, self._sets[k % _N_SETS], hyper, counts, scale)
            for ci in {seg.slot.chunk for seg in piece}:
                if last_piece_of[ci] == k and done is not None:
                    self._grads_read[ci] = read
                    m.note_host_write(ci, done)
        for s, adam, _ in items:  # torch's fused step adds 1 to each step count
            adam.set_step_count(s, counts[id(s)] + 1.0)
        if cuda:
            end = self._d2h.record_event(torch.cuda.Event(enable_timing=True))
            self._last_done = end
            self._timings.append((start, end))
        else:
            m.stats["device_step_s"] += time.perf_counter() - t0

    def _step_piece(self, piece: list[_Segment], st: _Set, hyper, counts, scale):
        """Copy in, step and copy out one piece through ``st``; (the copy-in's CUDA event,
        the copy-out's), None on the CPU. ``scale``: (inverse loss scale, clip coefficient)."""
        m = self.manager
        cuda = m.is_cuda
        # copies listed kind by kind, so that the segments of back-to-back host tensors (a
        # chunk's masters and accumulators are carved back to back, a run's moments are one
        # flat tensor) merge into one copy per kind (_merged), not one per tensor and kind
        ins: dict[str, list] = {k: [] for k in _STAGED}
        outs: dict[str, list] = {k: [] for k in _MOVED}
        casts = []
        for seg in piece:
            n = seg.hi - seg.lo
            exp_avg, exp_avg_sq = seg.adam.moments(seg.slot)
            host = {
                "grad": seg.slot.grad_acc.view(-1),
                "param": seg.slot.master.view(-1),
                "exp_avg": exp_avg.view(-1),
                "exp_avg_sq": exp_avg_sq.view(-1),
            }
            for k, src in host.items():
                ins[k].append((st.fp32[k][seg.off : seg.off + n], src[seg.lo : seg.hi]))
                if k in _MOVED:
                    outs[k].append((src[seg.lo : seg.hi], st.fp32[k][seg.off : seg.off + n]))
            casts.append((seg, st.fp32["param"][seg.off : seg.off + n]))
        used = piece[-1].off + piece[-1].hi - piece[-1].lo  # segments lie back to back
        with _on(self._h2d):
            if cuda and st.free is not None:
                self._h2d.wait_event(st.free)
            nbytes = 0
            for dst, src in (pair for k in _STAGED for pair in _merged(ins[k])):
                dst.copy_(src, non_blocking=cuda)
                nbytes += dst.numel() * 4
            m.stats["device_step_h2d_bytes"] += nbytes
            loaded = self._h2d.record_event() if cuda else None
        with _on(self._compute):
            if cuda:
                self._compute.wait_event(loaded)
            _unscale_and_clip(st.fp32["grad"][:used], *scale)
            self._adamw(piece, st, hyper, counts)
            cast_out = []
            for seg, master in casts:
                host = seg.slot.host_view.view(-1)[seg.lo : seg.hi]
                if cuda:  # the same rounding as the gather's cast ([Note: write-back ...])
                    isz = host.element_size()
                    low = st.cast[seg.off * 4 : seg.off * 4 + master.numel() * isz]
                    low = low.view(host.dtype)
                    low.copy_(master)
                    cast_out.append((host, low))
                else:
                    cast_out.append((host, master))
            stepped = self._compute.record_event() if cuda else None
        with _on(self._d2h):
            if cuda:
                self._d2h.wait_event(stepped)
            nbytes = 0
            for dst, src in [p for k in _MOVED for p in _merged(outs[k])] + cast_out:
                dst.copy_(src, non_blocking=cuda)
                nbytes += dst.numel() * dst.element_size()
            m.stats["device_step_d2h_bytes"] += nbytes
            if cuda:
                st.free = self._d2h.record_event()
        return loaded, st.free

    def _adamw(self, piece: list[_Segment], st: _Set, hyper, counts) -> None:
        """torch's functional fused AdamW, one tensor per segment, one call per group."""
        device = self.manager.device
        cuda = device.type == "cuda"
        steps = torch.tensor(
            [counts[id(seg.slot)] for seg in piece], dtype=torch.float32, pin_memory=cuda
        )
        if device.type != "cpu":
            # From page-locked memory, without blocking: a pageable copy synchronizes this
            # (the step's) stream, so the thread enqueuing the step, inside an armed
            # backward the autograd thread, waited for each piece's copy-in and left the
            # GPU without work (+0.25 s a step on full-3b, one H200)
            steps = steps.to(device, non_blocking=cuda)
        steps = list(steps.unbind())
        by_group: dict[int, list[int]] = {}
        for i, seg in enumerate(piece):
            by_group.setdefault(seg.group, []).append(i)
        for gi, idx in by_group.items():
            h = hyper[gi]
            view = {
                k: [st.fp32[k][piece[i].off : piece[i].off + piece[i].hi - piece[i].lo]
                    for i in idx]
                for k in st.fp32
            }  # fmt: skip
            fused_adamw(
                view["param"], view["grad"], view["exp_avg"], view["exp_avg_sq"],
                [steps[i] for i in idx], h,
            )  # fmt: skip

    def _ensure_sets(self) -> None:
        """The staging sets, made at the first step and kept: pieces of ``piece_numel``,
        or less when the chosen chunks have fewer parameters in all (as
        ``plan/memory.py`` counts them)."""
        if self._sets:
            return
        m = self.manager
        numel = sum(s.master.numel() for ci in self.chunk_ids()
                    for s in m.chunks[ci].trainable_slots)  # fmt: skip
        need = min(self.piece_numel, -(-numel // _LANE_UNIT) * _LANE_UNIT)
        with _on(self._compute):
            self._sets = [_Set(need, m.device, m.is_cuda) for _ in range(_N_SETS)]

    # ---- counters ---------------------------------------------------------------------------

    def harvest(self) -> None:
        """Count the device-step seconds of finished steps (no synchronization)."""
        done = [(a, b) for a, b in self._timings if b.query()]
        for a, b in done:
            self.manager.stats["device_step_s"] += a.elapsed_time(b) / 1e3
        self._timings = [t for t in self._timings if t not in done]

    def settle(self) -> None:
        if self._timings:
            self._timings[-1][1].synchronize()
            self.harvest()

    def close(self) -> None:
        if self.manager.is_cuda and self._last_done is not None:
            self._last_done.synchronize()
        self._sets, self._grads_read, self._timings = [], {}, []
        self._h2d = self._compute = self._d2h = self._last_done = None


def _unscale_and_clip(grad: torch.Tensor, inv_scale, clip_coef) -> None:
    """The host step task's order: fp16's inverse loss scale, then the clip coefficient, in
    place on ``grad`` (staged gradients; elementwise, so the bits do not depend on how the
    gradients are cut into pieces)."""
    if inv_scale is not None:  # step() has already found every gradient finite
        found_inf = torch.zeros(1, device=grad.device)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv_scale)
    if clip_coef is not None:
        torch._foreach_mul_([grad], clip_coef)


def _on(stream):
    """``torch.cuda.stream(stream)``; nothing on the CPU."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _merged(pairs: list[tuple[torch.Tensor, torch.Tensor]]):
    """``(dst, src)`` copies of flat tensors, each run of copies whose destinations and
    sources both lie back to back merged into one."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, s in pairs:
        if out and _follows(out[-1][0], d) and _follows(out[-1][1], s):
            pd, ps = out[-1]
            n = pd.numel() + d.numel()
            out[-1] = (pd.as_strided((n,), (1,)), ps.as_strided((n,), (1,)))
        else:
            out.append((d, s))
    return out


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()
    )
