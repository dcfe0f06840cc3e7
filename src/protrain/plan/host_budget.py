"""The host-memory budget of an automatic plan when the user gives none.

Offloaded chunks, their fp32 masters and accumulators, and swapped activations all live in
pinned host memory, which the kernel cannot page out: a plan that needs more than the host
has does not slow down, the kernel's out-of-memory killer ends the process without a Python
error. Session 9 saw it: long-8b at 65,536 tokens on an 80 GiB budget planned 27 swapped
blocks, 321 GiB of host memory on a 251 GiB host, and the run died. So auto mode bounds host
memory by default, with what the kernel says it can give when the plan is made
(``MemAvailable``: free memory plus the cache it can reclaim; the trace has given its own
arena back by then, the model's weights are still counted as used), less a tenth for
everything that is not the plan's (the data loader, the CUDA context, Python).
"""

from __future__ import annotations

from pathlib import Path

_MEMINFO = Path("/proc/meminfo")
SHARE = 0.9  # of the available memory


def available_host_bytes(meminfo: Path = _MEMINFO) -> int | None:
    """``MemAvailable`` in bytes, or None where the kernel does not report it (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                return None
            return int(value) * 1024
    return None


def default_cpu_budget(meminfo: Path = _MEMINFO) -> int | None:
    """The host budget auto mode plans with when none is given: ``SHARE`` of the available
    memory; None (not limited) where that is unknown."""
    avail = available_host_bytes(meminfo)
    return None if avail is None else int(avail * SHARE)
