"""Where a step's copy time goes: bytes and seconds of the chunk manager's host-device
copies, per direction, and the compute stream's waits for gathers.

The counters (running totals in the manager's ``stats``):

- ``h2d_bytes``, ``h2d_s``: bytes copied host-to-device (gathers) and the seconds those
  copies took on their stream; ``d2h_bytes``, ``d2h_s``: the same device-to-host (gradients,
  write-backs). Their ratio is the rate each direction had in training, under the step's
  own concurrency (the other direction, the host optimizer, compute);
- ``copy_busy_s``: seconds either direction was copying (the union of the two), the link's
  busy time;
- ``wait_copy_s``: seconds the compute stream stood still waiting for a gather.

[Note: reading copy times without a sync]
On CUDA each burst of copies enqueued together is bracketed by two timing events on its
stream, and each compute-stream wait by two on the compute stream; nothing is read while the
step runs. ``harvest()`` (the manager calls it when a forward begins) counts the records only
when every one of them has completed (``Event.query``, no synchronization), so that bursts of
the two directions that overlapped in time are counted together and their union is exact;
``settle()`` synchronizes first, for callers between steps. A burst ends before the host
thread blocks on something other than enqueuing (a host update still writing the masters
the next copy reads), so that the stream's idle time is not counted as copying; the gaps
of enqueuing many small copies are, as they are part of the rate training gets. The union
needs the bursts on one time axis: each is read against an anchor event that completed
before it was enqueued (the end of the last burst counted, or the event the manager synchronized
on at construction), so the elapsed times are never negative and stay short.

On the CPU the copies are synchronous on the thread that computes: each is timed directly,
the union is their sum, and every copy second is also a second the compute waited.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

H2D, D2H = "h2d", "d2h"
COUNTERS = ("h2d_bytes", "h2d_s", "d2h_bytes", "d2h_s", "copy_busy_s", "wait_copy_s")
# Records held before harvest() gives up waiting for them all to complete and synchronizes
# (a caller that never lets the device catch up between forwards).
_MAX_PENDING = 8192


@dataclass
class _Burst:
    direction: str
    nbytes: int
    start: torch.cuda.Event
    end: torch.cuda.Event
    anchor: torch.cuda.Event


class Span:
    """Copies of one direction enqueued one after another (see :meth:`CopyTimes.span`):
    ``add(nbytes)`` before enqueuing each copy, ``pause()`` before the host thread blocks."""

    def __init__(self, times: CopyTimes, direction: str, stream) -> None:
        self._times, self._direction, self._stream = times, direction, stream
        self._start = self._anchor = None  # the open burst's start mark and anchor
        self._nbytes = 0

    def add(self, nbytes: int) -> None:
        if self._start is None:
            self._start, self._anchor = self._times._mark(self._stream), self._times._anchor
        self._nbytes += int(nbytes)

    def pause(self) -> None:
        if self._start is not None:
            end = self._times._mark(self._stream)
            self._times._record(self._direction, self._nbytes, self._start, end, self._anchor)
            self._start = self._anchor = None
            self._nbytes = 0


class CopyTimes:
    """The copy counters of one chunk manager, kept in ``stats`` (see the module note)."""

    # the host clock of CPU copies (a seam for tests that simulate a slow link)
    clock = staticmethod(time.perf_counter)

    def __init__(self, device: torch.device, stats: dict) -> None:
        self.is_cuda = device.type == "cuda"
        self.device = device
        self.stats = stats
        for key in COUNTERS:
            stats.setdefault(key, 0 if key.endswith("_bytes") else 0.0)
        self._bursts: list[_Burst] = []
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._anchor = None
        if self.is_cuda:
            self._anchor = torch.cuda.current_stream(device).record_event(_timing_event())
            self._anchor.synchronize()  # construction, not a step

    @contextlib.contextmanager
    def span(self, direction: str, stream=None) -> Iterator[Span]:
        """Time the copies of ``direction`` enqueued on ``stream`` (CUDA; None on the CPU)
        inside the block; the block reports each copy's bytes with ``Span.add``."""
        s = Span(self, direction, stream)
        try:
            yield s
        finally:
            s.pause()

    def wait(self, stream, event) -> None:
        """``stream`` waits for ``event`` (a gather); the stall is counted as copy wait."""
        before = stream.record_event(_timing_event())
        stream.wait_event(event)
        self._waits.append((before, stream.record_event(_timing_event())))

    def harvest(self) -> None:
        """Count the records if all have completed (no synchronization)."""
        if not self.is_cuda or not (self._bursts or self._waits):
            return
        if len(self._bursts) + len(self._waits) > _MAX_PENDING:
            self.settle()
            return
        ends = [b.end for b in self._bursts] + [after for _, after in self._waits]
        if all(e.query() for e in reversed(ends)):  # the latest are the likeliest pending
            self._count()

    def settle(self) -> None:
        """Wait for every copy enqueued so far and count it (a synchronization)."""
        if self.is_cuda and (self._bursts or self._waits):
            torch.cuda.synchronize(self.device)
            self._count()

    def close(self) -> None:
        self._bursts, self._waits, self._anchor = [], [], None

    # ---- records -----------------------------------------------------------------------

    def _mark(self, stream):
        if not self.is_cuda:
            return self.clock()
        return stream.record_event(_timing_event())

    def _record(self, direction: str, nbytes: int, start, end, anchor) -> None:
        if not self.is_cuda:
            seconds = max(end - start, 0.0)
            st = self.stats
            st[f"{direction}_bytes"] += nbytes
            st[f"{direction}_s"] += seconds
            st["copy_busy_s"] += seconds  # one thread: copies never overlap
            st["wait_copy_s"] += seconds  # ... and it is the thread that computes
            return
        self._bursts.append(_Burst(direction, nbytes, start, end, anchor))

    def _count(self) -> None:
        st = self.stats
        # one time axis per anchor: every burst of a count shares one, unless a span was
        # open across the last count (then its union with the others is not taken)
        axes: dict[int, list[tuple[float, float]]] = {}
        for b in self._bursts:
            seconds = max(b.start.elapsed_time(b.end), 0.0) / 1e3
            st[f"{b.direction}_bytes"] += b.nbytes
            st[f"{b.direction}_s"] += seconds
            t0 = max(b.anchor.elapsed_time(b.start), 0.0) / 1e3
            axes.setdefault(id(b.anchor), []).append((t0, t0 + seconds))
        st["copy_busy_s"] += sum(union_s(intervals) for intervals in axes.values())
        st["wait_copy_s"] += sum(a.elapsed_time(b) for a, b in self._waits) / 1e3
        if self._bursts:  # completed before any later record is enqueued
            self._anchor = self._bursts[-1].end
        self._bursts, self._waits = [], []


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one ``(start, end)`` interval."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)
