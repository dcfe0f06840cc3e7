"""The host-memory budget of an automatic plan when the user gives none.

Offloaded chunks, their fp32 masters and accumulators, and swapped activations all live in
pinned host memory, which the kernel cannot page out: a plan that needs more than the host
has does not slow down, the kernel's out-of-memory killer ends the process without a Python
error. On one H200 host, long-8b at 65,536 tokens on an 80 GiB budget planned 27 swapped
blocks, 321 GiB of host memory on a 251 GiB host, and the run died. So auto mode bounds host
memory by default, with what the kernel says it can give when the plan is made
(``MemAvailable``: free memory plus the cache it can reclaim; the trace has given its own
arena back by then, the model's weights are still counted as used), or what the process's
memory cgroup still allows if that is less (a container or a batch job sees the whole
node's ``/proc/meminfo``), less a tenth for everything that is not the plan's (the data
loader, the CUDA context, Python).

Not counted: host memory a run takes beside the plan's (a checkpoint save writes views of
the engine's tensors, not copies, so it adds little; the data loader's workers); and on a
machine whose memory grows on demand (some VMs) the available memory at plan time
understates it. Either way ``cpu_budget`` sets the figure.
"""

from __future__ import annotations

from pathlib import Path

SHARE = 0.9  # of the available memory
_MEMINFO = Path("/proc/meminfo")
_CGROUP_FS = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


def meminfo_available_bytes(meminfo: Path = _MEMINFO) -> int | None:
    """``MemAvailable`` in bytes, or None where the kernel does not report it (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                value, unit = line.split()[1:3]
                return int(value) * 1024 if unit == "kB" else None
    except (OSError, ValueError):
        pass
    return None


def cgroup_available_bytes(fs: Path = _CGROUP_FS, proc_cgroup: Path = _PROC_CGROUP) -> int | None:
    """What this process's memory cgroup (and each cgroup above it) still allows: limit less
    usage (its inactive file cache left out), the least over the levels; None where no level
    has a limit. cgroup v2 (``memory.max``, ``memory.current``) or v1
    (``memory.limit_in_bytes``, ``memory.usage_in_bytes``)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy
            base, files = fs, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = fs / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        level = base / path.lstrip("/")
        while True:
            left = _limit_left(level / files[0], level / files[1], level / "memory.stat", files[2])
            if left is not None:
                found.append(left)
            if level == base or base not in level.parents:
                break
            level = level.parent
    return min(found) if found else None


def _limit_left(limit_file: Path, usage_file: Path, stat_file: Path, cache_key: str) -> int | None:
    """Limit less usage, the usage without the file cache the kernel would reclaim first
    (``inactive_file`` of ``memory.stat``, as kubelet's working set leaves it out): just
    after a model is read from disk its pages are cache, not memory a plan competes with."""
    try:
        limit = limit_file.read_text().strip()
        if limit == "max":
            return None
        limit_bytes = int(limit)
        if limit_bytes >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        usage = int(usage_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        for line in stat_file.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                usage -= min(int(value), usage)
                break
    except (OSError, ValueError):
        pass
    return max(limit_bytes - usage, 0)


def available_host_bytes(
    meminfo: Path = _MEMINFO, fs: Path = _CGROUP_FS, proc_cgroup: Path = _PROC_CGROUP
) -> int | None:
    """Host memory this process can still take: the least of ``MemAvailable`` and its memory
    cgroup's room; None when neither is known."""
    known = [
        b
        for b in (meminfo_available_bytes(meminfo), cgroup_available_bytes(fs, proc_cgroup))
        if b is not None
    ]
    return min(known) if known else None


def default_cpu_budget(
    meminfo: Path = _MEMINFO, fs: Path = _CGROUP_FS, proc_cgroup: Path = _PROC_CGROUP
) -> int | None:
    """The host budget auto mode plans with when none is given: ``SHARE`` of the available
    memory; None (not limited) where that is unknown."""
    avail = available_host_bytes(meminfo, fs, proc_cgroup)
    return None if avail is None else int(avail * SHARE)
