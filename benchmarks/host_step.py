"""The host's share of an offloaded step: torch's fused AdamW with its separate passes
against the one-pass kernel, per parameter, on this host's CPU.

Times the update of ``--numel`` parameters (bf16 weights): today's path (the fp32 gradient
read by torch's fused AdamW, with a pass each for unscaling and clipping when asked) and the
one pass (the bf16 gradient read, unscale and clip inside, the bf16 copy written). Reports
seconds, the update's own bytes a parameter (as the engine's ``host_update_bytes`` counts
them) and the GB/s that makes. ``--states bf16 8bit`` adds the one pass over compact moments
(``optimizer_state``, ``optim/state_format.py``). ``--threads 1`` times one core's arithmetic
(run it again with ``ATEN_CPU_CAPABILITY=avx2`` or ``default`` for the other builds). Appends
one JSON row per path to ``--out``.

    PYTHONPATH=src python benchmarks/host_step.py --numel 50000000 --clip --out rows.jsonl
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from protrain.optim import host_adam_ext
from protrain.optim import state_format as sf
from protrain.optim.flat_adamw import fused_adamw
from rows import emit  # benchmarks/: this script's folder is on sys.path

HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _state(n: int) -> dict:
    torch.manual_seed(0)
    return {
        "master": torch.randn(n),
        "m": torch.zeros(n),
        "v": torch.zeros(n),
        "grad_low": torch.randn(n).to(torch.bfloat16),
        "grad_fp32": torch.randn(n),
        "out": torch.empty(n, dtype=torch.bfloat16),
    }


def _torch_step(st: dict, step: int, inv: float | None, clip: float | None) -> None:
    grads = [st["grad_fp32"]]
    if inv is not None:
        torch._foreach_mul_(grads, inv)
    if clip is not None:
        torch._foreach_mul_(grads, clip)
    fused_adamw([st["master"]], grads, [st["m"]], [st["v"]],
                [torch.tensor(float(step - 1))], HYPER)  # fmt: skip


def _one_pass(kernel, st: dict, step: int, inv: float | None, clip: float | None) -> None:
    kernel.adamw_step([st["master"]], [st["m"]], [st["v"]], [st["grad_low"]], [st["out"]],
                      [float(step)], HYPER["lr"], *HYPER["betas"], HYPER["weight_decay"],
                      HYPER["eps"], inv, clip)  # fmt: skip


def _compact_pass(kernel, st: dict, fmt: str, step: int, inv, clip) -> None:
    """The one pass over ``st``'s master with moments in ``fmt`` (made on first use)."""
    if fmt not in st:
        n = st["master"].numel()
        st[fmt] = sf.new_moments(fmt, n, sf.n_blocks(n))
    q = st[fmt]
    none = torch.empty(0)
    kernel.adamw_step_compact([st["master"]], [q["exp_avg"]], [q["exp_avg_sq"]],
                              [q.get(sf.ABSMAX[0], none)], [q.get(sf.ABSMAX[1], none)],
                              [st["grad_low"]], [st["out"]], [float(step)], [12345],
                              sf.KERNEL_FORMAT[fmt], HYPER["lr"], *HYPER["betas"],
                              HYPER["weight_decay"], HYPER["eps"], inv, clip)  # fmt: skip


def _time(fn, repeats: int) -> float:
    fn(1)  # first touch and thread start-up
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(r + 2)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=20_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clip", action="store_true", help="unscale and clip too (fp16, clipping)")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--states", nargs="*", default=[], choices=["bf16", "8bit"])
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (default: its own)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    inv, clip = (1.0 / 1024, 0.5) if args.clip else (None, None)
    kernel = host_adam_ext.kernel()
    st = _state(args.numel)
    paths = {"torch_fused": (lambda s: _torch_step(st, s, inv, clip), 28 + (16 if clip else 0))}
    if kernel is not None:
        paths["one_pass"] = (lambda s: _one_pass(kernel, st, s, inv, clip), 2 + 24 + 2)
        for fmt in args.states:
            nbytes = sf.host_update_bytes_per_param(torch.bfloat16, fmt, bool(clip))
            paths[f"one_pass_{fmt}"] = (
                lambda s, fmt=fmt: _compact_pass(kernel, st, fmt, s, inv, clip),
                nbytes,
            )
    for name, (fn, nbytes) in paths.items():
        seconds = _time(fn, args.repeats)
        row = {
            "bench": "host_step", "path": name, "numel": args.numel, "clip": args.clip,
            "seconds": round(seconds, 5), "bytes_per_param": nbytes,
            "ns_per_param": round(seconds / args.numel * 1e9, 3),
            "gb_per_s": round(nbytes * args.numel / seconds / 1e9, 2),
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "capability": host_adam_ext.capability(),
        }  # fmt: skip
        emit(row, args.out)


if __name__ == "__main__":
    main()
