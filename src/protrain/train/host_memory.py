"""Refuse, before loading, a model that the host cannot hold once per rank.

Every rank of a host loads the whole model into host memory before the engine splits it
into chunks (and, sharded, keeps only its shard): a host of R ranks holds R copies at
once, in ``model.dtype``. When that is more than the host has, the kernel's out-of-memory
killer ends ranks with no Python error, and `torchrun` reports a bare exit code -9 (a
70B model in fp32 on four ranks of a 503 GiB host needs 1,052 GiB). Reading the
checkpoint's safetensors headers costs nothing, so the run says it in one line first.

Counted: the parameters of the local safetensors files at their loaded dtype. Not counted:
what training adds afterwards (the plan's host budget covers that in auto mode), models
that are not local directories of safetensors (hub ids are not read ahead), and a
QLoRA base's quantization, which happens after the whole base is loaded.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from protrain.plan.host_budget import available_host_bytes
from protrain.train.errors import ConfigError
from protrain.units import GIB

_HEADER_LIMIT = 100 * 2**20  # a safetensors header larger than this is not one


def checkpoint_numel(directory: Path) -> int | None:
    """Elements of every tensor in the directory's ``*.safetensors`` files, from their
    headers alone; None when it holds none (or one cannot be read as safetensors)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > _HEADER_LIMIT:
                    return None
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None  # the loader reports a damaged file itself
        total += sum(
            math.prod(entry["shape"])
            for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and "shape" in entry
        )
    return total


def check_host_memory_for_loading(
    name_or_path: str,
    itemsize: int,
    dtype_name: str,
    local_ranks: int,
    available: int | None = None,
) -> None:
    """Raise ConfigError when ``local_ranks`` copies of the local model at ``itemsize``
    bytes a parameter exceed the host memory available (``available``: measured when
    None; nothing is checked where it is unknown)."""
    directory = Path(name_or_path)
    if not directory.is_dir():
        return
    numel = checkpoint_numel(directory)
    if numel is None:
        return
    if available is None:
        available = available_host_bytes()
        if available is None:
            return
    per_rank = numel * itemsize
    need = per_rank * local_ranks
    if need <= available:
        return
    ranks = (
        f"on each of this host's {local_ranks} ranks, {need / GIB:.1f} GiB in all"
        if local_ranks > 1
        else "on the host"
    )
    fewer = "fewer ranks on this host (torchrun --nproc-per-node), " if local_ranks > 1 else ""
    raise ConfigError(
        f"model.name_or_path = {name_or_path!r}: loading it needs {per_rank / GIB:.1f} GiB "
        f"of host memory {ranks} ({numel / 1e9:.2f} B parameters x {itemsize} bytes, "
        f"model.dtype = {dtype_name!r}), and the host has {available / GIB:.1f} GiB "
        f"available. Allowed: {fewer}a smaller model, model.dtype = 'bfloat16' with an "
        "adapter (lora, qlora), or a host with more memory"
    )
