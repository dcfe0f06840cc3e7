"""torch's fused CPU AdamW over many small tensors against one flat tensor, with and without
busy neighbours: the suspected cause of qlora-70b's slow host step.

qlora-70b's host AdamW took 0.55-0.59 s a step for its ~0.2 B LoRA parameters (sessions 7
and 9), 7x what the measured rate predicts, while full fine-tuning's host step runs near it.
The fused CPU kernel runs one parallel region per tensor. With the worker's threads filling
the cores (the engine's default leaves two for the threads that feed the GPU), a region's
barrier waits for whichever of its threads the scheduler put aside, and with a thousand
small tensors those waits, not the arithmetic, would be the step. This times one step over
LoRA-shaped tensors (rank 16 on a Llama-3-70B-shaped layer's seven projections, ``--layers``
of them) and over one flat tensor of the same size, at each ``--threads`` count, with
``--busy`` spinning processes beside it; one JSON line per case (median of ``--repeats``).

Usage: ``python benchmarks/host_adam_small_tensors.py --layers 20 --threads 1,2 --busy 0,1``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# (out, in) of a Llama-3-70B layer's projections: q, k, v, o, gate, up, down
_PROJ = [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192),
         (28672, 8192), (8192, 28672)]  # fmt: skip


def _params(shapes):
    import torch

    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    p.add_argument("--busy", default="0,1", help="comma-separated counts of spinning processes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    shapes = [
        s for _ in range(args.layers) for o, i in _PROJ for s in ((args.rank, i), (o, args.rank))
    ]
    numel = sum(a * b for a, b in shapes)
    cases = {"many": _params(shapes), "flat": _params([(numel,)])}
    rows = []
    for busy in (int(b) for b in args.busy.split(",")):
        spinners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)
        ]
        try:
            time.sleep(0.5 if busy else 0)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for name, params in cases.items():
                    opt = torch.optim.AdamW(params, fused=True)
                    opt.step()  # state made
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        opt.step()
                        times.append(time.perf_counter() - t0)
                    step = sorted(times)[len(times) // 2]
                    row = {"tensors": len(params), "params": numel, "threads": threads,
                           "busy_neighbours": busy, "case": name, "step_s": round(step, 4),
                           "g_params_per_s": round(numel / step / 1e9, 3),
                           "torch": torch.__version__}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for s in spinners:
                s.kill()
    if args.out:
        from report import append  # benchmarks/ is this script's folder

        append(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
