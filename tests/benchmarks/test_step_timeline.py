"""benchmarks/step_timeline.py: the summary of a (synthetic) Chrome trace."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_timeline  # noqa: E402


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_idle_gpu_time_is_split_by_what_ran_meanwhile():
    # Two steps of 1000 us (marks at 0, 1000, 2000). Kernels busy 0-400 and 1000-1400;
    # idle 400-1000 and 1400-2000. In the first idle stretch a copy to the device runs
    # 400-600, the host AdamW 500-800, a copy to the host 850-900; 900-1000 nothing.
    trace = {
        "traceEvents": [
            _x("user_annotation", "step", 0, 10),
            _x("user_annotation", "step", 1000, 10),
            _x("user_annotation", "step", 2000, 10),
            _x("kernel", "gemm", 0, 300),
            _x("kernel", "gemm", 250, 150),  # overlaps the first: counted once
            _x("kernel", "gemm", 1000, 400),
            _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 400, 200),
            _x("cpu_op", "aten::_fused_adamw_", 500, 300),
            _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 850, 50),
            _x("cpu_op", "aten::_fused_adamw_", 1500, 0),  # zero length: not counted
        ]
    }
    row = step_timeline.summarize(trace, bin_ms=0.5)
    us = 1e6 * 2  # two steps, seconds per step
    assert row["profiled_steps"] == 2 and row["step_s"] == round(2000 / us, 4)
    assert row["gpu_busy_s"] == round(800 / us, 4)
    assert row["gpu_idle_s"] == round(1200 / us, 4)
    assert row["idle_h2d_s"] == round(200 / us, 4)  # 400-600
    assert row["idle_adam_s"] == round(200 / us, 4)  # 600-800 (500-600 is the copy's)
    assert row["idle_d2h_s"] == round(50 / us, 4)
    assert row["idle_other_s"] == round((1200 - 450) / us, 4)
    assert row["host_adam_busy_s"] == round(300 / us, 4)
    # the last step, 500 us bins: kernels 1000-1400 (80% of the first bin), nothing after
    assert row["timeline"]["gpu"] == "#."
    assert row["timeline"]["h2d"] == ".."


def test_idle_gaps_name_what_the_host_did_meanwhile():
    # The GPU is idle 100-900 us; a sync spans 150-850, an op 200-300 (twice: its longest
    # overlap counts), a pinned allocation 880-1000 (20 us of it in the gap).
    ev = [
        _x("cuda_runtime", "cudaStreamSynchronize", 150, 700),
        _x("cpu_op", "aten::copy_", 200, 100),
        _x("cpu_op", "aten::copy_", 400, 50),
        _x("cuda_runtime", "cudaHostAlloc", 880, 120),
        _x("kernel", "gemm", 0, 100),  # not a host event
    ]
    gaps = step_timeline.explain_gaps(ev, [(100, 900), (950, 960)], 0, min_us=50)
    assert gaps == [
        {
            "at_ms": 0.1,
            "ms": 0.8,
            "host": {"cudaStreamSynchronize": 0.7, "aten::copy_": 0.1, "cudaHostAlloc": 0.0},
        }
    ]
