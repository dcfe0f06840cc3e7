"""How many bytes of device memory are in use now, and the most since the last reset.

On CUDA the caching allocator's own statistics answer (``memory_allocated``,
``max_memory_allocated``). On the CPU there is no device allocator to ask, so
:class:`TensorBytesCounter` keeps the books itself: a ``TorchDispatchMode`` sees every op the
current thread runs and adds the bytes of each new storage an op returns (an output that
shares the storage of an input, a view or an in-place result, is not new); a weak-reference
callback subtracts them when the storage is freed. It counts tensor bytes only (no allocator
rounding), and only storages created while it is active: bytes that existed before are the
caller's baseline. Work done on other threads (the engine's host optimizer worker) is not
seen, which is what a CPU stand-in for a device wants: that work is host work.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorBytesCounter(TorchDispatchMode):
    """Live bytes of storages created by ops under this mode, and their peak.

    ``on_op`` (optional) is called after every op with the counter, so a caller can sample a
    memory curve at op granularity.
    """

    def __init__(self, on_op: Callable[[TensorBytesCounter], None] | None = None):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.on_op = on_op
        self._tracked: dict[int, weakref.ref] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.pop(key, None)
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if inputs is None:
                inputs = {
                    a.untyped_storage().data_ptr()
                    for a in tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor) and a.device.type != "meta"
                }
            if st.data_ptr() in inputs and st.nbytes():
                continue
            key = id(st)
            ref = self._tracked.get(key)
            if ref is not None and ref() is st:
                continue
            nbytes = st.nbytes()
            self._tracked[key] = weakref.ref(st, lambda _r, k=key, n=nbytes: self._free(k, n))
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.on_op is not None:
            self.on_op(self)
        return out

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


class MemoryClock:
    """One interface over both: ``now()``, ``peak()`` since ``reset_peak()``, in bytes.

    ``exclude`` returns bytes to take out of every CUDA reading (the trace uses it for
    offloaded chunks resident in the buffer pool, which the plan counts as a term of its
    own). The CPU counter never sees them: chunk storage is resized in place, not made by ops.
    """

    def __init__(self, device: torch.device, exclude: Callable[[], int] | None = None):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.exclude = exclude or (lambda: 0)
        self.counter: TensorBytesCounter | None = None

    def __enter__(self) -> MemoryClock:
        if not self.is_cuda:
            self.counter = TensorBytesCounter()
            self.counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.counter is not None:
            self.counter.__exit__(*exc)
            self.counter = None

    def now(self) -> int:
        if self.is_cuda:
            return torch.cuda.memory_allocated(self.device) - self.exclude()
        return self.counter.live_bytes

    def peak(self) -> int:
        if self.is_cuda:
            return torch.cuda.max_memory_allocated(self.device) - self.exclude()
        return self.counter.peak_bytes

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.counter.reset_peak()

    def raw_peaks(self) -> tuple[int, int]:
        """(allocated, reserved) peak bytes since ``reset_peak()``, nothing excluded (CUDA;
        (0, 0) on the CPU)."""
        if not self.is_cuda:
            return 0, 0
        stats = torch.cuda.memory_stats(self.device)
        return stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
