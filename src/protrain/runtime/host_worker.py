"""The host worker: one thread that runs the engine's CPU tasks, most urgent first.

The host AdamW steps of offloaded chunks, and the host accumulation of later micro-batches'
gradients, run on one thread (each kernel uses ``host_threads`` intra-op threads, so two
tasks at once would only share the same cores and memory bandwidth). Which task runs next
decides how long the next forward waits: it needs the chunks in forward order, and without
clipping their updates arrive from backward in the reverse order. A FIFO queue
(``ThreadPoolExecutor``) stepped the first chunk the forward needs last, so the forward
waited for every update; this queue runs the queued task of lowest ``priority`` first (ties
in submission order), and the optimizer gives each chunk's update its position in the
forward order. See [Note: overlap and exact clipping] in ``optim/hybrid_adamw.py``.

A task may say when it is ready (``ready``: its gradients' device-to-host copies are done);
the worker runs the most urgent *ready* task, so an update whose copies are still in flight
does not hold the host back from one that could run now (``step()`` without clipping queues
every update at once, possibly while the device still runs backward). When nothing queued is
ready, it checks again every ``_POLL_S`` or when a task arrives.

Written here rather than taken from ``concurrent.futures``: its executors have no priorities.
The thread is a daemon, and every live worker is shut down (its queue run) at interpreter
exit, as ``concurrent.futures`` does for its own: a daemon thread killed inside a torch
kernel aborts the process.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import math
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

URGENT = -1.0  # gradient accumulations: an update of the same chunk must find them done
LAST = math.inf  # barriers: after everything queued before them
_POLL_S = 0.0005  # while nothing queued is ready
_live: weakref.WeakSet[HostWorker] = weakref.WeakSet()


@atexit.register
def _shutdown_live_workers() -> None:
    for worker in list(_live):
        worker.shutdown(wait=True)


class HostWorker:
    """A single-thread executor with a priority queue; ``submit`` returns a ``Future``."""

    def __init__(self, num_threads: int, name: str = "protrain-host-adam"):
        self._queue: list[tuple[float, int, Future, Callable, tuple, Callable | None]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(num_threads,), name=name,
                                        daemon=True)  # fmt: skip
        self._thread.start()
        _live.add(self)

    def submit(
        self,
        fn: Callable,
        *args: Any,
        priority: float = 0.0,
        ready: Callable[[], bool] | None = None,
    ) -> Future:
        """Queue ``fn(*args)``; among queued tasks that are ready (``ready()`` true, or no
        ``ready``) the lowest ``priority`` runs first, ties in submission order."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("protrain: the host worker is shut down")
            heapq.heappush(self._queue, (priority, next(self._seq), future, fn, args, ready))
            self._cond.notify()
        return future

    def barrier(self) -> None:
        """Wait until every task queued before this call has run."""
        self.submit(lambda: None, priority=LAST).result()

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if wait:
            self._thread.join()

    def _next(self):
        """The most urgent ready task, taken off the queue; None if none is ready (under
        the lock). After shutdown the most urgent one, ready or not: it waits itself."""
        for entry in sorted(self._queue):
            ready = entry[5]
            if ready is None or self._closed or _is_ready(ready):
                self._queue.remove(entry)
                heapq.heapify(self._queue)
                return entry
        return None

    def _run(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                entry = self._next()
                if entry is None:
                    self._cond.wait(timeout=_POLL_S)
                    continue
            _, _, future, fn, args, _ = entry
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)


def _is_ready(ready: Callable[[], bool]) -> bool:
    try:
        return bool(ready())
    except Exception:  # the task itself will meet the error and hand it to its future
        return True


def default_host_threads(local_world_size: int = 1) -> int:
    """Intra-op threads of the host AdamW worker when ``host_threads`` is not given: all
    of this process's threads but two, which stay free for the threads that feed the GPU
    (the Python thread and autograd's device thread) while the host optimizer overlaps
    backward. On the 16-core H200 host, full-3b without clipping ran at 6,141 / 6,505 /
    6,360 / 5,302 tokens/s with 16 / 14 / 12 / 8 threads
    (benchmarks/results/2026-11-22_h200_full-3b_engine-step-in-backward.jsonl).
    With several ranks on one node, each takes its share of the node's cores: torchrun sets
    ``OMP_NUM_THREADS=1`` in every rank, which left the host AdamW one thread (full-3b on
    two H100s: 2.46 s a step for half the model, against 1.16 s for all of it on one)."""
    if local_world_size > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        n = max(1, (cores or os.cpu_count() or 1) // local_world_size)
    else:
        n = torch.get_num_threads()
    return n - 2 if n >= 6 else n
