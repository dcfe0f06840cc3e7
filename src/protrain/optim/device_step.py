"""Device-stepped offloaded chunks: the AdamW of a few offloaded chunks on the device.

An offloaded chunk keeps its fp32 masters and Adam moments in pinned host memory, and its
update normally runs on the host worker (``optim/hybrid_adamw.py``). On full fine-tuning
that host AdamW bounds the step while the host-device link sits partly idle. For the last
``n_chunks`` offloaded chunks in forward order, :class:`DeviceStep` moves the update to the
device instead: their gradients stay on the device (fp32 accumulators, as a persistent
chunk's), and at ``step()`` their masters and moments cross the link in pieces, are stepped
by torch's fused AdamW on the device, and go back. The moments stay the host tensors the
chunk's ``FlatAdamW`` owns, so ``state_dict`` and checkpoints do not change.

Why the *last* chunks: the host worker steps offloaded chunks in forward order and the next
forward waits for them in that order, so the chunks the next forward needs first are best
left to it, and the chunks it needs last have the whole host backlog, and the forward of the
first layers, to hide their link traffic under. (Their gradients are also the first to
complete in backward.)

[Note: device step pipeline]
A step cuts the stepped tensors into pieces of at most ``piece_numel`` elements (a tensor
split only at multiples of 16 elements, so that on the CPU each part keeps the fused
kernel's arithmetic: see [Note: flat runs] in ``optim/flat_adamw.py``) and runs every piece
through one of ``_N_SETS`` reused sets of device staging buffers, on three streams:
``h2d`` copies piece k's masters and moments in, ``compute`` steps it (torch's functional
fused AdamW, one tensor per part, so the bits are those of the per-tensor AdamW) and casts the
new masters to the parameters' dtype, ``d2h`` copies masters, moments and the cast weights
back. Piece k+1's copy-in overlaps piece k's step and piece k-1's copy-out; a set is
refilled only after its last copy-out (``_Set.free``). The chunk's next gather copies the
cast weights in (2 bytes a bf16 parameter, not the 4 of its master) after the chunk's last
copy-out (``ChunkManager.note_host_write``). The next step's copy-in waits for this step's
copy-out. On the CPU the same code runs synchronously, with no streams.

Unscaling (fp16) and clipping are done on the device gradients before the first piece, with
the kernels and the order of the host step task, so the result equals the host path's.

Several ranks: gradients arrive from the reducer (``distributed/grad_reducer.py``) after
backward's reductions, and ``step()`` steps these chunks after them (never from inside the
backward). In the sharded mode a slot's master, host copy and moments are this rank's own
elements of the parameter (``chunks/shard.py``), and so is what ``accumulate`` receives:
the reduce-scattered shard of the gradient. The accumulator is therefore shard-sized (4 / N
bytes a parameter of device memory at N ranks), the pieces stream only the own elements,
and the next gather copies the own cast shard in and all-gathers the rest, as after a host
update. Clipping combines the shards' squared norms over ranks as for host-stepped shards
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


def staging_bytes(piece_numel: int = PIECE_NUMEL) -> int:
    """Device bytes of the staging sets (masters, two moments and the cast weights, fp32
    sized), for the memory model."""
    return _N_SETS * piece_numel * 16


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
        self.fp32 = {
            k: torch.empty(numel, dtype=torch.float32, device=device)
            for k in ("param", "exp_avg", "exp_avg_sq")
        }
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
        self._grads: dict[int, torch.Tensor] = {}  # id(slot) -> fp32 device accumulator
        self._sets: list[_Set] = []
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

    # ---- gradients --------------------------------------------------------------------------

    def accumulate(self, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        """Fold ``grad`` into the slot's device accumulator (on the compute stream, as a
        persistent chunk's) and take its norm for clipping."""
        if first:
            acc = self._grads[id(slot)] = grad.to(torch.float32, copy=True)
        else:
            acc = self._grads[id(slot)]
            acc.add_(grad)
        slot.grad_norm = torch.linalg.vector_norm(acc)

    def grad(self, slot: ParamSlot) -> torch.Tensor:
        g = self._grads.get(id(slot))
        if g is None:
            raise RuntimeError(
                f"protrain: the gradient of {slot.name} was consumed by its chunk's device "
                "step in the backward armed by step_in_backward(); only its 2-norm is kept"
            )
        return g

    def drop_grads_of(self, slots: list[ParamSlot]) -> None:
        """Free the accumulators of ``slots`` (stepped in an armed backward: nothing reads
        them again before ``zero_grad``; the streams that still read them hold them)."""
        for s in slots:
            self._grads.pop(id(s), None)

    def drop_grads(self) -> None:
        self._grads.clear()

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
        ``clip_coef``: the clip coefficient to apply (None: none), both on the device."""
        if not items:
            return
        m = self.manager
        m.stats["device_steps"] = m.stats.get("device_steps", 0) + 1
        cuda = m.is_cuda
        t0 = time.perf_counter()
        self.harvest()
        grads = [self.grad(s) for s, _, _ in items]
        start = None
        if cuda:
            self._compute.wait_stream(torch.cuda.current_stream(m.device))
            if self._last_done is not None:  # the last step's copy-out into the same masters
                self._h2d.wait_event(self._last_done)
            start = self._h2d.record_event(torch.cuda.Event(enable_timing=True))
        with _on(self._compute):
            if cuda:
                for g in grads:  # zero_grad may drop them while this stream reads them
                    g.record_stream(self._compute)
            for t in (inv_scale, clip_coef):
                if cuda and t is not None:
                    t.record_stream(self._compute)
            if inv_scale is not None:  # step() has already found every gradient finite
                found_inf = torch.zeros(1, device=m.device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            if clip_coef is not None:
                torch._foreach_mul_(grads, clip_coef)
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
            done = self._step_piece(piece, self._sets[k % _N_SETS], hyper, counts)
            for ci in {seg.slot.chunk for seg in piece}:
                if last_piece_of[ci] == k and done is not None:
                    m.note_host_write(ci, done)
        for s, adam, _ in items:  # torch's fused step adds 1 to each step count
            adam.set_step_count(s, counts[id(s)] + 1.0)
        if cuda:
            end = self._d2h.record_event(torch.cuda.Event(enable_timing=True))
            self._last_done = end
            self._timings.append((start, end))
        else:
            m.stats["device_step_s"] += time.perf_counter() - t0

    def _step_piece(self, piece: list[_Segment], st: _Set, hyper, counts) -> object:
        m = self.manager
        cuda = m.is_cuda
        ins, outs, casts = [], [], []
        for seg in piece:
            n = seg.hi - seg.lo
            exp_avg, exp_avg_sq = seg.adam.moments(seg.slot)
            host = {
                "param": seg.slot.master.view(-1),
                "exp_avg": exp_avg.view(-1),
                "exp_avg_sq": exp_avg_sq.view(-1),
            }
            for k, src in host.items():
                ins.append((st.fp32[k][seg.off : seg.off + n], src[seg.lo : seg.hi]))
                outs.append((src[seg.lo : seg.hi], st.fp32[k][seg.off : seg.off + n]))
            casts.append((seg, st.fp32["param"][seg.off : seg.off + n]))
        with _on(self._h2d):
            if cuda and st.free is not None:
                self._h2d.wait_event(st.free)
            nbytes = 0
            for dst, src in _merged(ins):
                dst.copy_(src, non_blocking=cuda)
                nbytes += dst.numel() * 4
            m.stats["device_step_h2d_bytes"] += nbytes
            loaded = self._h2d.record_event() if cuda else None
        with _on(self._compute):
            if cuda:
                self._compute.wait_event(loaded)
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
            for dst, src in _merged(outs) + cast_out:
                dst.copy_(src, non_blocking=cuda)
                nbytes += dst.numel() * dst.element_size()
            m.stats["device_step_d2h_bytes"] += nbytes
            if cuda:
                st.free = self._d2h.record_event()
        return st.free

    def _adamw(self, piece: list[_Segment], st: _Set, hyper, counts) -> None:
        """torch's functional fused AdamW, one tensor per segment, one call per group."""
        device = self.manager.device
        steps = torch.tensor([counts[id(seg.slot)] for seg in piece], dtype=torch.float32)
        steps = list(steps.to(device).unbind()) if device.type != "cpu" else list(steps.unbind())
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
            grads = [self._grads[id(piece[i].slot)].view(-1)[piece[i].lo : piece[i].hi]
                     for i in idx]  # fmt: skip
            fused_adamw(
                view["param"], grads, view["exp_avg"], view["exp_avg_sq"],
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
        self._sets, self._grads, self._timings = [], {}, []
        self._h2d = self._compute = self._d2h = self._last_done = None


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
