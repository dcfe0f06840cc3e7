"""Two GPUs over NCCL compute what one GPU computes (bf16: within its rounding).

The CUDA side of the sharded and replicated modes: gathers on the gather stream, gradient
reductions on their own stream, host updates of the own shards. The reference is the engine
on one GPU with the same global batch (both ranks' micro-batches accumulated), bf16 compute
both ways, so the difference is the order of bf16 gradient sums.
"""

from __future__ import annotations

import os

import pytest
import torch
from tests.engine.models import batches, build

import protrain

from .ranks import run_ranks

pytestmark = pytest.mark.multigpu
STEPS, ACCUM, LR = 3, 2, 1e-3


def _train(model, device, micro, divide, armed=False, **knobs):
    """``armed``: no clipping, ``step_in_backward()`` before each step's last backward (the
    device-stepped chunks then step inside it: asserted by the count before ``step()``)."""
    model, opt, _ = protrain.wrap(model, device=device, lr=LR, chunk_size_bytes=16384, **knobs)
    losses = []
    for step in range(STEPS):
        batch = micro(step)
        for i, b in enumerate(batch):
            b = {k: v.to(device) for k, v in b.items()}
            if armed and i == len(batch) - 1:
                opt.step_in_backward()
            loss = model(**b).loss / divide
            loss.backward()
            losses.append(loss.item())
        if armed and knobs.get("n_device_step"):
            assert opt.stats["device_steps"] == knobs["n_device_step"] * (step + 1)
        if not armed:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    state = protrain.state_dict(model)
    protrain.close(model)
    return losses, state


def _rank(rank, world, mode, out_dir, n_device_step=0, armed=False):
    device = torch.device("cuda", rank)
    accum = 1 if armed else ACCUM
    data = batches("llama", STEPS * accum * world)
    losses, state = _train(
        build("llama"),
        device,
        lambda s: [data[s * accum * world + m * world + rank] for m in range(accum)],
        accum * world,
        armed,
        n_persist=1,
        distributed_mode=mode,
        grad_reduce="sum",
        n_device_step=n_device_step,
    )
    torch.save({"state": state}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize(
    "mode, n_device_step, armed",
    [("sharded", 0, False), ("replicated", 0, False), ("sharded", 2, False), ("sharded", 2, True)],
)
def test_two_gpus_match_one(tmp_path, mode, n_device_step, armed):
    """Both modes, and the sharded one with device-stepped chunks (each rank steps its own
    shard of the last two offloaded chunks on its GPU: ``optim/device_step.py``), at
    ``step()`` after clipping or, armed, inside the backward (on the streams of the
    gradient reductions), against one GPU stepping every offloaded chunk on the host."""
    world = 2
    accum = 1 if armed else ACCUM
    data = batches("llama", STEPS * accum * world)
    _, want = _train(
        build("llama"),
        torch.device("cuda", 0),
        lambda s: data[s * accum * world : (s + 1) * accum * world],
        accum * world,
        armed,
        n_persist=1,
    )
    run_ranks(world, _rank, mode, str(tmp_path), n_device_step, armed, backend="nccl")
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")["state"]
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=2e-2, atol=2e-3, msg=name)
