"""Device-stepped offloaded chunks (``optim/device_step.py``) on 2 gloo ranks in the
replicated mode (gradients all-reduced chunk by chunk) compute bit for bit what the host
AdamW computes there; the sharded mode refuses them with one clear error."""

from __future__ import annotations

import pytest
import torch
from tests.engine.models import batches, build

import protrain

from .ranks import run_ranks

STEPS, ACCUM, MAX_NORM, LR, WD = 2, 2, 0.5, 1e-2, 0.01


def _train(rank: int, world: int, n_device_step: int) -> dict:
    model, opt, _ = protrain.wrap(
        build("llama"),
        device="cpu",
        n_persist=1,
        lr=LR,
        weight_decay=WD,
        chunk_size_bytes=16384,
        distributed_mode="replicated",
        grad_reduce="sum",
        n_device_step=n_device_step,
    )
    data = batches("llama", STEPS * ACCUM * world)
    for step in range(STEPS):
        for mb in range(ACCUM):
            i = step * ACCUM * world + mb * world + rank
            (model(**data[i]).loss / (ACCUM * world)).backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    stepped = opt.stats.get("device_steps", 0)
    out = {"model": protrain.state_dict(model), "optim": opt.state_dict(), "steps": stepped}
    protrain.close(model)
    return out


def _ranks(rank: int, world: int) -> None:
    host, device = _train(rank, world, 0), _train(rank, world, 2)
    assert device["steps"] == STEPS and host["steps"] == 0
    for name, want in host["model"].items():
        assert torch.equal(device["model"][name], want), (rank, name)
    for i, st in host["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(device["optim"]["state"][i][k], v), (rank, i, k)
    with pytest.raises(ValueError, match="not allowed with distributed_mode='sharded'"):
        protrain.wrap(build("llama"), device="cpu", n_persist=1, n_device_step=1,
                      chunk_size_bytes=16384, distributed_mode="sharded")  # fmt: skip


def test_device_step_on_two_ranks_equals_the_host_step():
    run_ranks(2, _ranks)
