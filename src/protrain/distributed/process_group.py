"""The ranks that train together.

``resolve_context`` is what ``protrain.wrap`` uses: a process group given by the caller, else
the default group when ``torch.distributed`` is initialized, else a single rank.
``init_from_env`` is what the application uses under ``torchrun``: it initializes the default
group from the launcher's environment (NCCL with CUDA, gloo on the CPU) and binds the rank
to its local GPU.

[Note: the group is held weakly] A ``DistContext`` (and so every engine built on it) refers
to its process group through a weak reference: the group's life is its owner's (torch's
registry from ``init_process_group``/``new_group`` until ``destroy_process_group``). gloo
stops its worker threads only when the last reference to its ``ProcessGroup`` goes, and a
closed engine lives on as garbage in reference cycles until a collection, at the latest the
one of interpreter exit. Held strongly by such garbage, the group would outlive
``destroy_process_group`` into interpreter finalization, where a gloo worker still releasing
a finished collective's tensors (after the caller's ``wait`` returned) needs the GIL, is
ended by the finalizing interpreter inside a ``noexcept`` destructor, and aborts the process
("terminate called without an active exception", SIGABRT after a run that passed).
"""

from __future__ import annotations

import datetime
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits longer than this ends the process with an error instead of
# hanging: a rank that died mid-step must not leave the others blocked forever.
DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True)
class DistContext:
    """Rank and size of the group that trains one model together (one rank: no group)."""

    # a weak reference to the torch.distributed.ProcessGroup ([Note: the group is held
    # weakly]); None for a single rank
    group_ref: Callable[[], object | None] | None
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str = "none"

    @property
    def group(self) -> object | None:
        """The ``ProcessGroup``; None for a single rank."""
        if self.group_ref is None:
            return None
        group = self.group_ref()
        if group is None:  # never None for a live group: None means the default group
            raise RuntimeError(
                "protrain: the process group was destroyed while this engine still uses it "
                "(close the model before dist.destroy_process_group())"
            )
        return group

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check_device(self, device: torch.device) -> None:
        """Collectives run on the compute device: NCCL needs CUDA tensors, gloo CPU ones
        (a group of both, ``cpu:gloo,cuda:nccl``, serves either)."""
        if not self.is_distributed:
            return
        needs = "nccl" if device.type == "cuda" else "gloo"
        if needs not in self.backend:
            raise ValueError(
                f"protrain: the process group's backend is {self.backend!r} and the compute "
                f"device is {device}: use NCCL with CUDA devices and gloo with the CPU"
            )


SINGLE = DistContext(group_ref=None)
# ``process_group=NO_GROUP``: this process alone, even when a default group is initialized
# (the planner's trace runs on one rank while the others wait).
NO_GROUP = "no-group"


def resolve_context(process_group=None) -> DistContext:
    """The context of ``process_group``, of the default group, or of a single rank."""
    if process_group is NO_GROUP:
        return SINGLE
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return SINGLE
        process_group = dist.group.WORLD
    world = dist.get_world_size(process_group)
    if world == 1:
        return SINGLE
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return DistContext(
        group_ref=weakref.ref(process_group),
        rank=dist.get_rank(process_group),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank(process_group))),
        local_world_size=local_world,
        backend=str(dist.get_backend(process_group)),
    )


def launched_distributed() -> bool:
    """True under a launcher (``torchrun``) that asked for more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(
    device_type: str | None = None, timeout_s: int = DEFAULT_TIMEOUT_S
) -> DistContext:
    """Initialize the default process group from ``torchrun``'s environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ...) when more than one process was launched; bind
    this rank to GPU ``LOCAL_RANK``. One process: nothing is initialized."""
    if not launched_distributed():
        return SINGLE
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        # CUDA: NCCL for the engine's tensors, gloo beside it for the application's small
        # CPU reductions (a decision per step), which then never wait for the GPU
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return resolve_context()
