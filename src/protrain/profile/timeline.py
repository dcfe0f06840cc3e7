"""A picture of one traced step: memory over time, blocks and chunk traffic marked.

One self-contained HTML file with an inline SVG (no plotting library), or the same picture
as a PNG drawn with Pillow: the memory curve
through each interval's start, peak and end; a band per interval coloured by kind (forward
of block i, head and loss, backward of block i, optimizer step) with the block index; and
a lane of ticks, one per offloaded chunk gathered in that interval.
"""

from __future__ import annotations

import html
from pathlib import Path

from protrain.profile.trace import ModelProfile

_COLORS = {"pre": "#bbbbbb", "fwd": "#4e79a7", "head": "#b07aa1", "bwd": "#f28e2b",
           "opt": "#59a14f"}  # fmt: skip
_W, _H, _PAD = 1100, 420, 60


def _axes(profile: ModelProfile):
    """Time -> x and bytes -> y on the picture, the plot height, the byte range, the end."""
    ivs = profile.intervals
    t_end = max((iv.end_s for iv in ivs), default=1.0) or 1.0
    top = max([iv.peak_bytes for iv in ivs] + [1])
    bottom = min([iv.end_bytes for iv in ivs] + [0])
    plot_h = _H - 2 * _PAD - 40

    def x(t: float) -> float:
        return _PAD + (_W - 2 * _PAD) * t / t_end

    def y(b: float) -> float:
        return _PAD + plot_h * (1 - (b - bottom) / max(top - bottom, 1))

    return x, y, plot_h, top, bottom, t_end


def timeline_svg(profile: ModelProfile) -> str:
    ivs = profile.intervals
    x, y, plot_h, top, bottom, t_end = _axes(profile)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        'font-family="sans-serif" font-size="11">'
    ]
    band_y = _PAD + plot_h + 4
    points, prev, last = [], 0, None
    for iv in ivs:
        x0, x1 = x(iv.start_s), x(iv.end_s)
        color = _COLORS.get(iv.kind, "#999999")
        label = iv.kind if iv.block < 0 else f"{iv.kind} {iv.block}"
        parts.append(
            f'<rect x="{x0:.1f}" y="{_PAD}" width="{max(x1 - x0, 0.5):.1f}" height="{plot_h}" '
            f'fill="{color}" opacity="0.12"><title>{html.escape(label)}: '
            f"{iv.end_s - iv.start_s:.4f} s, peak {iv.peak_bytes / 2**20:.1f} MiB</title></rect>"
        )
        parts.append(
            f'<rect x="{x0:.1f}" y="{band_y}" width="{max(x1 - x0, 0.5):.1f}" height="14" '
            f'fill="{color}"/>'
        )
        if iv.block >= 0 and x1 - x0 > 14 and (iv.kind, iv.block) != last:
            parts.append(
                f'<text x="{(x0 + x1) / 2:.1f}" y="{band_y + 11}" text-anchor="middle" '
                f'fill="white">{iv.block}</text>'
            )
        for g in range(iv.gathers):
            gx = x0 + (x1 - x0) * (g + 0.5) / iv.gathers
            parts.append(
                f'<line x1="{gx:.1f}" x2="{gx:.1f}" y1="{band_y + 20}" y2="{band_y + 32}" '
                'stroke="#333" stroke-width="1"/>'
            )
        mid = (x0 + x1) / 2
        points += [(x0, y(prev)), (mid, y(iv.peak_bytes)), (x1, y(iv.end_bytes))]
        prev, last = iv.end_bytes, (iv.kind, iv.block)
    parts.append(
        '<polyline fill="none" stroke="#e15759" stroke-width="2" points="'
        + " ".join(f"{a:.1f},{b:.1f}" for a, b in points)
        + '"/>'
    )
    for frac in (0, 0.5, 1):
        b = bottom + frac * (top - bottom)
        parts.append(
            f'<text x="{_PAD - 6}" y="{y(b) + 4:.1f}" text-anchor="end">{b / 2**20:.0f} MiB</text>'
        )
    parts.append(
        f'<text x="{_W / 2}" y="{_H - 8}" text-anchor="middle">time (s), step '
        f"{t_end:.3f} s; ticks: offloaded chunks gathered</text>"
    )
    parts.append(
        f'<text x="{_PAD}" y="20">activation and transient memory above the step start '
        f"(model states and the buffer pool not included)</text>"
    )
    legend_x = _PAD
    for kind, color in _COLORS.items():
        parts.append(f'<rect x="{legend_x}" y="30" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{legend_x + 14}" y="39">{kind}</text>')
        legend_x += 70
    parts.append("</svg>")
    return "\n".join(parts)


def write_timeline_html(profile: ModelProfile, path: str | Path, *, title: str = "") -> Path:
    """Write the picture of ``profile``'s traced step as an HTML file; return its path."""
    path = Path(path)
    head = html.escape(title or "protrain profile")
    summary = (
        f"{profile.n_blocks} blocks, batch {profile.batch_size} x {profile.seq_len}, "
        f"{profile.compute_dtype} on {profile.device}; traced with n_persist="
        f"{profile.trace_n_persist} of {profile.chunks.n_chunks} chunks, every block "
        "checkpointed"
    )
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{head}</title></head>"
        f"<body><h3>{head}</h3><p>{html.escape(summary)}</p>{timeline_svg(profile)}"
        "</body></html>\n"
    )
    return path


def write_timeline_png(profile: ModelProfile, path: str | Path) -> Path:
    """The same picture as a PNG (Pillow), for terminals and reports without a browser."""
    from PIL import Image, ImageDraw

    ivs = profile.intervals
    x, y, plot_h, top, bottom, t_end = _axes(profile)

    def rgb(color: str, alpha: float = 1.0) -> tuple[int, int, int]:
        c = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
        return tuple(int(255 - alpha * (255 - v)) for v in c)

    img = Image.new("RGB", (_W, _H), "white")
    draw = ImageDraw.Draw(img)
    band_y = _PAD + plot_h + 4
    points, prev, last = [], 0, None
    for iv in ivs:
        x0, x1 = x(iv.start_s), x(iv.end_s)
        color = _COLORS.get(iv.kind, "#999999")
        draw.rectangle([x0, _PAD, max(x1, x0 + 0.5), _PAD + plot_h], fill=rgb(color, 0.12))
        draw.rectangle([x0, band_y, max(x1, x0 + 0.5), band_y + 14], fill=rgb(color))
        if iv.block >= 0 and x1 - x0 > 14 and (iv.kind, iv.block) != last:
            draw.text(((x0 + x1) / 2 - 3, band_y + 1), str(iv.block), fill="white")
        for g in range(iv.gathers):
            gx = x0 + (x1 - x0) * (g + 0.5) / iv.gathers
            draw.line([gx, band_y + 20, gx, band_y + 32], fill="#333333")
        points += [(x0, y(prev)), ((x0 + x1) / 2, y(iv.peak_bytes)), (x1, y(iv.end_bytes))]
        prev, last = iv.end_bytes, (iv.kind, iv.block)
    draw.line(points, fill=rgb("#e15759"), width=2)
    for frac in (0, 0.5, 1):
        b = bottom + frac * (top - bottom)
        draw.text((4, y(b) - 6), f"{b / 2**20:.0f} MiB", fill="black")
    draw.text((_PAD, 14), "activation and transient memory above the step start", fill="black")
    legend_x = _PAD
    for kind, color in _COLORS.items():
        draw.rectangle([legend_x, 30, legend_x + 10, 40], fill=rgb(color))
        draw.text((legend_x + 14, 29), kind, fill="black")
        legend_x += 70
    draw.text((_W / 2 - 150, _H - 16), f"time (s), step {t_end:.3f} s; ticks: chunks gathered",
              fill="black")  # fmt: skip
    path = Path(path)
    img.save(path)
    return path
