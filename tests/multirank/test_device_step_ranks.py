"""Device-stepped offloaded chunks (``optim/device_step.py``) on gloo ranks compute bit for
bit what the host AdamW computes there: the replicated mode (gradients all-reduced chunk by
chunk) and the sharded mode (each rank steps its own shard of the chunk on the device, from a
its shard of the host accumulator), accumulation 2, clipping on, one and two device-stepped
chunks: at 2 ranks full fine-tuning and LoRA (and fp16 loss scaling), at 3 ranks full
fine-tuning (uneven shards: some parameters own no element on a rank). Pieces of 48 elements
cut the shards inside. The device-stepped chunks' reduced gradients (the shards, in the
sharded mode) land in the slots' host accumulators as a host-stepped chunk's do, and the
DeviceStep holds none of them.

Every rank's gradients, norms and reductions are the same in both runs (the device step
reads the same reduced shard the host path copies out), so the comparison is exact, not to
a tolerance."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tests.engine.models import batches, build, lora
from tests.engine.test_device_step import _tensors_outside_sets

import protrain
from protrain.optim import device_step

from .ranks import run_ranks

STEPS, ACCUM, MAX_NORM, LR, WD = 2, 2, 0.5, 1e-2, 0.01


def _wrap(mode: str, adapter: bool, n_device_step: int, fp16: bool = False):
    model = build("llama")
    model, opt, _ = protrain.wrap(
        lora(model, "llama") if adapter else model,
        device="cpu",
        n_persist=1,
        lr=LR,
        weight_decay=WD,
        chunk_size_bytes=16384,
        compute_dtype=torch.float16 if fp16 else None,
        distributed_mode=mode,
        grad_reduce="sum",
        n_device_step=n_device_step,
    )
    return model, opt


def _train(rank: int, world: int, mode: str, adapter: bool, n_device_step: int, fp16: bool):
    model, opt = _wrap(mode, adapter, n_device_step, fp16)
    data = batches("llama", STEPS * ACCUM * world)
    held = []  # after each step's backwards: host accumulator elements, DeviceStep tensors
    for step in range(STEPS):
        for mb in range(ACCUM):
            i = step * ACCUM * world + mb * world + rank
            loss = model(**data[i]).loss / (ACCUM * world)
            opt.scale_loss(loss).backward()
        if n_device_step:
            ds, m = opt._device_step, opt._manager
            accs = [s.grad_acc for ci in ds.chunk_ids() for s in m.chunks[ci].trainable_slots]
            assert all(a.device.type == "cpu" for a in accs)
            held.append((sum(a.numel() for a in accs), _tensors_outside_sets(ds)))
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    out = {"model": protrain.state_dict(model), "optim": opt.state_dict(), "stats": opt.stats}
    if n_device_step:
        m = opt._manager
        slots = [s for ci in opt._device_step.chunk_ids() for s in m.chunks[ci].trainable_slots]
        out["own_numel"] = sum(s.master.numel() for s in slots)
        out["whole_numel"] = sum(s.placement.numel for s in slots)
        out["held"] = held
    protrain.close(model)
    return out


_HOST: dict[tuple, dict] = {}  # the n_device_step=0 runs of this process, read only


def _check(rank: int, world: int, mode: str, adapter: bool, n: int, fp16: bool = False):
    key = (mode, adapter, fp16)
    if key not in _HOST:
        _HOST[key] = _train(rank, world, mode, adapter, 0, fp16)
    host = _HOST[key]
    dev = _train(rank, world, mode, adapter, n, fp16)
    at = (rank, world, mode, adapter, n, fp16)
    assert dev["stats"]["device_steps"] == STEPS and "device_steps" not in host["stats"], at
    assert host["model"].keys() == dev["model"].keys(), at
    for name, want in host["model"].items():
        assert torch.equal(dev["model"][name], want), (*at, name)
    assert host["optim"]["state"].keys() == dev["optim"]["state"].keys(), at
    for i, st in host["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(dev["optim"]["state"][i][k], v), (*at, i, k)
    # the accumulators and the stepped gradients, masters and moments are this rank's own
    # elements
    own, whole = dev["own_numel"], dev["whole_numel"]
    assert dev["held"] == [(own, [])] * STEPS, at
    assert dev["stats"]["device_step_h2d_bytes"] == 16 * own * STEPS, at
    total = torch.tensor([own])
    dist.all_reduce(total)  # every rank's part, each element once
    assert total.item() == (whole * world if mode == "replicated" else whole), at
    if mode == "sharded":  # split by bytes: a chunk's trainable elements may lie in one shard
        assert own <= whole, at


def _train_armed(
    rank: int, world: int, adapter: bool, accum: int, n_device_step: int, mode: str = "sharded"
):
    """No clipping, ``step_in_backward()`` before each window's last backward:
    (states after the steps, device steps counted after each backward and after each
    step())."""
    model, opt = _wrap(mode, adapter, n_device_step)
    data = batches("llama", STEPS * accum * world)
    counted = []
    for step in range(STEPS):
        for mb in range(accum):
            if mb == accum - 1:
                opt.step_in_backward()
            i = step * accum * world + mb * world + rank
            (model(**data[i]).loss / (accum * world)).backward()
        before = opt.stats.get("device_steps", 0)
        opt.step()
        counted.append((before, opt.stats.get("device_steps", 0)))
        opt.zero_grad()
    out = {"model": protrain.state_dict(model), "optim": opt.state_dict(), "counted": counted}
    protrain.close(model)
    return out


def _check_armed(rank: int, world: int, adapter: bool, accum: int, mode: str = "sharded") -> None:
    """Armed by ``step_in_backward()`` with several ranks: with one micro-batch in the
    window each device-stepped chunk steps inside the backward, once its reduced gradient
    shard is on its way to the host (one DeviceStep call a chunk, none left to ``step()``);
    with two, ``step()`` steps them (their last gradients are added on the host). The bits
    are the host path's either way."""
    at = (rank, world, adapter, accum, mode)
    host = _train_armed(rank, world, adapter, accum, 0, mode)
    dev = _train_armed(rank, world, adapter, accum, 2, mode)
    if accum == 1:  # two chunks, each its own call from inside the backward
        assert dev["counted"] == [(2 * (k + 1), 2 * (k + 1)) for k in range(STEPS)], at
    else:  # one call of step() for both
        assert dev["counted"] == [(k, k + 1) for k in range(STEPS)], at
    for name, want in host["model"].items():
        assert torch.equal(dev["model"][name], want), (*at, name)
    for i, st in host["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(dev["optim"]["state"][i][k], v), (*at, i, k)


def _two_ranks(rank: int, world: int) -> None:
    device_step.PIECE_NUMEL = 48  # pieces cut the shards inside (this process only)
    _check(rank, world, "replicated", False, 2)
    for adapter in (False, True):
        for n in (1, 2):
            _check(rank, world, "sharded", adapter, n)
    _check(rank, world, "sharded", False, 2, fp16=True)
    for adapter, accum in ((False, 1), (True, 1), (False, 2)):
        _check_armed(rank, world, adapter, accum)
    _check_armed(rank, world, False, 1, "replicated")


def _three_ranks(rank: int, world: int) -> None:
    device_step.PIECE_NUMEL = 48
    for n in (1, 2):  # full fine-tuning: norm weights own no element on two of the ranks
        _check(rank, world, "sharded", False, n)
    _check_armed(rank, world, False, 1)


def test_device_step_on_two_ranks_equals_the_host_step():
    run_ranks(2, _two_ranks, check_group_freed=True)


def test_sharded_device_step_on_three_ranks_equals_the_host_step():
    run_ranks(3, _three_ranks, check_group_freed=True)
