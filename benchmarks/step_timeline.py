"""Where a training step's time goes, on a GPU: one `run.py` row's system under
`torch.profiler`, summarized as busy and idle time per resource.

A ProTrain step overlaps GPU compute, host-to-device and
device-to-host copies and the host AdamW; its step time is set by whichever of them waits
for another. This script runs the same set-up as `benchmarks/run.py` (same flags), warms up,
profiles ``--steps`` steps and writes one JSON row with, per step on average:

- ``gpu_busy_s``, ``h2d_busy_s``, ``d2h_busy_s``: the union of the kernels' / copies'
  intervals (all streams);
- ``host_adam_busy_s``: the union of the host's fused AdamW kernels (any thread);
- ``gpu_idle_s`` split by what else was going on while no kernel ran:
  ``idle_h2d`` (a host-to-device copy was running: waiting for parameters),
  ``idle_adam`` (no such copy, the host AdamW was running: waiting for the optimizer),
  ``idle_d2h`` (only a device-to-host copy), ``idle_other`` (nothing: launch or sync);
- ``idle_gaps``: the last step's longest GPU-idle gaps, each with the host events (operators,
  CUDA runtime calls) that overlap it most, to tell a wait on a copy from a host stall;
- ``ops``: the operators with the most device time of their own (self time, kernels they
  launched), grouped by input shapes, per step: which matmuls, attention or elementwise
  kernels the GPU is busy with;
- ``timeline``: the last profiled step in bins of ``--bin-ms``, one character per bin and
  resource (`#` busy over half the bin, `+` some, `.` none), to read where the gaps sit.

The Chrome trace is written too (gzip) when ``--trace`` is given. Nothing here asserts a
time; it reports. Example (the chunk size of the measured full-3b row)::

    python benchmarks/step_timeline.py --workload full-3b --system protrain --auto \
        --chunked-loss-tokens 4096 --max-grad-norm 0 --steps 2 --out "$OUT/timeline.jsonl"
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ADAM = ("_fused_adamw", "_fused_adam")


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def total(intervals) -> float:
    return sum(b - a for a, b in intervals)


def gaps(busy, lo: float, hi: float) -> list[tuple[float, float]]:
    out, t = [], lo
    for a, b in busy:
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < hi:
        out.append((t, hi))
    return out


def intersect(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def summarize(trace: dict, bin_ms: float) -> dict:
    """The row's figures from a Chrome trace whose steps are annotated ``step`` (the last
    annotation only marks where the step before it ends)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731 (us)
    kernels = union([span(e) for e in ev if e.get("cat") == "kernel"])
    h2d = union([span(e) for e in ev if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]])
    d2h = union([span(e) for e in ev if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]])
    adam = union([span(e) for e in ev if e.get("cat") == "cpu_op" and any(a in e["name"] for a in _ADAM) and e["dur"] > 0])  # fmt: skip
    marks = sorted(span(e) for e in ev if e.get("cat") == "user_annotation" and e["name"] == "step")
    if len(marks) < 2:
        raise SystemExit(f"found {len(marks)} 'step' annotations; need at least 2")
    # A step is from one step's start (host) to the next one's: the GPU work of a step can
    # run past its host range, and what the next step waits for belongs to that wait.
    lo, hi = marks[0][0], marks[-1][0]
    n = len(marks) - 1
    k, hd, dh, ad = (clip(x, lo, hi) for x in (kernels, h2d, d2h, adam))
    idle = gaps(k, lo, hi)
    idle_h2d = intersect(idle, hd)
    rest = [g for g0 in idle for g in gaps(union(clip(hd, *g0)), *g0)]
    idle_adam = intersect(rest, ad)
    rest2 = [g for g0 in rest for g in gaps(union(clip(ad, *g0)), *g0)]
    idle_d2h = intersect(rest2, dh)
    us = 1e6 * n
    row = {
        "profiled_steps": n,
        "step_s": round((hi - lo) / us, 4),
        "gpu_busy_s": round(total(k) / us, 4),
        "h2d_busy_s": round(total(hd) / us, 4),
        "d2h_busy_s": round(total(dh) / us, 4),
        "host_adam_busy_s": round(total(ad) / us, 4),
        "gpu_idle_s": round(total(idle) / us, 4),
        "idle_h2d_s": round(total(idle_h2d) / us, 4),
        "idle_adam_s": round(total(idle_adam) / us, 4),
        "idle_d2h_s": round(total(idle_d2h) / us, 4),
    }
    row["idle_other_s"] = round(
        row["gpu_idle_s"] - row["idle_h2d_s"] - row["idle_adam_s"] - row["idle_d2h_s"], 4
    )
    # The last step, binned.
    a, b = marks[-2][0], marks[-1][0]
    width = bin_ms * 1000.0
    lines = {}
    for name, xs in (("gpu", kernels), ("h2d", h2d), ("d2h", d2h), ("adam", adam)):
        chars = []
        t = a
        while t < b:
            busy = total(clip(xs, t, min(t + width, b))) / width
            chars.append("#" if busy > 0.5 else "+" if busy > 0.0 else ".")
            t += width
        lines[name] = "".join(chars)
    row["timeline_bin_ms"] = bin_ms
    row["timeline"] = lines
    row["idle_gaps"] = explain_gaps(ev, gaps(clip(kernels, a, b), a, b), a)
    return row


def explain_gaps(
    ev: list[dict], idle, step_start: float, n_gaps: int = 4, n_ops: int = 6, min_us: float = 5000
):
    """The longest GPU-idle gaps of a step (at least ``min_us``), each with the host-side events
    (operators, CUDA runtime calls, annotations) that overlap it most: what the host was
    doing while nothing ran on the GPU."""
    host = [e for e in ev if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
    out = []
    for lo, hi in sorted(idle, key=lambda g: g[0] - g[1])[:n_gaps]:
        if hi - lo < min_us:
            break
        by_name: dict[str, float] = {}
        for e in host:
            a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            o = min(b, hi) - max(a, lo)
            if o > 0 and e["name"] != "step":
                by_name[e["name"]] = max(by_name.get(e["name"], 0.0), o)
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:n_ops]
        out.append({
            "at_ms": round((lo - step_start) / 1000, 1),
            "ms": round((hi - lo) / 1000, 1),
            "host": {k: round(v / 1000, 1) for k, v in top},
        })  # fmt: skip
    return out


def top_ops(prof, n_steps: int, n: int = 25) -> list[dict]:
    """The ``n`` operators with the most self device time per step, by name and input shapes."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((us, e))
    rows.sort(key=lambda r: -r[0])
    return [
        {
            "op": e.key,
            "shapes": str(e.input_shapes)[:160],
            "ms": round(us / 1000 / n_steps, 2),
            "calls": round(e.count / n_steps, 1),
        }
        for us, e in rows[:n]
    ]


def main(argv: list[str] | None = None) -> int:
    import run as run_mod
    import systems

    argv = list(sys.argv[1:] if argv is None else argv)
    own = {"--bin-ms": "10", "--trace": None}
    for flag in list(own):
        if flag in argv:
            i = argv.index(flag)
            own[flag] = argv[i + 1]
            del argv[i : i + 2]
    args = run_mod.parse_args(argv)
    spec = run_mod.row_spec(args)
    run_mod.emulate_budget(spec)
    trainer = systems.setup(spec)
    vocab = run_mod.MODEL_SHAPES[spec.model]["vocab_size"]
    ids = torch.randint(vocab, (spec.batch, spec.seq), device=spec.device)
    for _ in range(args.warmup):
        trainer.step([ids])
        trainer.extras()
    sync = torch.cuda.synchronize if spec.device.type == "cuda" else lambda: None
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if spec.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    retries0 = run_mod._alloc_retries(spec.device)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(args.steps + 1):  # the last one only marks where the previous ends
            with torch.profiler.record_function("step"):
                trainer.step([ids])
        sync()
    wall = (time.perf_counter() - t0) / (args.steps + 1)
    retries = (run_mod._alloc_retries(spec.device) - retries0) / (args.steps + 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if own["--trace"]:
            with open(path, "rb") as f, gzip.open(own["--trace"], "wb") as g:
                g.write(f.read())
    row = {
        "kind": "step_timeline",
        "workload": spec.workload,
        "system": spec.system,
        "batch": spec.batch,
        "seq": spec.seq,
        "budget_gib": spec.budget_gib,
        "plan": trainer.plan,
        "profiled_wall_step_s": round(wall, 4),
        "alloc_retries_per_step": retries,
        "gpu": torch.cuda.get_device_name() if spec.device.type == "cuda" else "cpu",
        "commit": args.commit or os.environ.get("COMMIT", "unknown"),
        **summarize(trace, float(own["--bin-ms"])),
        "ops": top_ops(prof, args.steps + 1),
    }
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
