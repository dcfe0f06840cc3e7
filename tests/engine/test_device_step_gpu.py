"""Device-stepped offloaded chunks on CUDA: the streams, events, page-locked moments and the
device cast that the CPU tests cannot run. On CUDA the device's fused AdamW and the host's
are different kernels, so the comparison with the host path is to fp32 rounding, not bit
for bit; the counters and a second step after the first (the gather of a device-stepped
chunk's cast bytes) are checked as well."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain
from protrain.optim import device_step

from .models import batches, build, lora
from .test_equivalence import ACCUM, LR
from .test_flat_host_adam import _groups

pytestmark = pytest.mark.gpu
STEPS = 3


def _run(base, n_device_step, data, clip):
    model = copy.deepcopy(base)
    groups = [g for g in _groups(model) if g["params"]]
    model, opt, _ = protrain.wrap(
        model, n_persist=1, lr=LR, device="cuda", param_groups=groups, n_device_step=n_device_step
    )
    losses = []
    for step in range(STEPS):
        if not clip:
            opt.step_in_backward()
        for mb in range(ACCUM if clip else 1):
            batch = {k: v.cuda() for k, v in data[step * ACCUM + mb].items()}
            loss = model(**batch).loss / (ACCUM if clip else 1)
            loss.backward()
            losses.append(loss.item())
        if clip:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    state = {k: v.float().cpu() for k, v in protrain.state_dict(model).items()}
    stats = dict(opt.stats)
    protrain.close(model)
    return losses, state, stats


@pytest.mark.parametrize("kind,mode,clip", [("gpt2", "full", True), ("llama", "lora", False)])
def test_device_step_on_cuda_equals_host_step(kind, mode, clip, monkeypatch):
    monkeypatch.setattr(device_step, "PIECE_NUMEL", 4096)  # several pieces per chunk
    base = build(kind)
    if mode == "lora":
        base = lora(base, kind)
    data = batches(kind, STEPS * ACCUM)
    host_losses, host_state, _ = _run(base, 0, data, clip)
    model = copy.deepcopy(base)
    _, opt, _ = protrain.wrap(model, n_persist=1, lr=LR, device="cuda")
    n = sum(1 for c in opt._manager.offloaded if c.trainable_slots)
    protrain.close(model)
    assert n >= 1
    dev_losses, dev_state, stats = _run(base, n, data, clip)
    assert stats["device_steps"] >= STEPS  # step() calls; in an armed backward, one a chunk
    assert stats["device_step_h2d_bytes"] > 0 and stats["device_step_d2h_bytes"] > 0
    torch.testing.assert_close(dev_losses, host_losses, rtol=1e-5, atol=1e-6)
    assert dev_state.keys() == host_state.keys()
    for name in host_state:
        torch.testing.assert_close(dev_state[name], host_state[name], rtol=1e-5, atol=1e-6)
