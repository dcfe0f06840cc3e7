"""Run a function on several processes joined by a process group (gloo on the CPU, NCCL)."""

from __future__ import annotations

import datetime
import os
import tempfile
import weakref

import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 120


def _entry(
    rank: int, world: int, init_file: str, backend: str, check_group_freed: bool, fn, args
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    # before the group: its functions' defaults would hold it (protrain/train/ranks.py)
    import torch.distributed.nn.functional  # noqa: F401

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # ranks that disagree on the collectives they issue fail here instead of hanging the run
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout
    )
    group = weakref.ref(dist.group.WORLD)
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():  # ``fn`` may end it itself (`protrain.train.ranks.stop_ranks`)
            dist.destroy_process_group()
    if check_group_freed:
        assert group() is None, f"rank {rank}: the process group outlived its destruction"


def run_ranks(
    world: int, fn, *args, backend: str = "gloo", check_group_freed: bool = False
) -> None:
    """``fn(rank, world, *args)`` on ``world`` spawned processes (``backend="nccl"``: rank r
    on GPU r); raises if any failed.

    ``check_group_freed``: each rank asserts that ``destroy_process_group`` freed its group,
    i.e. nothing ``fn`` left behind, garbage included, holds it. gloo stops its threads only
    when the group is freed, and threads that live into interpreter exit can abort the rank
    after a passing run ([Note: the group is held weakly] in
    ``protrain/distributed/process_group.py``). A rank of the FSDP2 engine ends with
    ``protrain.train.ranks.stop_ranks()``, as ``protrain train`` does: its closed units are
    garbage in reference cycles that hold the group until a collection."""
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "pg")
        spawn_args = (world, init, backend, check_group_freed, fn, args)
        mp.spawn(_entry, args=spawn_args, nprocs=world, join=True)
