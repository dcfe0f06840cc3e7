"""Does the host AdamW run faster over memory on 2 MiB pages than on 4 KiB pages?

The host AdamW streams 28 bytes a parameter (fp32 parameter, gradient and two moments read;
parameter and moments written). With 4 KiB pages every 4 KiB of each stream is a new page
translation; with transparent huge pages one covers 2 MiB. This times torch's fused CPU
AdamW, as the engine runs it (a worker thread with the engine's host thread count), over
parameter, gradient and moments that live either in ordinary ``torch.zeros`` tensors or in
one ``MADV_HUGEPAGE`` mapping (``protrain.chunks.manager.host_arena``). One JSON line per
page kind: parameters per second, best and median of ``--steps`` steps.

Usage: ``python benchmarks/host_adam_pages.py --numel 268435456 --out results.jsonl``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from protrain.chunks.manager import host_arena
from protrain.runtime.host_worker import default_host_threads


def _tensors(numel: int, huge: bool) -> list[torch.Tensor]:
    """Parameter, gradient, exp_avg, exp_avg_sq: fp32, ``numel`` each."""
    if not huge:
        return [torch.zeros(numel) for _ in range(4)]
    arena = host_arena(4 * numel * 4).view(torch.float32)
    return [arena[i * numel : (i + 1) * numel] for i in range(4)]


def _rate(numel: int, huge: bool, steps: int) -> dict:
    p, g, m, v = _tensors(numel, huge)
    p.fill_(0.5)
    g.fill_(1e-3)
    p.requires_grad_(True)
    p.grad = g
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    # The state torch's AdamW would make, in the chosen memory (its own format:
    # torch.optim.AdamW._init_group keeps a state that is already there).
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
    huge_kib = _anon_huge_kib()  # while the tensors live: did the huge pages come?
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    assert opt.state[p]["exp_avg"] is m  # the step used the given moments
    best, median = min(times[1:]), statistics.median(times[1:])
    return {
        "pages": "huge" if huge else "4k",
        "numel": numel,
        "steps": steps,
        "best_params_per_s": round(numel / best / 1e9, 3),
        "median_params_per_s": round(numel / median / 1e9, 3),
        "unit": "G params/s",
        "anon_huge_pages_gib": round(huge_kib / 2**20, 2),
    }


def _anon_huge_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 28)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    threads = default_host_threads()
    info = {"threads": threads, "torch": torch.__version__}
    rows = []
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        for huge in (False, True, False, True):  # twice each, interleaved
            row = {**info, **pool.submit(_rate, args.numel, huge, args.steps).result()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with args.out.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
