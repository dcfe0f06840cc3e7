"""Hardware rates the runtime model needs, measured once per machine and cached.

Measured: host-to-device and device-to-host copy bandwidth from pinned memory, both
directions at once (two streams), the rate of the host update the engine runs for offloaded
chunks (the one-pass kernel of ``optim/host_adam_ext.py`` where it builds, else torch's fused
AdamW; on a worker thread at the engine's host thread count), alone and while copies run
both ways (in training the host update overlaps the gradient and parameter copies, which
share the host's memory bandwidth with it), the fused AdamW on the device, and the host's
memory roof: an in-place add over fp32 tensors beyond any cache (12 bytes an element), the
fastest any pass over the optimizer state can stream, with every local rank at once. A CPU device
has no copies to measure: the "device" is the host, so its copy rates are host memory-copy
rates and its device AdamW rate is the host one.

With several ranks (a process group given, or the default one initialized) every rank
measures at once, as they will train: the ranks of a host share its cores and memory
bandwidth, each with its share of the threads (``default_host_threads``), so the host rates
are per rank. The group's all-gather, reduce-scatter and all-reduce bus bandwidths are
measured at a chunk's size (alone, and the all-gather while copies run both ways, as it
runs in training beside parameter and gradient copies). The ranks run in lockstep, so the
profile keeps the slowest rank's rate of each kind; the first rank decides whether the
cache is used and writes it.

Cached as JSON under ``~/.cache/protrain/`` (``PROTRAIN_CACHE_DIR`` overrides), one file per
machine, world and software versions; a few seconds to measure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from protrain.devices import resolve_device
from protrain.distributed.agree import from_main, max_over_ranks
from protrain.distributed.collectives import all_gather_into, reduce_scatter_into
from protrain.distributed.process_group import SINGLE, DistContext, resolve_context
from protrain.optim import host_adam_ext
from protrain.runtime.host_worker import default_host_threads

log = logging.getLogger(__name__)

_COPY_BYTES = 256 << 20  # per copy; large enough to reach the link's bandwidth
# Parameters per AdamW timing: 256 MiB per fp32 tensor, 1 GiB with gradient and moments, a
# working set beyond any last-level cache, as the engine's chunks are (a cache-resident
# timing overstates the host rate).
_ADAM_NUMEL = 1 << 26
# Bytes of one gathered chunk in the collectives' timing: a typical chunk on a GPU; on the
# CPU (gloo, as CI runs several ranks) smaller, to stay a fraction of a second.
_COLLECTIVE_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}
_PROFILE_VERSION = 7  # part of the cache key: a change of method re-measures
_ADD_BYTES = 12  # a.add_(b): reads two fp32 elements, writes one


@dataclass
class HardwareProfile:
    device: str  # "cuda" or "cpu"
    device_name: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float  # both directions at once, total
    cpu_adam_params_per_s: float
    device_adam_params_per_s: float
    collective_bytes_per_s: float | None  # all-reduce bus bandwidth; None: one rank
    cpu_threads: int
    # host AdamW while pinned copies run both ways (CUDA); the CPU rate on a CPU device.
    # None: not measured (the runtime model then uses cpu_adam_params_per_s).
    cpu_adam_busy_params_per_s: float | None = None
    # the host's multiplication of fp32 gradients by the clip coefficient (one pass over
    # them before AdamW; busy as above on CUDA). None: not measured (the model omits it).
    cpu_clip_params_per_s: float | None = None
    # bus bandwidths (nccl-tests convention) at a chunk's size; None: one rank
    all_gather_bytes_per_s: float | None = None
    reduce_scatter_bytes_per_s: float | None = None
    all_gather_busy_bytes_per_s: float | None = None  # while copies run both ways (CUDA)
    world_size: int = 1
    local_world_size: int = 1  # ranks on this host, each measured beside the others
    # the host update the rates above are of: "one_pass" (the kernel reads low-precision
    # gradients, writes the compute-dtype copy the gather takes as it is) or "torch"
    host_update: str = "torch"
    # the host's memory roof per rank (every local rank streaming at once); None: not measured
    host_memory_bytes_per_s: float | None = None
    key: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HardwareProfile:
        return cls(**d)


def cache_dir() -> Path:
    return Path(os.environ.get("PROTRAIN_CACHE_DIR", Path.home() / ".cache" / "protrain"))


def machine_key(device: torch.device, ctx: DistContext = SINGLE) -> str:
    """Machine, world and software versions: a cached profile is reused only when all
    match."""
    parts = [
        f"v{_PROFILE_VERSION}",
        socket.gethostname(),
        platform.processor() or platform.machine(),
        str(os.cpu_count()),
        f"threads={torch.get_num_threads()}",
        f"torch={torch.__version__}",
        f"cuda={torch.version.cuda}",
        device.type,
    ]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    # the forced fallback measures another update (a build that fails, fails alike each time)
    parts.append(f"host_update={os.environ.get(host_adam_ext.ENV_VAR, '')}")
    if ctx.is_distributed:
        parts.append(f"world={ctx.world_size}/{ctx.local_world_size}/{ctx.backend}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def measure_hardware(
    device: torch.device | str | None = None, *, use_cache: bool = True, process_group=None
) -> HardwareProfile:
    """The rates of this machine for ``device`` (cached; ``use_cache=False`` re-measures).
    With several ranks (``process_group``, else the default group when initialized) every
    rank must call this at once; each gets the same profile."""
    device = resolve_device(device)
    ctx = resolve_context(process_group)
    key = machine_key(device, ctx)
    path = cache_dir() / f"hardware-{key}.json"
    cached = None
    if use_cache and ctx.is_main and path.exists():
        try:
            cached = HardwareProfile.from_dict(json.loads(path.read_text())).to_dict()
        except (ValueError, TypeError) as exc:
            log.warning("ignoring unreadable hardware cache %s: %s", path, exc)
    cached = from_main(ctx, cached)  # every rank measures, or none: the timings are collective
    if cached is not None:
        return HardwareProfile.from_dict(cached)
    t0 = time.perf_counter()
    profile = _measure(device, ctx)
    profile.key = key
    log.info("hardware profile measured in %.1f s: %s", time.perf_counter() - t0, profile)
    if use_cache and ctx.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile.to_dict(), indent=1))
        tmp.replace(path)
    return profile


def _measure(device: torch.device, ctx: DistContext = SINGLE) -> HardwareProfile:
    profile = _measure_rank(device, ctx)
    if not ctx.is_distributed:
        return profile
    # the slowest rank's rate of each kind: ranks run in lockstep
    fields = [k for k, v in profile.to_dict().items() if isinstance(v, float)]
    slowest = max_over_ranks(ctx, [-getattr(profile, k) for k in fields], device)
    for k, v in zip(fields, slowest):
        setattr(profile, k, -v)
    return profile


def _measure_rank(device: torch.device, ctx: DistContext) -> HardwareProfile:
    threads = default_host_threads(ctx.local_world_size)
    _together(ctx)
    cpu_adam = _host_adam_rate(device, threads=threads)
    _together(ctx)
    roof = _host_rate(_add_rate, threads=threads)
    coll = {
        "collective_bytes_per_s": None,
        "world_size": ctx.world_size,
        "local_world_size": ctx.local_world_size,
        "host_update": _host_update_path(),
        "host_memory_bytes_per_s": roof,
        **_collective_rates(device, ctx),
    }
    if device.type != "cuda":
        copy = _host_copy_rate()
        _together(ctx)
        return HardwareProfile(
            device="cpu",
            device_name=platform.processor() or platform.machine(),
            h2d_bytes_per_s=copy,
            d2h_bytes_per_s=copy,
            duplex_bytes_per_s=copy,
            cpu_adam_params_per_s=cpu_adam,
            device_adam_params_per_s=cpu_adam,
            cpu_adam_busy_params_per_s=cpu_adam,
            cpu_clip_params_per_s=_host_rate(_clip_rate, threads=threads),
            cpu_threads=threads,
            **coll,
        )
    h2d, d2h, duplex = _pcie_rates(device)
    _together(ctx)
    busy_adam = _host_adam_rate(device, busy_device=device, threads=threads)
    _together(ctx)
    busy_clip = _host_rate(_clip_rate, busy_device=device, threads=threads)
    if ctx.is_distributed:
        coll["all_gather_busy_bytes_per_s"] = _collective_rates(device, ctx, busy=True)[
            "all_gather_bytes_per_s"
        ]
    return HardwareProfile(
        device="cuda",
        device_name=torch.cuda.get_device_name(device),
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        duplex_bytes_per_s=duplex,
        cpu_adam_params_per_s=cpu_adam,
        device_adam_params_per_s=_adam_rate(device),
        cpu_adam_busy_params_per_s=busy_adam,
        cpu_clip_params_per_s=busy_clip,
        cpu_threads=threads,
        **coll,
    )


def _together(ctx: DistContext) -> None:
    """Ranks start a host timing at once: a host's ranks share its memory bandwidth."""
    if ctx.is_distributed:
        torch.distributed.barrier(group=ctx.group)


def _best_of(fn, repeats: int = 3) -> float:
    """Shortest of ``repeats`` timed calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _host_copy_rate() -> float:
    a = torch.empty(_COPY_BYTES // 4, dtype=torch.uint8)
    b = torch.empty_like(a)
    return a.numel() / _best_of(lambda: b.copy_(a))


def _link_copies(device: torch.device):
    """Pinned host buffers, device buffers and two streams; returns the three timed copies
    (host-to-device, device-to-host, both at once), each ending synchronized."""
    host_in = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    dev_b = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    s_h2d, s_d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def h2d():
        with torch.cuda.stream(s_h2d):
            dev_a.copy_(host_in, non_blocking=True)
        s_h2d.synchronize()

    def d2h():
        with torch.cuda.stream(s_d2h):
            host_out.copy_(dev_b, non_blocking=True)
        s_d2h.synchronize()

    def both():
        with torch.cuda.stream(s_h2d):
            dev_a.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(s_d2h):
            host_out.copy_(dev_b, non_blocking=True)
        s_h2d.synchronize()
        s_d2h.synchronize()

    return h2d, d2h, both


def _pcie_rates(device: torch.device) -> tuple[float, float, float]:
    h2d, d2h, both = _link_copies(device)
    return (
        _COPY_BYTES / _best_of(h2d),
        _COPY_BYTES / _best_of(d2h),
        2 * _COPY_BYTES / _best_of(both),
    )


def _adam_rate(device: torch.device) -> float:
    p = torch.zeros(_ADAM_NUMEL, device=device, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)

    def step():
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _ADAM_NUMEL / _best_of(step)


def _clip_rate() -> float:
    """Parameters a second of the host step's clip: ``_foreach_mul_`` of fp32 gradients."""
    g = torch.full((_ADAM_NUMEL,), 1e-3)
    coef = torch.tensor(0.5)
    return _ADAM_NUMEL / _best_of(lambda: torch._foreach_mul_([g], coef))


def _host_update_path() -> str:
    return "torch" if host_adam_ext.kernel() is None else "one_pass"


def _host_adam_rate(
    device: torch.device, busy_device: torch.device | None = None, *, threads: int
) -> float:
    """The host update's rate as the engine runs it (see :func:`_host_rate`): the one-pass
    kernel where it builds, with gradients and weights' copy in the compute dtype the device
    trains in (bf16 on a GPU, fp32 on the CPU), else torch's fused AdamW."""
    kernel = host_adam_ext.kernel()
    if kernel is None:
        return _host_rate(lambda: _adam_rate(torch.device("cpu")), busy_device, threads=threads)
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    return _host_rate(lambda: _one_pass_rate(kernel, low), busy_device, threads=threads)


def _one_pass_rate(kernel, low: torch.dtype) -> float:
    """Parameters a second of the one-pass update over one flat piece (no unscale, no
    clip: both ride in the same pass, at no extra bytes)."""
    master, m, v = (torch.zeros(_ADAM_NUMEL) for _ in range(3))
    grad = torch.full((_ADAM_NUMEL,), 1e-3, dtype=low)
    out = torch.empty(_ADAM_NUMEL, dtype=low)
    step = [0.0]

    def once():
        step[0] += 1.0
        kernel.adamw_step(
            [master], [m], [v], [grad], [out], [step[0]], 1e-3, 0.9, 0.999, 0.0, 1e-8, None, None
        )

    return _ADAM_NUMEL / _best_of(once)


def _add_rate() -> float:
    """Bytes a second of an in-place fp32 add beyond any cache: the host's memory roof for
    a pass that reads and writes in place (no write-allocate traffic)."""
    a = torch.zeros(_ADAM_NUMEL)
    b = torch.full((_ADAM_NUMEL,), 1e-3)
    return _ADD_BYTES * _ADAM_NUMEL / _best_of(lambda: a.add_(b))


def _host_rate(measure, busy_device: torch.device | None = None, *, threads: int) -> float:
    """``measure()`` as the engine's host work runs: on a worker thread with the engine's
    host thread count; with ``busy_device``, while pinned copies to and from that device
    keep both directions of the link busy."""
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        if busy_device is None:
            return pool.submit(measure).result()
        with _link_busy(busy_device):
            return pool.submit(measure).result()


@contextlib.contextmanager
def _link_busy(device: torch.device):
    """Pinned copies to and from ``device`` keep both directions of the link busy inside.
    The body runs only once copies run (the best of its timings would otherwise be an
    idle one), and only counts if they ran throughout: a copier that failed is an error."""
    copying, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def copy_until_stopped() -> None:
        try:
            _copy_until(device, stop, copying)
        except BaseException as exc:
            failed.append(exc)
        finally:
            copying.set()

    copier = threading.Thread(target=copy_until_stopped, daemon=True)
    copier.start()
    try:
        copying.wait()
        if not failed:  # nothing is timed without the copies
            yield
    finally:
        stop.set()
        copier.join()
    if failed:
        raise RuntimeError(
            "protrain: the copies that keep the link busy while a rate is timed failed: "
            f"{failed[0]}"
        ) from failed[0]


def _copy_until(device: torch.device, stop: threading.Event, copying: threading.Event) -> None:
    """Copy pinned memory to and from ``device`` until ``stop``; ``copying`` is set once
    the first copies have run."""
    _, _, both = _link_copies(device)
    while not stop.is_set():
        both()
        copying.set()


def _collective_rates(device: torch.device, ctx: DistContext, busy: bool = False) -> dict:
    """Bus bandwidths of the chunk collectives at a chunk's size (``busy``: the all-gather
    while copies run both ways); {} for one rank. Every rank runs the same collectives."""
    if not ctx.is_distributed:
        return {}
    n = ctx.world_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    numel = _COLLECTIVE_BYTES[device.type] // dtype.itemsize // n * n
    full = torch.zeros(numel, dtype=dtype, device=device)
    shard = torch.zeros(numel // n, dtype=dtype, device=device)
    group = ctx.group

    def timed(op):
        def run():
            op()
            if device.type == "cuda":  # this stream only: a device-wide sync would also
                # wait for the busy link's copies (19.6 GB/s "all-gather" on two H200s)
                torch.cuda.current_stream(device).synchronize()

        return _best_of(run)

    bus = full.numel() * dtype.itemsize * (n - 1) / n  # bytes each rank sends
    gather = lambda: all_gather_into(full, shard, group)  # noqa: E731
    if busy:
        with _link_busy(device):
            return {"all_gather_bytes_per_s": bus / timed(gather)}
    return {
        "all_gather_bytes_per_s": bus / timed(gather),
        "reduce_scatter_bytes_per_s": bus / timed(lambda: reduce_scatter_into(shard, full, group)),
        "collective_bytes_per_s": 2
        * bus
        / timed(lambda: torch.distributed.all_reduce(full, group=group)),
    }
