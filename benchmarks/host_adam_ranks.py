"""How fast can one host step AdamW for several ranks at once: the floor of a step whose
optimizer state lives on the host.

With every offloaded parameter stepped on the host once a step, no schedule makes a step
shorter than the host AdamW it holds; with several ranks on one host their AdamWs share
the host's memory. This times torch's fused CPU AdamW (as the engine runs it: one flat
fp32 tensor per state, ``threads`` intra-op threads) in ``procs`` processes started
together, each over ``numel`` parameters, and reports each process's rate and their sum.
Read beside a training row: a rank's offloaded parameters divided by the rate of ``procs``
= local ranks is the step's host floor; FSDP2 CPU offload's step is about its GPU compute
plus the same AdamW, so (compute + floor) / floor bounds a ratio against it.

Beside it, the same processes time an in-place add over the same fp32 tensor, together, as
a memory roof: it reads 8 bytes and writes 4 an element, while the fused AdamW reads 16
(master, gradient, two moments) and writes 12; both are in place, so no write-allocate
traffic. ``adam_gbps_total`` against ``add_gbps_total`` says whether the AdamW runs at the
host's memory bandwidth (then no kernel with the same fp32 state is much faster) or below it.

Usage: ``python benchmarks/host_adam_ranks.py --procs 1 2 --numel 268435456 --out x.jsonl``
(``--threads`` default: the engine's share of the cores per process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from protrain.runtime.host_worker import default_host_threads

# Bytes an element: the fused AdamW reads master, gradient and moments and writes three back
_ADAM_BYTES = 28
_ADD_BYTES = 12  # a.add_(b): reads two, writes one


def _worker(rank: int, numel: int, steps: int, threads: int, barrier, out) -> None:
    torch.set_num_threads(threads)
    p, g, m, v = (torch.empty(numel) for _ in range(4))
    for t, x in zip((p, g, m, v), (0.5, 1e-3, 0.0, 0.0)):
        t.fill_(x)  # touch every page before the timing
    p.requires_grad_(True)
    p.grad = g
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
    times, adds = [], []
    for _ in range(steps):
        barrier.wait()  # every process steps at once, as ranks do
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        for _ in range(steps):
            barrier.wait()
            t0 = time.perf_counter()
            m.add_(g)
            adds.append(time.perf_counter() - t0)
    out.put((rank, (times, adds)))


def rates(procs: int, numel: int, steps: int, threads: int) -> dict:
    """One measurement: ``procs`` processes stepping together; the first step is left out."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, numel, steps, threads, barrier, out))
          for r in range(procs)]  # fmt: skip
    for p in ps:
        p.start()
    got = dict(out.get() for _ in ps)
    for p in ps:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a process exited with {p.exitcode}")
    each = [numel / statistics.median(got[r][0][1:]) / 1e9 for r in range(procs)]
    add_each = [numel / statistics.median(got[r][1][1:]) / 1e9 for r in range(procs)]
    return {
        "procs": procs,
        "threads": threads,
        "numel": numel,
        "steps": steps,
        "params_per_s_each": [round(x, 3) for x in each],
        "params_per_s_total": round(sum(each), 3),
        "unit": "G params/s (median step)",
        "adam_gbps_total": round(_ADAM_BYTES * sum(each), 1),
        "add_gbps_total": round(_ADD_BYTES * sum(add_each), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--numel", type=int, default=1 << 28, help="parameters per process")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, help="default: default_host_threads(procs)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is left out)")
    for n in args.procs:
        threads = args.threads or default_host_threads(n)
        row = {"torch": torch.__version__, **rates(n, args.numel, args.steps, threads)}
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
