"""How fast host memory can be allocated, pinned and filled: the wrap's fixed cost.

A large model's wrap pins one host arena for every offloaded chunk (host copy, fp32 master,
fp32 gradient accumulator, gradient landing place: 12 bytes a parameter in bf16 full
fine-tuning) with ``cudaHostRegister``, then copies the parameters in. This times each way of
getting ``--gib`` of pinned host memory, and the copies that follow, one JSON line each:

- ``empty_register``: ``torch.empty`` then ``cudaHostRegister`` (the engine's way);
- ``empty_touch_register``: the same with the pages first written by torch's threaded
  ``zero_``, so that the driver pins resident pages instead of faulting each one in;
- ``mmap_huge_touch_register``: an anonymous ``mmap`` advised ``MADV_HUGEPAGE`` (2 MiB
  pages where the kernel's transparent huge pages allow), touched, then registered;
- ``pin_memory``: ``torch.empty(pin_memory=True)`` (``cudaHostAlloc``);
- copies into pinned memory: bf16 to bf16, bf16 to fp32 (the master), ``zero_`` (the
  gradient accumulator), and a device-to-host bf16 copy.

Usage: ``python benchmarks/host_pinning.py --gib 16 --out results.jsonl``
"""

from __future__ import annotations

import argparse
import json
import mmap
import time
from pathlib import Path

import torch


def _register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class _Watch:
    """Seconds since the last ``lap``."""

    def __init__(self):
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        out, self.t = now - self.t, now
        return out


def _thp() -> dict:
    out = {}
    for name in ("enabled", "defrag"):
        path = Path(f"/sys/kernel/mm/transparent_hugepage/{name}")
        out[name] = path.read_text().strip() if path.exists() else None
    return out


def run(gib: float) -> list[dict]:
    nbytes = int(gib * 2**30)
    rows = []

    def row(way: str, written: float = gib, **parts: float) -> None:
        """``written``: GiB the way pins or writes."""
        total = sum(parts.values())
        rows.append(
            {
                "way": way,
                "gib": round(written, 3),
                "seconds": {k: round(v, 3) for k, v in parts.items()},
                "total_s": round(total, 3),
                "gib_per_s": round(written / total, 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    def pin_cycle(way: str, make, touch: bool) -> None:
        """Allocate with ``make``, optionally write every byte, register, unregister."""
        w.lap()
        t = make()
        parts = {"alloc": w.lap()}
        if touch:
            t.zero_()
            parts["touch"] = w.lap()
        _register(t)
        parts["register"] = w.lap()
        _unregister(t)
        parts["unregister"] = w.lap()
        row(way, **parts)

    def huge() -> torch.Tensor:  # as protrain.chunks.manager.host_arena, before its touch
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(mm, dtype=torch.uint8)

    def empty() -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    w = _Watch()
    pin_cycle("empty_register", empty, touch=False)
    pin_cycle("empty_touch_register", empty, touch=True)
    pin_cycle("mmap_huge_touch_register", huge, touch=True)

    w.lap()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    row("pin_memory", alloc=w.lap())

    # Copies into the pinned block, as the wrap makes them (a quarter of it each).
    q = nbytes // 4 // 4 * 4
    src = torch.randn(q // 4, dtype=torch.bfloat16)  # q/2 bytes of bf16
    dst16 = pinned[: q // 2].view(torch.bfloat16)
    dst32 = pinned[q : 2 * q].view(torch.float32)[: q // 4]
    half, full = q / 2 / 2**30, q / 2**30  # GiB written as bf16, as fp32
    w.lap()
    dst16.copy_(src)
    row("copy_bf16_to_pinned_bf16", half, copy=w.lap())
    dst32.copy_(src)
    row("copy_bf16_to_pinned_fp32", full, copy=w.lap())
    dst32.zero_()
    row("zero_pinned_fp32", full, zero=w.lap())
    dev = src.cuda()
    torch.cuda.synchronize()
    w.lap()
    dst16.copy_(dev)
    torch.cuda.synchronize()
    row("d2h_bf16_to_pinned", half, copy=w.lap())
    dst32.copy_(dev)
    row("d2h_bf16_to_pinned_fp32", full, copy=w.lap())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    info = {
        "gpu": torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "thp": _thp(),
        "torch": torch.__version__,
    }
    print(json.dumps(info), flush=True)
    rows = run(args.gib)
    with args.out.open("a") as f:
        for r in rows:
            f.write(json.dumps({**info, **r}) + "\n")


if __name__ == "__main__":
    main()
