"""Run a function on several processes joined by a process group (gloo on the CPU, NCCL)."""

from __future__ import annotations

import datetime
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 120


def _entry(rank: int, world: int, init_file: str, backend: str, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # ranks that disagree on the collectives they issue fail here instead of hanging the run
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on ``world`` spawned processes (``backend="nccl"``: rank r
    on GPU r); raises if any failed."""
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "pg")
        mp.spawn(_entry, args=(world, init, backend, fn, args), nprocs=world, join=True)
