"""torch's fused CPU AdamW over many small tensors against one flat tensor, with and without
busy neighbours: the suspected cause of qlora-70b's slow host step.

qlora-70b's host AdamW took 0.55-0.59 s a step for its ~0.2 B LoRA parameters (on H100
hosts), 7x what the measured rate predicts, while full fine-tuning's host step runs near it.
The fused CPU kernel runs one parallel region per tensor. With the worker's threads filling
the cores (the engine's default leaves two for the threads that feed the GPU), a region's
barrier waits for whichever of its threads the scheduler put aside, and with a thousand
small tensors those waits, not the arithmetic, would be the step. This times one step over
LoRA-shaped tensors (rank 16 on a Llama-3-70B-shaped layer's seven projections, ``--layers``
of them) and over one flat tensor of the same size, at each ``--threads`` count, with
``--busy`` spinning processes beside it; one JSON line per case (median of ``--repeats``).

``--cases engine`` times the engine's own host step instead (``FlatAdamW`` through the step
task's ``_step_host_piece``, in the engine's pieces) over the same tensors carved from one
arena as the chunk manager carves them: ``engine_per_tensor`` each master followed by its
accumulator (one tensor per parameter: a run of its own), ``engine_flat`` the chunk's masters
back to back, then its accumulators (one flat tensor per piece).

Usage: ``python benchmarks/host_adam_small_tensors.py --layers 20 --threads 1,2 --busy 0,1``
"""

from __future__ import annotations

import argparse
import json
import os
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


def _engine_step(shapes, back_to_back: bool):
    """A callable running the engine's host step over ``shapes`` (one chunk's pieces), and
    the number of tensors its fused calls take."""
    import torch

    from protrain.chunks.chunk import ParamSlot
    from protrain.chunks.layout import ParamPlacement
    from protrain.chunks.manager import _align64, _carve
    from protrain.optim.flat_adamw import FlatAdamW
    from protrain.optim.hybrid_adamw import _pieces, _step_host_piece

    numels = [a * b for a, b in shapes]
    arena = torch.empty(2 * sum(_align64(4 * n) for n in numels), dtype=torch.uint8)
    order = [(k, i) for i in range(len(shapes)) for k in ("master", "grad")]
    if back_to_back:
        order = sorted(order)  # every grad, then every master: each back to back
    views, off = {}, 0
    for k, i in order:
        views[k, i], off = _carve(arena, off, 4 * numels[i], torch.float32, shapes[i])
    slots = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter(torch.empty(0))
        pl = ParamPlacement([f"p{i}"], 0, 0, numels[i], shape, torch.float32, True)
        s = ParamSlot(p, pl, 0, i, torch.float32, torch.device("cpu"), p.data)
        s.master, s.grad_acc = views["master", i], views["grad", i]
        s.master.normal_()
        s.grad_acc.normal_()
        slots.append(s)
    adams = [FlatAdamW(piece, [0] * len(piece)) for piece in _pieces(slots)]
    hyper = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}]

    def step():
        for adam in adams:
            _step_host_piece(adam, adam.slots, hyper, None, None, {})

    return step, sum(len(a.runs) for a in adams), len(adams)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    p.add_argument("--busy", default="0,1", help="comma-separated counts of spinning processes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", choices=["torch", "engine"], default="torch")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    shapes = [
        s for _ in range(args.layers) for o, i in _PROJ for s in ((args.rank, i), (o, args.rank))
    ]
    numel = sum(a * b for a, b in shapes)
    if args.cases == "torch":
        cases = {"many": _params(shapes), "flat": _params([(numel,)])}
    else:
        cases = {
            "engine_per_tensor": _engine_step(shapes, back_to_back=False),
            "engine_flat": _engine_step(shapes, back_to_back=True),
        }
    rows = []
    for busy in (int(b) for b in args.busy.split(",")):
        spinners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)
        ]
        try:
            time.sleep(0.5 if busy else 0)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for name, case in cases.items():
                    if args.cases == "torch":
                        opt = torch.optim.AdamW(case, fused=True)
                        run, tensors, extra = opt.step, len(case), {}
                    else:
                        run, fused_tensors, pieces = case
                        tensors = len(shapes)
                        extra = {"fused_tensors": fused_tensors, "pieces": pieces}
                    run()  # state made
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        run()
                        times.append(time.perf_counter() - t0)
                    step = sorted(times)[len(times) // 2]
                    row = {"tensors": tensors, **extra, "params": numel, "threads": threads,
                           "busy_neighbours": busy, "case": name, "step_s": round(step, 4),
                           "g_params_per_s": round(numel / step / 1e9, 3),
                           "load_avg_1min": round(os.getloadavg()[0], 2),
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
