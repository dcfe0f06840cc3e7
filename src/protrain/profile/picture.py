"""The data of the picture of one traced step (:mod:`protrain.profile.timeline` draws it):
device memory at each interval's start, peak and end in three parts, the bands of the
step's stretches, the chunk marks and the host AdamW lane, built from a
:class:`~protrain.profile.trace.ModelProfile` (with the budget and the hardware profile
when known). What each part counts is described in ``profile/timeline.py``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import ModelProfile

_KIND_NAMES = {"pre": "embedding", "head": "head and loss", "opt": "optimizer step"}


@dataclass
class MemoryPoint:
    """Device memory at one moment of the step, in its three parts (bytes)."""

    t_s: float
    model_states: int
    activations: int
    transients: int
    what: str  # the stretch and the moment, for the tooltip

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.transients


@dataclass
class Band:
    """Consecutive intervals of one kind and block (a block's backward is cut at every
    gradient accumulation; the band is the whole of it)."""

    kind: str
    block: int
    name: str
    start_s: float
    end_s: float
    peak: MemoryPoint | None = None
    gathers: int = 0

    @property
    def label(self) -> str:
        return self.kind if self.block < 0 else f"{self.kind} {self.block}"

    @property
    def where(self) -> str:
        return self.name if self.block < 0 else f"{self.label} {self.name}"


@dataclass
class ChunkMark:
    t_s: float
    chunk: int | None  # None: gathered and released again inside one interval
    # "gather" (host to device), "release" (device copy freed, the host copy kept) or
    # "grads" (gradients device to host)
    direction: str
    nbytes: int
    where: str  # the band's label and name


@dataclass
class HostStep:
    chunk: int
    params: int
    start_s: float
    end_s: float


@dataclass
class StepPicture:
    """What the picture shows, computed once and drawn by both the SVG and the PNG."""

    points: list[MemoryPoint]
    bands: list[Band]
    marks: list[ChunkMark]
    host_steps: list[HostStep]
    host_note: str
    budget_bytes: int | None
    step_s: float
    end_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> MemoryPoint:
        return max(self.points, key=lambda p: p.total)


def _fmt_s(t: float) -> str:
    return f"{t:.3f} s" if abs(t) >= 0.01 else f"{t * 1000:.2f} ms"


def _band_name(profile: ModelProfile, kind: str, block: int) -> str:
    if block >= 0 and block < len(profile.blocks):
        return profile.blocks[block].name
    return _KIND_NAMES.get(kind, kind)


def _grad_times(profile: ModelProfile) -> list[tuple[float, int]]:
    """Per ``grad_order`` entry: (seconds into the step when it was accumulated, index of
    the interval it ended): the start of the first interval that counts it in
    ``grads_done``."""
    ivs = profile.intervals
    out: list[tuple[float, int]] = []
    for i, iv in enumerate(ivs):
        while len(out) < min(iv.grads_done, len(profile.grad_order)):
            out.append((iv.start_s, max(i - 1, 0)))
    while len(out) < len(profile.grad_order):  # accumulated in the last interval
        out.append((ivs[-1].end_s if ivs else 0.0, len(ivs) - 1))
    return out


def host_optimizer_lane(
    profile: ModelProfile, hardware: HardwareProfile, *, clipping: bool = True
) -> list[HostStep]:
    """When the step's host AdamW would update each offloaded trainable chunk of the traced
    layout, at ``hardware``'s host rates (see the module docstring); seconds of the step."""
    t = profile.chunks
    offloaded = [i for i in range(profile.trace_n_persist, t.n_chunks) if t.trainable_numel[i]]
    if not offloaded:
        return []
    rate = hardware.cpu_adam_busy_params_per_s or hardware.cpu_adam_params_per_s
    s_per_param = 1.0 / rate
    if clipping and hardware.cpu_clip_params_per_s:
        s_per_param += 1.0 / hardware.cpu_clip_params_per_s
    opt = next((iv for iv in profile.intervals if iv.kind == "opt"), None)
    end_of_backward = opt.start_s if opt is not None else profile.step_s
    release = dict.fromkeys(offloaded, end_of_backward)
    if not clipping:
        last: dict[int, float] = {}
        for (chunk, _), (t_s, _) in zip(profile.grad_order, _grad_times(profile)):
            last[chunk] = max(last.get(chunk, 0.0), t_s)
        release = {c: last.get(c, end_of_backward) for c in offloaded}
    steps, ready, now = [], [], -math.inf
    todo = sorted(offloaded, key=lambda c: (release[c], c))
    k = 0
    while k < len(todo) or ready:
        if not ready:
            now = max(now, release[todo[k]])
        while k < len(todo) and release[todo[k]] <= now:
            heapq.heappush(ready, todo[k])
            k += 1
        c = heapq.heappop(ready)
        work = t.trainable_numel[c] * s_per_param
        steps.append(HostStep(c, t.trainable_numel[c], now, now + work))
        now += work
    return steps


def build_picture(
    profile: ModelProfile,
    *,
    budget_bytes: int | None = None,
    hardware: HardwareProfile | None = None,
    clipping: bool = True,
) -> StepPicture:
    """The picture's content: memory points, bands, chunk marks and the host lane."""
    ivs = profile.intervals
    if not ivs:
        raise ValueError("the profile has no traced intervals to draw")
    chunk_bytes = profile.chunks.chunk_size_bytes
    n_persist = profile.trace_n_persist
    notes = []
    persistent = profile.model_state_bytes
    if persistent is None:
        persistent = 0
        notes.append(
            "this profile does not record the persistent chunks' bytes (traced by "
            "an older version): model states show the pool and gradients only"
        )
    other = 0
    if profile.step_start_bytes is not None:
        other = max(profile.step_start_bytes - persistent, 0)
    # persistent gradient accumulator bytes after the first k accumulations
    grads = [0]
    for chunk, numel in profile.grad_order:
        grads.append(grads[-1] + (4 * numel if chunk < n_persist else 0))

    def done(k: int) -> int:
        return grads[min(k, len(grads) - 1)]

    points: list[MemoryPoint] = []
    bands: list[Band] = []
    marks: list[ChunkMark] = []
    prev_live, prev_resident = 0, list(profile.start_resident_chunks)
    prev_grads = done(ivs[0].grads_done)
    band_of: list[int] = []  # per interval, its band
    for i, iv in enumerate(ivs):
        name = _band_name(profile, iv.kind, iv.block)
        if not bands or (bands[-1].kind, bands[-1].block) != (iv.kind, iv.block):
            bands.append(Band(iv.kind, iv.block, name, iv.start_s, iv.end_s))
        band_of.append(len(bands) - 1)
        band = bands[-1]
        band.end_s = iv.end_s
        what = f"{band.label} ({name})"
        pool_start = len(prev_resident) * chunk_bytes
        pool_end = len(iv.resident_chunks) * chunk_bytes
        g_start = prev_grads
        if iv.kind == "opt":
            g_end = 0  # zero_grad frees the accumulators
        else:
            g_end = done(ivs[i + 1].grads_done) if i + 1 < len(ivs) else g_start
        held = max(min(prev_live - g_start, iv.end_bytes - g_end), 0)
        g_peak = max(g_start, g_end)
        points.append(
            MemoryPoint(
                iv.start_s,
                persistent + pool_start + g_start,
                max(prev_live - g_start, 0),
                other,
                f"{what}, start",
            )
        )
        peak = MemoryPoint(
            (iv.start_s + iv.end_s) / 2,
            persistent + pool_end + g_peak,
            held,
            other + max(iv.peak_bytes - g_peak - held, 0),
            f"{what}, peak",
        )
        points.append(peak)
        points.append(
            MemoryPoint(
                iv.end_s,
                persistent + pool_end + g_end,
                max(iv.end_bytes - g_end, 0),
                other,
                f"{what}, end",
            )
        )
        if band.peak is None or peak.total > band.peak.total:
            band.peak = peak
        band.gathers += iv.gathers
        gathered = [c for c in iv.resident_chunks if c not in prev_resident]
        unnamed = max(iv.gathers - len(gathered), 0)
        for j, c in enumerate([*gathered, *[None] * unnamed]):
            t_s = iv.start_s + (iv.end_s - iv.start_s) * j / max(len(gathered) + unnamed, 1)
            marks.append(ChunkMark(t_s, c, "gather", chunk_bytes, band.where))
        for c in prev_resident:  # evicted to make room, or released by the optimizer step
            if c not in iv.resident_chunks:
                marks.append(ChunkMark(iv.start_s, c, "release", chunk_bytes, band.where))
        prev_live, prev_resident, prev_grads = iv.end_bytes, iv.resident_chunks, g_end

    # gradients of offloaded chunks going to the host: one mark per chunk per band
    offload: dict[tuple[int, int], list] = {}
    for (chunk, numel), (t_s, i) in zip(profile.grad_order, _grad_times(profile)):
        if chunk < n_persist:
            continue
        key = (band_of[i], chunk)
        entry = offload.setdefault(key, [t_s, 0])
        entry[0] = min(entry[0], t_s)
        entry[1] += 4 * numel
    for (bi, chunk), (t_s, nbytes) in sorted(offload.items(), key=lambda kv: kv[1][0]):
        marks.append(ChunkMark(t_s, chunk, "grads", nbytes, bands[bi].where))

    host_steps: list[HostStep] = []
    trainable_offloaded = sum(profile.chunks.trainable_numel[n_persist:])
    if not trainable_offloaded:
        host_note = "host AdamW: no offloaded trainable parameters in this layout"
    elif hardware is None:
        host_note = "host AdamW: not drawn (no hardware profile given)"
    else:
        host_steps = host_optimizer_lane(profile, hardware, clipping=clipping)
        total = sum(h.end_s - h.start_s for h in host_steps)
        how = (
            "released at the end of backward (clipping)"
            if clipping
            else "each released when its gradients are on the host"
        )
        host_note = (
            f"host AdamW: {len(host_steps)} chunks, {_fmt_s(total)} at the hardware profile's "
            f"host rates, {how}; not run in the traced step"
        )
    step_s = ivs[-1].end_s
    end_s = max([step_s, *[h.end_s for h in host_steps]]) or 1.0
    return StepPicture(
        points, bands, marks, host_steps, host_note, budget_bytes, step_s, end_s, notes
    )


# ---- geometry ----------------------------------------------------------------------------
