"""The FSDP2 engine's peak memory per rank, measured: what `protrain plan` says for a config
with `fsdp_version: 2`.

Not a formula: the engine `protrain train` would run (`FSDP2Trainable`, the config's wrap
policy, prefetch, offload and activation options) is built on a copy of the model and runs
real steps at the config's micro-batch (forward, backward, clipping, the AdamW step). Two
steps: AdamW creates its moments in the first, so the second is the step every later one
repeats. Each step takes two micro-batches where the config accumulates (the second
backward finds the first one's gradient shards in place), one otherwise.

What is measured, per rank: on CUDA the allocator's own peaks (`max_memory_allocated`,
`max_memory_reserved`) from just before the engine is built, so the shards, gathered
units, gradients, AdamW moments and activations are all in it and the model's host copy is
not. On the CPU there is no device allocator: `StorageBytes` counts the bytes of every
storage created while the engine is built and trains, at op granularity, following storages
that are resized in place (FSDP2 frees a gathered unit by resizing its storage to 0 and
gathers into it again by resizing it back, which a count of new storages alone would miss).

The model passed in is left as it was: the trace shards and trains a deep copy
(`copy_model=False` hands the model itself over, for a caller that built it only for the
trace and drops it, as `protrain plan` does). The random state is forked, as the chunk
engine's trace does, so dropout draws do not shift a run that follows.
"""

from __future__ import annotations

import copy
import gc
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from protrain.train.config import TrainConfig
from protrain.train.fsdp2_trainable import FSDP2Trainable
from protrain.train.loss import count_trained_tokens
from protrain.train.planning import run_autocast_dtype, run_model_and_batch

STEPS = 2  # the first creates the AdamW moments; the second is every later step


@dataclass(frozen=True)
class FSDP2Peak:
    """Peak bytes of one rank (or the largest over the ranks) through the FSDP2 engine."""

    allocated_bytes: int  # CUDA: max_memory_allocated; CPU: storage bytes counted
    reserved_bytes: int | None  # CUDA: max_memory_reserved; None on the CPU
    device_type: str
    world_size: int
    micro_batches: int  # per step
    batch_shape: tuple[int, ...]  # input_ids of one micro-batch

    def describe(self) -> str:
        """One line for `protrain plan`."""
        rows, tokens = (tuple(self.batch_shape) + (1, 1))[:2]
        if self.reserved_bytes is None:
            peak = f"{_size(self.allocated_bytes)} ({self.allocated_bytes} bytes)"
            how = "tensor bytes counted on the CPU"
        else:
            peak = (
                f"{_size(self.allocated_bytes)} allocated ({self.allocated_bytes} bytes), "
                f"{_size(self.reserved_bytes)} reserved"
            )
            how = "torch.cuda max memory"
        ranks = f"the largest of {self.world_size} ranks" if self.world_size > 1 else "1 rank"
        return (
            f"FSDP2 engine: peak per rank {peak}, measured over {STEPS} steps of "
            f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''} of "
            f"{rows} x {tokens} tokens; {ranks}; {how}"
        )


def fsdp2_inputs(
    cfg: TrainConfig, device: torch.device
) -> tuple[nn.Module, dict[str, torch.Tensor], torch.dtype | None]:
    """Model, sample batch and autocast dtype, built as `protrain train` builds them (the
    planner's builder, `planning.run_model_and_batch`), writing nothing."""
    autocast_dtype = run_autocast_dtype(cfg, device)
    model, batch = run_model_and_batch(cfg)
    return model, batch, autocast_dtype


def measure_fsdp2_peak(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    cfg: TrainConfig,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    copy_model: bool = True,
) -> FSDP2Peak:
    """This rank's peak through the FSDP2 engine at ``batch`` (see the module's note).
    Several ranks: every rank calls this (the engine's collectives); see `largest_over_ranks`."""
    if cfg.fsdp is None:
        raise ValueError("measure_fsdp2_peak needs a config with fsdp_version: 2")
    if copy_model:
        model = copy.deepcopy(model)
    micro_batches = min(cfg.gradient_accumulation_steps, 2)
    n_trained = max(count_trained_tokens(batch["labels"]), 1) * micro_batches
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _PeakClock(device) as clock:
        trainable = FSDP2Trainable(model, cfg, device, autocast_dtype)
        del model  # the trainable holds it: the full weights go as the shards take over
        world = dist.get_world_size()
        try:
            for _ in range(STEPS):
                for i in range(micro_batches):
                    loss = trainable.forward_loss_sum(batch)
                    trainable.backward(loss / n_trained, last=i == micro_batches - 1)
                    del loss
                trainable.clip_grad_norm(cfg.max_grad_norm)
                trainable.optimizer_step()
            allocated, reserved = clock.peaks()
        finally:
            trainable.close()
            del trainable
    if device.type == "cuda":  # the cached blocks back, for whatever is traced next
        gc.collect()
        torch.cuda.empty_cache()
    return FSDP2Peak(
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        device_type=device.type,
        world_size=world,
        micro_batches=micro_batches,
        batch_shape=tuple(batch["input_ids"].shape),
    )


def largest_over_ranks(peak: FSDP2Peak, device: torch.device) -> FSDP2Peak:
    """The largest peaks of any rank (a collective where the default group is started)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return peak
    values = torch.tensor(
        [peak.allocated_bytes, peak.reserved_bytes or 0], dtype=torch.int64, device=device
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    allocated, reserved = (int(v) for v in values.tolist())
    return FSDP2Peak(
        allocated_bytes=allocated,
        reserved_bytes=None if peak.reserved_bytes is None else reserved,
        device_type=peak.device_type,
        world_size=dist.get_world_size(),
        micro_batches=peak.micro_batches,
        batch_shape=peak.batch_shape,
    )


class _PeakClock:
    """CUDA: the allocator's peaks from entry; CPU: `StorageBytes` while inside."""

    def __init__(self, device: torch.device):
        self.device = device
        self.counter: StorageBytes | None = None

    def __enter__(self) -> _PeakClock:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.counter = StorageBytes().__enter__()
        return self

    def peaks(self) -> tuple[int, int | None]:
        if self.counter is None:
            torch.cuda.synchronize(self.device)
            return (
                torch.cuda.max_memory_allocated(self.device),
                torch.cuda.max_memory_reserved(self.device),
            )
        return self.counter.peak_bytes, None

    def __exit__(self, *exc) -> None:
        if self.counter is not None:
            self.counter.__exit__(*exc)
            self.counter = None


class StorageBytes(TorchDispatchMode):
    """Live bytes of the storages created by ops under this mode, and their peak, following
    storages resized in place. A DTensor counts as its local tensor. After every op the
    sizes of the storages followed are read again (a cost linear in the live storages: for
    the CPU, where the models are small); a storage freed is subtracted at its last size."""

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._bytes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def _free(self, key: int) -> None:
        self._refs.pop(key, None)
        self.live_bytes -= self._bytes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, ref in list(self._refs.items()):  # resized in place since the last op
            storage = ref()
            if storage is not None and storage.nbytes() != self._bytes[key]:
                self.live_bytes += storage.nbytes() - self._bytes[key]
                self._bytes[key] = storage.nbytes()
        inputs = None
        for t in _local_tensors(out):
            storage = t.untyped_storage()
            key = id(storage)
            ref = self._refs.get(key)
            if ref is not None and ref() is storage:
                continue
            if inputs is None:
                inputs = {a.untyped_storage().data_ptr() for a in _local_tensors((args, kwargs))}
            if storage.data_ptr() in inputs and storage.nbytes():
                continue  # a view or an in-place result
            self._refs[key] = weakref.ref(storage, lambda _r, k=key: self._free(k))
            self._bytes[key] = storage.nbytes()
            self.live_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def _local_tensors(tree) -> list[torch.Tensor]:
    out = []
    for t in tree_leaves(tree):
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            out.append(t)
    return out


def _size(n: int) -> str:
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.2f}{name}"
    return f"{n}B"
