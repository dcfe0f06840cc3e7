"""The picture of a traced step (`protrain profile`): memory against the budget in three
parts, block names, chunk traffic, the host AdamW lane, seconds on the axis; and the PNG."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import torch
from tests.profile import tiny_llama

from protrain.knobs import Knobs
from protrain.plan.memory import MemoryModel
from protrain.profile.hardware import HardwareProfile
from protrain.profile.picture import build_picture
from protrain.profile.timeline import write_timeline_html, write_timeline_png
from protrain.profile.trace import trace_model

BUDGET = 3 << 20
HOST_RATE, CLIP_RATE = 2e6, 8e6  # parameters a second


@pytest.fixture(scope="module")
def offloaded():
    """A tiny Llama traced with small chunks, one persistent: gathers, offloaded gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models run faster on one intra-op thread
    try:
        model = tiny_llama.build(layers=2)
        batch = tiny_llama.batch(bsz=1, seq=16)
        return trace_model(
            model, batch, device="cpu", knobs=Knobs(n_persist=1, chunk_size_bytes=1 << 16)
        )
    finally:
        torch.set_num_threads(threads)


def _hardware() -> HardwareProfile:
    return HardwareProfile(
        device="cpu", device_name="test", h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10,
        duplex_bytes_per_s=1e10, cpu_adam_params_per_s=1e9, device_adam_params_per_s=1e9,
        collective_bytes_per_s=None, cpu_threads=1, cpu_adam_busy_params_per_s=HOST_RATE,
        cpu_clip_params_per_s=CLIP_RATE,
    )  # fmt: skip


def test_trace_records_the_pool_and_the_persistent_states(offloaded):
    p = offloaded
    assert p.trace_n_persist == 1 and p.chunks.n_chunks > 3
    # the persistent chunk's bytes, fp32 master, AdamW moments and step, as the plan counts
    assert p.model_state_bytes == MemoryModel(p).model_states[1]
    pool = [c for iv in p.intervals for c in iv.resident_chunks]
    assert pool and all(1 <= c < p.chunks.n_chunks for c in pool)
    assert all(len(iv.resident_chunks) <= p.trace_n_buffer for iv in p.intervals)
    assert p.intervals[-1].resident_chunks == []  # the optimizer step releases the pool


def test_picture_parts_and_host_lane(offloaded):
    p = offloaded
    pic = build_picture(p, budget_bytes=BUDGET, hardware=_hardware(), clipping=True)
    assert len(pic.points) == 3 * len(p.intervals)
    for pt, iv in zip(pic.points[1::3], p.intervals):  # each interval's peak, in three parts
        assert min(pt.model_states, pt.activations, pt.transients) >= 0
        pool = len(iv.resident_chunks) * p.chunks.chunk_size_bytes
        assert pt.total >= p.model_state_bytes + pool + iv.peak_bytes
    start = pic.points[0]
    assert start.model_states == p.model_state_bytes + len(p.start_resident_chunks) * (
        p.chunks.chunk_size_bytes
    )
    assert start.activations == 0
    # activations grow through the checkpointed forward (each block's held input)
    fwd_ends = [pt.activations for pt, iv in zip(pic.points[2::3], p.intervals) if iv.kind == "fwd"]
    assert fwd_ends == sorted(fwd_ends) and fwd_ends[-1] > 0
    # host AdamW: every offloaded trainable chunk once, one after another from the end of
    # backward, each for its parameters at the host rates (AdamW and the clip pass)
    steps = pic.host_steps
    offloaded_chunks = [c for c in range(1, p.chunks.n_chunks) if p.chunks.trainable_numel[c]]
    assert sorted(h.chunk for h in steps) == offloaded_chunks
    opt = next(iv for iv in p.intervals if iv.kind == "opt")
    assert steps[0].start_s == pytest.approx(opt.start_s)
    for a, b in zip(steps, steps[1:]):
        assert b.start_s == pytest.approx(a.end_s)
    for h in steps:
        want = h.params * (1 / HOST_RATE + 1 / CLIP_RATE)
        assert h.end_s - h.start_s == pytest.approx(want)
    # without clipping a chunk is released when its last gradient is on the host: in backward
    early = build_picture(p, hardware=_hardware(), clipping=False).host_steps
    assert min(h.start_s for h in early) < opt.start_s


def test_html_can_be_hovered(offloaded, tmp_path):
    path = write_timeline_html(
        offloaded, tmp_path / "step.html", title="tiny", budget_bytes=BUDGET, hardware=_hardware()
    )
    text = path.read_text()
    svg = ET.fromstring(text[text.index("<svg") : text.index("</svg>") + 6])  # well-formed
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text for t in svg.iter(f"{ns}title")]
    lines = [e for e in svg.iter(f"{ns}line") if e.get("class") == "budget"]
    assert len(lines) == 1 and "budget 3.0 MiB" in text
    # each interval's column names its peak's three parts; the legend says what they hold
    columns = [t for t in titles if ", peak at " in t and not t.startswith("peak: ")]
    assert len(columns) == len(offloaded.intervals)
    assert all(re.search(r"= model states .+ \+ activations .+ \+ transients ", t) for t in columns)
    for part in ("model states", "activations", "transients"):
        assert any(t.startswith(f"{part}: ") for t in titles)
    assert any(t.startswith("host AdamW of chunk") for t in titles)
    assert any(t.startswith("gather chunk") for t in titles)
    assert any(t.startswith("gradients of chunk") for t in titles)
    # every chunk gathered is released again by the step's end (the optimizer frees the pool)
    gathered = sorted(int(m) for m in re.findall(r"<title>gather chunk (\d+):", text))
    released = sorted(int(m) for m in re.findall(r"<title>release chunk (\d+):", text))
    assert gathered and released == gathered
    # block names on hover, for forward and backward, with the memory split at the peak
    for kind in ("fwd", "bwd"):
        assert any(t.startswith(f"{kind} 1: model.layers.1") for t in titles)
    assert any("model.layers.0" in t and "activations" in t for t in titles)
    ticks = re.findall(r">(\d+\.\d+) s</text>", text)  # the time axis, in seconds
    assert len(ticks) >= 3 and float(ticks[0]) == 0.0
    assert "<script" not in text and "http" not in text.replace("http://www.w3.org", "")


def test_png_is_written(offloaded, tmp_path):
    from PIL import Image

    path = write_timeline_png(
        offloaded, tmp_path / "step.png", budget_bytes=BUDGET, hardware=_hardware()
    )
    with Image.open(path) as img:
        assert img.size == (1100, 420)
        colors = img.convert("RGB").getcolors(maxcolors=1 << 16)
    assert len(colors) > 10  # drawn, not blank
