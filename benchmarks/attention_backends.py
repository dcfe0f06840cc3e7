"""Causal SDPA per backend on a GPU: forward and forward+backward seconds at long sequences.

At long context the step of a Llama-shaped model is dominated by causal attention, whose cost
grows with the square of the sequence; which of torch's fused SDPA kernels runs it decides
how long a step takes. This script times each backend alone on one layer's attention shape
(Llama-3-8B: 32 query heads of 128, key/value already repeated to 32 heads as Hugging Face's
``sdpa`` attention passes them), so that a long-context run can pick the fastest and its step
time can be extrapolated (the attention part scales as ``seq**2``)::

    python benchmarks/attention_backends.py --seqs 16384,65536 --out "$OUT/attention.jsonl"

Rows: one per (backend, seq): ``fwd_s``, ``fwd_bwd_s``, and ``tflops_fwd`` /
``tflops_fwd_bwd`` by the usual count (causal forward ``2 * seq**2 * heads * head_dim``
FLOPs, backward 2.5 times that), or ``status: "error"`` with the reason a backend refused.
Nothing here asserts a time; it reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from protrain.train.attention import BACKENDS  # noqa: E402

FUSED = ("flash", "cudnn", "efficient")  # math would hold seq^2 scores: not at these lengths


def time_backend(backend: str, seq: int, heads: int, head_dim: int, reps: int) -> dict:
    """Seconds of one causal forward and of forward+backward under ``backend``."""
    shape = (1, heads, seq, head_dim)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def run(backward: bool) -> None:
        with sdpa_kernel([BACKENDS[backend]]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if backward:
                out.backward(grad)

    run(True)  # warm-up: kernel selection, workspace
    torch.cuda.synchronize()
    times = {}
    for name, backward in (("fwd_s", False), ("fwd_bwd_s", True)):
        t0 = time.perf_counter()
        for _ in range(reps):
            with torch.set_grad_enabled(backward):
                run(backward)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / reps
    fwd_flops = 2 * seq * seq * heads * head_dim
    return {
        "fwd_s": round(times["fwd_s"], 5),
        "fwd_bwd_s": round(times["fwd_bwd_s"], 5),
        "tflops_fwd": round(fwd_flops / times["fwd_s"] / 1e12, 1),
        "tflops_fwd_bwd": round(3.5 * fwd_flops / times["fwd_bwd_s"] / 1e12, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seqs", default="16384,65536")
    p.add_argument("--backends", default=",".join(FUSED))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention.jsonl"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_backends.py needs a CUDA device")
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"--backends: unknown {sorted(unknown)}; allowed: {sorted(BACKENDS)}")
    common = {
        "kind": "attention",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "run_id": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    }
    for seq in (int(s) for s in args.seqs.split(",")):
        for backend in args.backends.split(","):
            row = {**common, "backend": backend, "seq": seq}
            try:
                row.update(status="ok", **time_backend(backend, seq, args.heads, args.head_dim,
                                                       args.reps))  # fmt: skip
            except RuntimeError as e:  # a backend that does not take this shape says so
                row.update(status="error", error=str(e).strip().splitlines()[0][:300])
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
