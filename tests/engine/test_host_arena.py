"""The host arena (chunks/manager.host_arena): zeroed memory that views keep alive, and that
a forked child process does not inherit."""

from __future__ import annotations

import gc
import multiprocessing as mp
import sys

import pytest
import torch

from protrain.chunks.manager import host_arena


def test_zeroed_and_kept_alive_by_its_views():
    arena = host_arena(8 << 20)
    assert arena.dtype == torch.uint8 and arena.numel() == 8 << 20
    assert not arena.any()
    view = arena[4096 : 4096 + 64].view(torch.float32)
    del arena
    gc.collect()
    view.fill_(2.0)  # the mapping is still there
    assert view.sum().item() == 32.0


def _child_maps(start: int, conn) -> None:
    with open("/proc/self/maps") as f:
        ranges = [line.split()[0].split("-") for line in f]
    conn.send(any(int(a, 16) <= start < int(b, 16) for a, b in ranges))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's")
def test_a_forked_child_does_not_inherit_it():
    """Linux copies DMA-pinned private pages into a child at fork: a DataLoader worker
    would copy the whole arena. The child has no mapping at the arena's address."""
    arena = host_arena(8 << 20)
    arena[::4096].fill_(1)
    start = arena.data_ptr()
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=_child_maps, args=(start, child_end))
    p.start()
    inherited = parent_end.recv()
    p.join()
    assert p.exitcode == 0
    assert inherited is False
    assert arena[4096].item() == 1  # the parent's stays


def test_landing_places_of_accumulated_gradients_come_with_the_first_accumulation(monkeypatch):
    """On torch's host path a step after every backward never makes them; the first later
    micro-batch makes one for every offloaded trainable parameter (and training stays
    exact: tests/engine's equivalence runs accumulate). The one pass reads every first
    gradient there, so it makes them at wrap (tests/engine/test_one_pass.py)."""
    import protrain
    from protrain.optim import host_adam_ext

    monkeypatch.setenv(host_adam_ext.ENV_VAR, "torch")

    from .models import batches, build

    model, optimizer, _ = protrain.wrap(build("llama"), n_persist=0, lr=1e-3, device="cpu")
    manager = model._protrain_engine.manager
    slots = [s for c in manager.offloaded for s in c.trainable_slots]
    data = batches("llama", 3)
    model(**data[0]).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    assert slots and all(s.grad_staging is None for s in slots)
    for b in data[1:]:  # two micro-batches: the second one accumulates
        model(**b).loss.backward()
    assert all(s.grad_staging is not None for s in slots)
    assert all(s.grad_staging.dtype == s.param.dtype for s in slots)
    main = manager._host_arena
    lo, hi = main.data_ptr(), main.data_ptr() + main.numel()
    assert all(not lo <= s.grad_staging.data_ptr() < hi for s in slots)  # a second arena
    optimizer.step()
    protrain.close(model)
