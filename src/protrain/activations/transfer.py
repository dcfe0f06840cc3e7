"""Copies of tensor storages between the compute device and host memory, on copy streams.

On CUDA the host side is pinned memory and both directions run on their own streams
(``d2h_stream``, ``h2d_stream``), ordered against the compute stream by events. On any other
device the host side is an ordinary CPU tensor, copies are synchronous and streams and events
are absent: the same bookkeeping runs, which is how CPU tests check it.

[Note: who keeps a storage alive while it is copied]
A device-to-host copy reads its source after the compute stream has moved on. The source is
marked with ``record_stream(d2h_stream)`` and not referenced here: the caching allocator
then hands its memory to no other tensor until the copy has run, and frees it as soon as the
last other reference is gone, not when this class next polls an event. ``_in_flight`` keeps
only events and sizes, for the bound on bytes in flight. A host-to-device copy writes a
buffer allocated on ``h2d_stream``; whoever uses it on the compute stream calls
``record_stream`` on it (``wait_ready`` does), so the allocator waits for that use before
reusing it. Pinned host buffers are recorded by the caching host allocator itself on every
non-blocking copy.

[Note: pinned pieces]
torch's caching host allocator rounds every pinned allocation up to a power of two, so one
copy of a 3 GiB block input took 4 GiB of page-locked memory, and at long context the host
copies of the held block inputs are what runs out first (32 layers x 3 GiB at 384K tokens of
the Llama-3-8B shape, on a 125 GiB host). A copy larger than ``min_piece_bytes`` is held as
pieces whose sizes are the binary digits of its size, largest first, down to
``min_piece_bytes``; the rest is one last piece. The waste is at most ``min_piece_bytes``
a copy, every piece is a size the allocator caches for the next copy of the same storage, and
each piece is one asynchronous copy each way.
"""

from __future__ import annotations

from collections import deque

import torch


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor on ``t``'s device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def view_of(storage: torch.Tensor, like_dtype, offset, size, stride) -> torch.Tensor:
    """A tensor of the given dtype and geometry over the bytes in ``storage``."""
    out = torch.empty(0, dtype=like_dtype, device=storage.device)
    return out.set_(storage.untyped_storage(), offset, size, stride)


def host_piece_sizes(nbytes: int, min_piece_bytes: int) -> list[int]:
    """Sizes of the host pieces one copy of ``nbytes`` is held in ([Note: pinned pieces])."""
    sizes, rest = [], nbytes
    while rest > min_piece_bytes:
        sizes.append(1 << (rest.bit_length() - 1))  # the largest power of two <= rest
        rest -= sizes[-1]
    if rest or not sizes:
        sizes.append(rest)
    return sizes


class HostCopy:
    """One storage's copy in host memory (in pieces), and its way back to the device."""

    __slots__ = ("pieces", "nbytes", "d2h_event", "device", "h2d_event")

    def __init__(self, pieces: list[torch.Tensor], d2h_event):
        self.pieces = pieces
        self.nbytes = sum(p.numel() for p in pieces)
        self.d2h_event = d2h_event
        self.device: torch.Tensor | None = None  # the copy back, while someone needs it
        self.h2d_event = None


class HostTransfer:
    """Moves storages to host memory and back; bounds the bytes of copies to the host in flight."""

    def __init__(
        self,
        device: torch.device | str,
        max_in_flight_bytes: int = 1 << 30,
        min_piece_bytes: int = 64 << 20,
    ):
        self.device = torch.device(device)
        self.min_piece_bytes = min_piece_bytes
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_in_flight_bytes = max_in_flight_bytes
        self._in_flight: deque[tuple[object, int]] = deque()  # (event, bytes)
        self._in_flight_bytes = 0
        if self.is_cuda:
            self.d2h_stream = torch.cuda.Stream(self.device)
            self.h2d_stream = torch.cuda.Stream(self.device)
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.device_bytes = 0  # bytes of copies back on the device, not yet released
        self.peak_device_bytes = 0

    def to_host(self, source: torch.Tensor) -> HostCopy:
        """Start copying ``source`` (a flat uint8 storage view) to host memory."""
        n = source.numel()
        self.bytes_to_host += n
        sizes = host_piece_sizes(n, self.min_piece_bytes)
        if not self.is_cuda:
            return HostCopy([p.to("cpu", copy=True) for p in source.split(sizes)], None)
        compute = torch.cuda.current_stream(self.device)
        self.d2h_stream.wait_stream(compute)  # the source is written on the compute stream
        with torch.cuda.stream(self.d2h_stream):
            pieces = []
            for part in source.split(sizes):
                host = torch.empty(part.numel(), dtype=torch.uint8, pin_memory=True)
                host.copy_(part, non_blocking=True)
                pieces.append(host)
            event = torch.cuda.Event()
            event.record(self.d2h_stream)
        source.record_stream(self.d2h_stream)
        self._in_flight.append((event, n))
        self._in_flight_bytes += n
        self._retire_in_flight()
        return HostCopy(pieces, event)

    def _retire_in_flight(self) -> None:
        while self._in_flight:
            event, n = self._in_flight[0]
            if not event.query():
                if self._in_flight_bytes <= self.max_in_flight_bytes:
                    break
                event.synchronize()  # bounded in flight: wait for the oldest copy
            self._in_flight.popleft()
            self._in_flight_bytes -= n

    def to_device(self, copy: HostCopy) -> None:
        """Start bringing ``copy`` back to the device (no-op if it is there already)."""
        if copy.device is not None:
            return
        self.bytes_to_device += copy.nbytes
        self.device_bytes += copy.nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        if not self.is_cuda:
            copy.device = torch.cat(copy.pieces).to(self.device)
            return
        self.h2d_stream.wait_event(copy.d2h_event)  # the host bytes are complete
        with torch.cuda.stream(self.h2d_stream):
            copy.device = torch.empty(copy.nbytes, dtype=torch.uint8, device=self.device)
            for part, host in zip(copy.device.split([p.numel() for p in copy.pieces]), copy.pieces):
                part.copy_(host, non_blocking=True)
            copy.h2d_event = torch.cuda.Event()
            copy.h2d_event.record(self.h2d_stream)

    def wait_ready(self, copy: HostCopy) -> torch.Tensor:
        """The device bytes of ``copy``, usable on the current stream."""
        self.to_device(copy)
        dev = copy.device
        if self.is_cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copy.h2d_event)
            dev.record_stream(compute)
        return dev

    def release(self, copy: HostCopy) -> None:
        """Drop the device copy (its users on the compute stream were recorded)."""
        if copy.device is not None:
            copy.device = None
            copy.h2d_event = None
            self.device_bytes -= copy.nbytes

    def synchronize(self) -> None:
        """Wait for every copy to the host in flight."""
        while self._in_flight:
            event, n = self._in_flight.popleft()
            event.synchronize()
            self._in_flight_bytes -= n
