"""A picture of one traced step: device memory over time against the budget, what holds it,
and what moves.

From a :class:`~protrain.profile.trace.ModelProfile` (with the budget and the hardware
profile when known): one self-contained HTML file with an inline SVG (no plotting library,
no external assets; every element has a ``<title>`` tooltip with its figures), or the same
picture as a PNG drawn with Pillow, for a quick look.

- **Memory**: total device memory at each interval's start, peak and end, stacked in three
  parts. *Model states*: the persistent chunks with their fp32 masters and AdamW state, the
  offloaded chunks resident in the buffer pool, and the persistent chunks' gradient
  accumulators made so far in backward. *Activations*: the other bytes above the step's
  start that are live at the cuts around an interval, so held through it (checkpointed
  blocks' inputs, the hidden state and its gradient passing from block to block).
  *Transients*: the rest of the peak (a block's workspaces and recomputed activations, the
  logits and loss; on CUDA also what was resident at the step's start beyond the model
  states: module buffers, library workspaces). A dashed line marks the budget. At a peak the
  pool counts as at the interval's end: on CUDA the total is then the allocator's peak.
- **Blocks**: a band per stretch of the step (the embedding, forward of a block, head and
  loss, backward of a block, optimizer step), named by the block's module name where it
  fits and on hover.
- **Chunks**: a mark per offloaded chunk gathered into the buffer pool (host to device), per
  chunk released from it (its device copy freed: evicted for a gather, or by the optimizer
  step), and per offloaded chunk whose gradients went to the host in a stretch (device to
  host).
- **Host AdamW**: per offloaded trainable chunk, when the step's host optimizer updates it.
  The traced step leaves host updates out (``HybridAdamW.step_without_host_updates``), so
  the lane is the engine's schedule at the hardware profile's host rates (AdamW while copies
  run, and with clipping the clip pass): released at the end of backward with clipping,
  else when the chunk's last gradient has gone to the host; one chunk at a time, the lowest
  released one first (``runtime/host_worker.py``).

The time axis is the traced step's seconds (a synchronization at every cut makes it longer
than a training step), extended when the host lane runs past its end: the next forward
waits for those chunks.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from PIL import Image, ImageDraw

from protrain.profile.hardware import HardwareProfile
from protrain.profile.picture import (
    Band,
    ChunkMark,
    HostStep,
    MemoryPoint,
    StepPicture,
    build_picture,
)
from protrain.profile.trace import ModelProfile

# Geometry, shared by the SVG and the PNG (pixels).
_W, _H = 1100, 420
_X0, _X1 = 76, 1080  # plot's left and right
_Y_TOP, _Y_BOT = 44, 256  # memory plot
_LANE_BLOCKS, _LANE_CHUNKS, _LANE_HOST = 262, 282, 302  # lane tops, 16 px each
_LANE_H = 16
_AXIS_Y = 322

_PART_COLORS = {"model states": "#4e79a7", "activations": "#f28e2b", "transients": "#e15759"}
_KIND_COLORS = {"pre": "#bab0ac", "fwd": "#76b7b2", "head": "#b07aa1", "bwd": "#edc948",
                "opt": "#59a14f"}  # fmt: skip
_GATHER_COLOR, _GRADS_COLOR, _HOST_COLOR = "#4e79a7", "#f28e2b", "#9c755f"
_RELEASE_COLOR = "#999999"
_BUDGET_COLOR, _TOTAL_COLOR = "#b00020", "#222222"
_CHAR_W = 6.0  # approximate width of one character of the labels


def _fmt_bytes(n: float) -> str:
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def _nice_step(span: float, target: int) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


class _Frame:
    """Seconds -> x and bytes -> y, with the axes' ticks."""

    def __init__(self, pic: StepPicture):
        self.end_s = pic.end_s
        top = max(p.total for p in pic.points)
        if pic.budget_bytes:
            top = max(top, pic.budget_bytes)
        self.top = max(top * 1.05, 1)
        unit = 2**30 if self.top >= 2**30 else 2**20
        self.unit_name = "GiB" if unit == 2**30 else "MiB"
        step = _nice_step(self.top / unit, 4) * unit
        self.y_ticks = [k * step for k in range(int(self.top // step) + 1)]
        self.unit = unit
        t_step = _nice_step(self.end_s, 10)
        self.t_ticks = [k * t_step for k in range(int(self.end_s / t_step + 1e-9) + 1)]
        exp = math.floor(math.log10(t_step) + 1e-9)
        self.t_decimals = max(0, -exp) + (1 if round(t_step / 10**exp, 3) == 2.5 else 0)

    def x(self, t: float) -> float:
        return _X0 + (_X1 - _X0) * t / self.end_s

    def y(self, b: float) -> float:
        return _Y_BOT - (_Y_BOT - _Y_TOP) * b / self.top

    def y_label(self, b: float) -> str:
        return f"{b / self.unit:g} {self.unit_name}"

    def t_label(self, t: float) -> str:
        return f"{t:.{self.t_decimals}f}"


def _stack(pic: StepPicture, f: _Frame) -> dict[str, list[tuple[float, float]]]:
    """Each part's polygon (its upper edge left to right, its lower edge back)."""
    lower = [0] * len(pic.points)
    polys = {}
    for part, attr in (
        ("model states", "model_states"),
        ("activations", "activations"),
        ("transients", "transients"),
    ):
        upper = [lo + getattr(p, attr) for lo, p in zip(lower, pic.points)]
        xs = [f.x(p.t_s) for p in pic.points]
        polys[part] = [(x, f.y(u)) for x, u in zip(xs, upper)] + [
            (x, f.y(lo)) for x, lo in zip(reversed(xs), reversed(lower))
        ]
        lower = upper
    return polys


def _point_title(p: MemoryPoint) -> str:
    return (
        f"{p.what} at {p.t_s:.4f} s: {_fmt_bytes(p.total)} = model states "
        f"{_fmt_bytes(p.model_states)} + activations {_fmt_bytes(p.activations)} + transients "
        f"{_fmt_bytes(p.transients)}"
    )


def _band_title(b: Band) -> str:
    text = f"{b.label}: {b.name}, {b.start_s:.4f}-{b.end_s:.4f} s ({b.end_s - b.start_s:.4f} s)"
    if b.peak is not None:
        text += (
            f"; peak {_fmt_bytes(b.peak.total)} (model states {_fmt_bytes(b.peak.model_states)}, "
            f"activations {_fmt_bytes(b.peak.activations)}, transients "
            f"{_fmt_bytes(b.peak.transients)})"
        )
    return text + f"; {b.gathers} chunk gathers"


def _mark_title(m: ChunkMark) -> str:
    who = f"chunk {m.chunk}" if m.chunk is not None else "a chunk not resident at the stretch's end"
    if m.direction == "gather":
        return f"gather {who}: {_fmt_bytes(m.nbytes)} host to device at {m.t_s:.4f} s, {m.where}"
    if m.direction == "release":
        return (
            f"release {who}: its {_fmt_bytes(m.nbytes)} on the device freed (the host copy is "
            f"kept), in {m.where}"
        )
    return (
        f"gradients of {who} to the host: {_fmt_bytes(m.nbytes)} fp32 device to host from "
        f"{m.t_s:.4f} s, {m.where}"
    )


def _host_title(h: HostStep) -> str:
    return (
        f"host AdamW of chunk {h.chunk}: {h.params:,} parameters, {h.start_s:.4f}-{h.end_s:.4f} "
        f"s ({h.end_s - h.start_s:.4f} s)"
    )


def _band_text(b: Band, width: float) -> str:
    for text in (b.name, str(b.block) if b.block >= 0 else ""):
        if text and len(text) * _CHAR_W + 4 <= width:
            return text
    return ""


_PART_MEANING = {
    "model states": "persistent chunks with their fp32 masters and AdamW state, offloaded "
    "chunks resident in the buffer pool, persistent gradient accumulators",
    "activations": "other bytes live at the cuts around a stretch of the step (held through "
    "it): checkpointed blocks' inputs, the hidden state and its gradient",
    "transients": "the rest of the peak: workspaces, recomputed activations, logits and "
    "loss; on CUDA also module buffers and library workspaces resident since the step began",
}


def _legend() -> list[tuple[str, str, str, str]]:
    """(shape, color, label, meaning) of the legend, left to right."""
    return [
        *[("box", c, name, _PART_MEANING[name]) for name, c in _PART_COLORS.items()],
        ("dash", _BUDGET_COLOR, "budget", "the device memory budget"),
        ("line", _TOTAL_COLOR, "total", "total device memory"),
        ("up", _GATHER_COLOR, "chunk gather", "an offloaded chunk copied host to device"),
        ("tick", _RELEASE_COLOR, "chunk release", "an offloaded chunk's device copy freed"),
        ("down", _GRADS_COLOR, "grads to host", "an offloaded chunk's gradients to the host"),
        ("box", _HOST_COLOR, "host AdamW", "an offloaded chunk's host optimizer step"),
    ]


def _caption(profile: ModelProfile, pic: StepPicture) -> list[str]:
    peak = pic.peak
    budget = (
        f"budget {_fmt_bytes(pic.budget_bytes)} ({peak.total / pic.budget_bytes:.0%} used at "
        "the peak)"
        if pic.budget_bytes
        else "no budget given"
    )
    return [
        f"time (s): traced step {pic.step_s:.3f} s (synchronized at every cut); peak "
        f"{_fmt_bytes(peak.total)} at {peak.t_s:.3f} s in {peak.what}; {budget}",
        f"traced with n_persist={profile.trace_n_persist} of {profile.chunks.n_chunks} chunks "
        f"of {_fmt_bytes(profile.chunks.chunk_size_bytes)}, n_buffer={profile.trace_n_buffer}, "
        f"every block checkpointed; {profile.n_blocks} blocks, batch {profile.batch_size} x "
        f"{profile.seq_len}, {profile.compute_dtype} on {profile.device}",
        pic.host_note,
        *pic.notes,
    ]


# ---- SVG and HTML --------------------------------------------------------------------------


def timeline_svg(
    profile: ModelProfile,
    *,
    budget_bytes: int | None = None,
    hardware: HardwareProfile | None = None,
    clipping: bool = True,
) -> str:
    """The picture as an inline SVG element; hover any part for its figures."""
    pic = build_picture(profile, budget_bytes=budget_bytes, hardware=hardware, clipping=clipping)
    f = _Frame(pic)
    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-family="sans-serif" font-size="11">'
    ]
    # legend
    lx = _X0
    for shape, color, label, meaning in _legend():
        out.append(f"<g><title>{esc(label)}: {esc(meaning)}</title>")
        if shape == "box":
            out.append(f'<rect x="{lx}" y="14" width="10" height="10" fill="{color}"/>')
        elif shape in ("dash", "line"):
            dash = ' stroke-dasharray="5,3"' if shape == "dash" else ""
            out.append(
                f'<line x1="{lx}" x2="{lx + 12}" y1="19" y2="19" stroke="{color}" '
                f'stroke-width="2"{dash}/>'
            )
        elif shape == "tick":
            out.append(f'<line x1="{lx + 5}" x2="{lx + 5}" y1="13" y2="25" stroke="{color}"/>')
        else:
            out.append(f'<path d="{_triangle(lx + 5, 19, shape)}" fill="{color}"/>')
        out.append(f'<text x="{lx + 15}" y="23">{esc(label)}</text></g>')
        lx += 15 + len(label) * _CHAR_W + 14
    # y grid and labels
    for b in f.y_ticks:
        y = f.y(b)
        out.append(f'<line x1="{_X0}" x2="{_X1}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{_X0 - 6}" y="{y + 4:.1f}" text-anchor="end">{f.y_label(b)}</text>')
    # stacked parts
    for part, poly in _stack(pic, f).items():
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in poly)
        out.append(
            f'<polygon points="{pts}" fill="{_PART_COLORS[part]}" fill-opacity="0.75" '
            'stroke="none"/>'
        )
    total = " ".join(f"{f.x(p.t_s):.1f},{f.y(p.total):.1f}" for p in pic.points)
    out.append(f'<polyline points="{total}" fill="none" stroke="{_TOTAL_COLOR}" stroke-width="1"/>')
    # hover targets above the parts: one transparent column per interval, its peak's split
    for a, p, c in zip(pic.points, pic.points[1:], pic.points[2:]):
        if p.what.endswith("peak"):
            x0, x1 = f.x(a.t_s), f.x(c.t_s)
            out.append(
                f'<rect x="{x0:.1f}" y="{_Y_TOP}" width="{max(x1 - x0, 0.5):.1f}" '
                f'height="{_Y_BOT - _Y_TOP}" fill="#000" fill-opacity="0">'
                f"<title>{esc(_point_title(p))}</title></rect>"
            )
    if pic.budget_bytes:
        y = f.y(pic.budget_bytes)
        out.append(
            f'<line class="budget" x1="{_X0}" x2="{_X1}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="{_BUDGET_COLOR}" stroke-width="2" stroke-dasharray="6,4"><title>budget '
            f"{_fmt_bytes(pic.budget_bytes)}</title></line>"
        )
        out.append(
            f'<text x="{_X1 - 4}" y="{y - 4:.1f}" text-anchor="end" '
            f'fill="{_BUDGET_COLOR}">budget {_fmt_bytes(pic.budget_bytes)}</text>'
        )
    peak = pic.peak
    out.append(
        f'<circle cx="{f.x(peak.t_s):.1f}" cy="{f.y(peak.total):.1f}" r="3" '
        f'fill="{_TOTAL_COLOR}"><title>peak: {esc(_point_title(peak))}</title>'
        "</circle>"
    )
    # lanes
    for label, top in (
        ("blocks", _LANE_BLOCKS),
        ("chunks", _LANE_CHUNKS),
        ("host AdamW", _LANE_HOST),
    ):
        out.append(
            f'<text x="{_X0 - 6}" y="{top + 12}" text-anchor="end" font-size="10">{label}</text>'
        )
        out.append(
            f'<rect x="{_X0}" y="{top}" width="{_X1 - _X0}" height="{_LANE_H}" fill="#f6f6f6"/>'
        )
    for b in pic.bands:
        x0, x1 = f.x(b.start_s), f.x(b.end_s)
        out.append(
            f'<g><title>{esc(_band_title(b))}</title><rect x="{x0:.1f}" y="{_LANE_BLOCKS}" '
            f'width="{max(x1 - x0, 0.5):.1f}" height="{_LANE_H}" '
            f'fill="{_KIND_COLORS.get(b.kind, "#999999")}" stroke="white" stroke-width="0.5"/>'
        )
        text = _band_text(b, x1 - x0)
        if text:
            out.append(
                f'<text x="{(x0 + x1) / 2:.1f}" y="{_LANE_BLOCKS + 12}" '
                f'text-anchor="middle" font-size="10">{esc(text)}</text>'
            )
        out.append("</g>")
    for m in sorted(pic.marks, key=lambda m: m.direction != "release"):  # ticks below
        x = f.x(m.t_s)
        if m.direction == "release":
            out.append(
                f'<line class="release" x1="{x:.1f}" x2="{x:.1f}" y1="{_LANE_CHUNKS + 1}" '
                f'y2="{_LANE_CHUNKS + _LANE_H - 1}" stroke="{_RELEASE_COLOR}" stroke-width="1.5">'
                f"<title>{esc(_mark_title(m))}</title></line>"
            )
            continue
        shape = "up" if m.direction == "gather" else "down"
        color = _GATHER_COLOR if shape == "up" else _GRADS_COLOR
        out.append(
            f'<path class="{m.direction}" d="{_triangle(x, _LANE_CHUNKS + 8, shape)}" '
            f'fill="{color}"><title>{esc(_mark_title(m))}</title></path>'
        )
    for h in pic.host_steps:
        x0, x1 = f.x(h.start_s), f.x(h.end_s)
        out.append(
            f'<rect class="host-adamw" x="{x0:.1f}" y="{_LANE_HOST + 2}" '
            f'width="{max(x1 - x0, 0.5):.1f}" height="{_LANE_H - 4}" fill="{_HOST_COLOR}" '
            f'stroke="white" stroke-width="0.5"><title>{esc(_host_title(h))}</title></rect>'
        )
    if not pic.host_steps:
        out.append(
            f'<text x="{_X0 + 4}" y="{_LANE_HOST + 12}" font-size="10" fill="#666">'
            f"{esc(pic.host_note)}</text>"
        )
    # time axis
    out.append(f'<line x1="{_X0}" x2="{_X1}" y1="{_AXIS_Y}" y2="{_AXIS_Y}" stroke="#333"/>')
    for t in f.t_ticks:
        x = f.x(t)
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_AXIS_Y}" y2="{_AXIS_Y + 4}" stroke="#333"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{_AXIS_Y + 15}" text-anchor="middle">{f.t_label(t)} s</text>'
        )
    if pic.end_s > pic.step_s:
        x = f.x(pic.step_s)
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_Y_TOP}" y2="{_LANE_HOST + _LANE_H}" '
            'stroke="#333" stroke-dasharray="2,2"><title>end of the traced step; the '
            "host AdamW runs on into the next step's forward</title></line>"
        )
    for k, line in enumerate(_caption(profile, pic)):
        out.append(f'<text x="{_X0}" y="{_AXIS_Y + 34 + 15 * k}">{esc(line)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _triangle(x: float, y: float, shape: str) -> str:
    if shape == "up":
        return f"M{x - 4:.1f},{y + 4:.1f} L{x + 4:.1f},{y + 4:.1f} L{x:.1f},{y - 4:.1f} Z"
    return f"M{x - 4:.1f},{y - 4:.1f} L{x + 4:.1f},{y - 4:.1f} L{x:.1f},{y + 4:.1f} Z"


def write_timeline_html(
    profile: ModelProfile,
    path: str | Path,
    *,
    title: str = "",
    budget_bytes: int | None = None,
    hardware: HardwareProfile | None = None,
    clipping: bool = True,
) -> Path:
    """Write the picture of ``profile``'s traced step as a self-contained HTML file; return
    its path. ``budget_bytes``: the device budget to draw; ``hardware``: the rates of the
    host AdamW lane; ``clipping``: the step clips gradients (the host lane's schedule)."""
    path = Path(path)
    head = html.escape(title or "protrain profile")
    summary = (
        f"{profile.n_blocks} blocks, batch {profile.batch_size} x {profile.seq_len}, "
        f"{profile.compute_dtype} on {profile.device}. Hover the picture for figures: a "
        "column of the memory plot for its split, a block band, a chunk mark, a host AdamW "
        "step."
    )
    parts = "; ".join(f"<b>{name}</b>: {html.escape(m)}" for name, m in _PART_MEANING.items())
    parts += (
        ". The host AdamW lane is not measured: the traced step leaves host updates out, and "
        "the lane places each offloaded chunk's update as the engine schedules it, at the "
        "hardware profile's host rates."
    )
    svg = timeline_svg(profile, budget_bytes=budget_bytes, hardware=hardware, clipping=clipping)
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{head}</title></head>"
        f"<body style='font-family:sans-serif'><h3>{head}</h3><p>{html.escape(summary)}</p>"
        f"<p style='font-size:small'>{parts}</p>{svg}</body></html>\n"
    )
    return path


# ---- PNG ---------------------------------------------------------------------------------


def write_timeline_png(
    profile: ModelProfile,
    path: str | Path,
    *,
    budget_bytes: int | None = None,
    hardware: HardwareProfile | None = None,
    clipping: bool = True,
) -> Path:
    """The same picture as a PNG (Pillow), for terminals and reports without a browser."""
    pic = build_picture(profile, budget_bytes=budget_bytes, hardware=hardware, clipping=clipping)
    f = _Frame(pic)

    def rgb(color: str, alpha: float = 1.0) -> tuple[int, int, int]:
        c = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
        return tuple(int(255 - alpha * (255 - v)) for v in c)

    img = Image.new("RGB", (_W, _H), "white")
    draw = ImageDraw.Draw(img)
    lx = _X0
    for shape, color, label, _ in _legend():
        if shape == "box":
            draw.rectangle([lx, 14, lx + 10, 24], fill=rgb(color))
        elif shape in ("dash", "line"):
            draw.line([lx, 19, lx + 12, 19], fill=rgb(color), width=2)
        elif shape == "tick":
            draw.line([lx + 5, 13, lx + 5, 25], fill=rgb(color))
        else:
            draw.polygon(_triangle_points(lx + 5, 19, shape), fill=rgb(color))
        draw.text((lx + 15, 13), label, fill="black")
        lx += 15 + len(label) * _CHAR_W + 14
    for b in f.y_ticks:
        y = f.y(b)
        draw.line([_X0, y, _X1, y], fill=rgb("#e5e5e5"))
        label = f.y_label(b)
        draw.text((_X0 - 6 - len(label) * _CHAR_W, y - 6), label, fill="black")
    for part, poly in _stack(pic, f).items():
        draw.polygon(poly, fill=rgb(_PART_COLORS[part], 0.75))
    draw.line([(f.x(p.t_s), f.y(p.total)) for p in pic.points], fill=rgb(_TOTAL_COLOR), width=1)
    if pic.budget_bytes:
        y = f.y(pic.budget_bytes)
        for x in range(_X0, _X1, 10):
            draw.line([x, y, min(x + 6, _X1), y], fill=rgb(_BUDGET_COLOR), width=2)
        label = f"budget {_fmt_bytes(pic.budget_bytes)}"
        draw.text((_X1 - 4 - len(label) * _CHAR_W, y - 14), label, fill=rgb(_BUDGET_COLOR))
    for label, top in (
        ("blocks", _LANE_BLOCKS),
        ("chunks", _LANE_CHUNKS),
        ("host AdamW", _LANE_HOST),
    ):
        draw.rectangle([_X0, top, _X1, top + _LANE_H], fill=rgb("#f6f6f6"))
        draw.text((_X0 - 6 - len(label) * _CHAR_W, top + 2), label, fill="black")
    for b in pic.bands:
        x0, x1 = f.x(b.start_s), f.x(b.end_s)
        draw.rectangle(
            [x0, _LANE_BLOCKS, max(x1, x0 + 0.5), _LANE_BLOCKS + _LANE_H],
            fill=rgb(_KIND_COLORS.get(b.kind, "#999999")),
        )
        text = _band_text(b, x1 - x0)
        if text:
            draw.text(
                ((x0 + x1) / 2 - len(text) * _CHAR_W / 2, _LANE_BLOCKS + 2), text, fill="black"
            )
    for m in sorted(pic.marks, key=lambda m: m.direction != "release"):
        x = f.x(m.t_s)
        if m.direction == "release":
            draw.line(
                [x, _LANE_CHUNKS + 1, x, _LANE_CHUNKS + _LANE_H - 1], fill=rgb(_RELEASE_COLOR)
            )
            continue
        shape = "up" if m.direction == "gather" else "down"
        color = _GATHER_COLOR if shape == "up" else _GRADS_COLOR
        draw.polygon(_triangle_points(x, _LANE_CHUNKS + 8, shape), fill=rgb(color))
    for h in pic.host_steps:
        x0, x1 = f.x(h.start_s), f.x(h.end_s)
        draw.rectangle(
            [x0, _LANE_HOST + 2, max(x1, x0 + 0.5), _LANE_HOST + _LANE_H - 2],
            fill=rgb(_HOST_COLOR),
            outline="white",
        )
    if not pic.host_steps:
        draw.text((_X0 + 4, _LANE_HOST + 2), pic.host_note, fill=rgb("#666666"))
    draw.line([_X0, _AXIS_Y, _X1, _AXIS_Y], fill=rgb("#333333"))
    for t in f.t_ticks:
        x = f.x(t)
        draw.line([x, _AXIS_Y, x, _AXIS_Y + 4], fill=rgb("#333333"))
        label = f"{f.t_label(t)} s"
        draw.text((x - len(label) * _CHAR_W / 2, _AXIS_Y + 6), label, fill="black")
    if pic.end_s > pic.step_s:
        x = f.x(pic.step_s)
        for y in range(_Y_TOP, _LANE_HOST + _LANE_H, 6):
            draw.line([x, y, x, y + 3], fill=rgb("#333333"))
    for k, line in enumerate(_caption(profile, pic)):
        draw.text((_X0, _AXIS_Y + 24 + 15 * k), line, fill="black")
    path = Path(path)
    img.save(path)
    return path


def _triangle_points(x: float, y: float, shape: str) -> list[tuple[float, float]]:
    if shape == "up":
        return [(x - 4, y + 4), (x + 4, y + 4), (x, y - 4)]
    return [(x - 4, y - 4), (x + 4, y - 4), (x, y + 4)]
