"""The ranks of this run, as the application sees them (one, or several under `torchrun`).

`protrain train` under `torchrun --nproc-per-node N` runs one process per GPU. Every rank
reads the whole dataset in the same seeded order; each optimizer step takes
`gradient_accumulation_steps x N` micro-batches of the stream, and rank r trains on those at
positions r, r + N, ... of the step, so the global batch is the same micro-batches a single
process with N times the accumulation would train on. Each rank counts the trained tokens
of the whole step itself (it has every row), divides its loss by that count, and the engine
sums the gradients over ranks (`grad_reduce="sum"`): the gradient of the mean token loss
of the global batch, as on one process.

Rank 0 alone writes the lock, metrics, logs, the progress bar, the export and each
checkpoint's metadata and rename; every rank writes its own part of a checkpoint
(`checkpoint/sharded.py`). Every rank takes part in what is a collective in the engine
(state dicts and close in the sharded mode), and decisions that must be the same everywhere (skip a non-finite step, stop
on a signal) are made from values reduced over ranks.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

# imported before any group exists: the functions of torch.distributed.nn.functional take
# `group.WORLD` as it is at import for a default, and would hold the group to the end of
# the process (see `stop_ranks`); torch.distributed.fsdp and torch._dynamo import it
import torch.distributed.nn.functional  # noqa: F401

from protrain.distributed.agree import PATIENT_POLL_S, from_main, on_main_patiently
from protrain.distributed.process_group import (
    SINGLE,
    DistContext,
    init_from_env,
    launched_distributed,
)
from protrain.train import rank_failure

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    ctx: DistContext = SINGLE

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def several(self) -> bool:
        return self.ctx.is_distributed

    def _reduce(self, values: list[float], op) -> list[float]:
        if not self.several:
            return values
        # on the CPU (gloo): a decision per step must not wait for the GPU's queue
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.ctx.group)
        return t.tolist()

    def sum(self, *values: float) -> list[float]:
        return self._reduce(list(values), dist.ReduceOp.SUM)

    def max(self, *values: float) -> list[float]:
        return self._reduce(list(values), dist.ReduceOp.MAX)

    def any(self, flag: bool) -> bool:
        return self.max(1.0 if flag else 0.0)[0] > 0

    def barrier(self) -> None:
        if self.several:
            dist.barrier(group=self.ctx.group)

    def from_main(self, obj):
        """Rank 0's ``obj`` on every rank."""
        return from_main(self.ctx, obj)

    def on_main_patiently(self, fn: Callable[[], T], poll_s: float = PATIENT_POLL_S) -> T:
        """``fn()`` run by rank 0, its result (or its exception) on every rank, for work
        that may outlast the group's collective timeout: at resume, rank 0 hashes every
        file of the newest checkpoint, hundreds of GB on slow storage for a large model
        (``agree.on_main_patiently``; the poll on the CPU, which the application's group
        serves with gloo beside NCCL)."""
        return on_main_patiently(self.ctx, fn, poll_s=poll_s)


_joined = False  # start_ranks ran under a launcher: errors after it may be this rank's own


def joined_ranks() -> bool:
    """Whether this process started (or tried to start) the ranks of a `torchrun` launch;
    an error before that is every rank's alike (the same config and files)."""
    return _joined


def start_ranks(device: torch.device) -> tuple[Ranks, torch.device]:
    """The process group of a `torchrun` launch (NCCL for CUDA, gloo on the CPU) and this
    rank's device (GPU `LOCAL_RANK`); one process: nothing to start."""
    if not launched_distributed():
        return Ranks(), device
    global _joined
    _joined = True
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    ctx = init_from_env(device.type)
    rank_failure.join()  # so that a rank's failure reaches every node as one line
    return Ranks(ctx), device


def stop_ranks() -> None:
    """End the process group of the run. A closed engine lives on in reference cycles, and
    FSDP2's units hold their group (on one process the engine's own, ended in its `close`):
    collected here, the group is freed now, not at interpreter exit, where gloo's threads
    can abort the process ([Note: the group is held weakly] in
    `protrain/distributed/process_group.py`)."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
