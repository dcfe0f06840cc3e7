"""optimizer.step_without_host_updates(): the profiler's step. Persistent chunks step as in
step(); offloaded chunks are not updated, make no Adam state, and are written back by their
next gather as after an update."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain

from .models import batches, build

LR, WD = 1e-2, 0.01


def _n_chunks(model) -> int:
    _, opt, layout = protrain.wrap(copy.deepcopy(model), device="cpu")
    opt.close()
    return layout.n_chunks


def test_persistent_chunks_step_as_in_step_and_offloaded_ones_do_not():
    base = build("llama")
    data = batches("llama", 1)  # one step: after it, offloaded weights differ from step()'s
    n_persist = _n_chunks(base) // 2
    ref_model, ref_opt, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=n_persist, lr=LR, weight_decay=WD, device="cpu"
    )
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=n_persist, lr=LR, weight_decay=WD, device="cpu"
    )
    manager = model._protrain_engine.manager
    offloaded = {id(s.param) for c in manager.offloaded for s in c.slots}
    assert offloaded and len(offloaded) < len(list(model.parameters()))
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    for b in data:
        ref_model(**b).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(**b).loss.backward()
        optimizer.step_without_host_updates()
        optimizer.zero_grad()
    optimizer.synchronize()
    # no host Adam state was made, the device optimizer's was
    host_states = [len(opt.state) for opts in optimizer._host_opts.values() for opt in opts]
    assert host_states and sum(host_states) == 0
    assert len(optimizer._device_opt[0].state) > 0
    ref, got = protrain.state_dict(ref_model), protrain.state_dict(model)
    changed = 0
    for name, p in model.named_parameters():
        if id(p) in offloaded:  # never updated: as built
            torch.testing.assert_close(got[name], before[name], atol=0, rtol=0, msg=name)
        else:  # as step() does
            torch.testing.assert_close(got[name], ref[name], atol=0, rtol=0, msg=name)
            changed += not torch.equal(got[name], before[name])
    assert changed > 0
    protrain.close(ref_model)
    protrain.close(model)


def test_offloaded_chunks_are_written_back_by_their_next_gather():
    """The next gather goes through the write-back (masters cast on the device, the host
    copy written again), as after a real update, and reads the same bytes."""
    base = build("llama")
    data = batches("llama", 2)
    model, optimizer, _ = protrain.wrap(copy.deepcopy(base), n_persist=0, lr=0.0, device="cpu")
    manager = model._protrain_engine.manager
    host_before = [c.host_buffer.clone() for c in manager.offloaded]
    model(**data[0]).loss.backward()
    optimizer.step_without_host_updates()
    stale = [c.host_stale for c in manager.offloaded if c.trainable_slots]
    assert stale and all(stale)
    assert not manager.resident  # device copies released, as step() does
    optimizer.zero_grad()
    loss = model(**data[1]).loss
    assert not any(c.host_stale for c in manager.offloaded)
    for c, before in zip(manager.offloaded, host_before):
        assert torch.equal(c.host_buffer, before)
    loss.backward()
    optimizer.step_without_host_updates()
    protrain.close(model)


def test_after_arming_is_an_error():
    model, optimizer, _ = protrain.wrap(build("llama"), n_persist=0, lr=LR, device="cpu")
    optimizer.step_in_backward()
    model(**batches("llama", 1)[0]).loss.backward()
    with pytest.raises(RuntimeError, match="after step_in_backward"):
        optimizer.step_without_host_updates()
    optimizer.step()
    protrain.close(model)


def test_after_accumulation_and_the_write_back_carries_the_masters():
    """Two micro-batches (the host accumulation path) before the call; then a master changed
    by hand reaches the device and the host copy through the next gather's write-back."""
    base = build("llama")
    data = batches("llama", 3)
    model, optimizer, _ = protrain.wrap(copy.deepcopy(base), n_persist=0, lr=0.0, device="cpu")
    manager = model._protrain_engine.manager
    for b in data[:2]:
        model(**b).loss.backward()
    optimizer.step_without_host_updates()
    optimizer.zero_grad()
    slot = next(s for c in manager.offloaded for s in c.trainable_slots)
    slot.master.add_(1.0)
    expected = slot.master.to(slot.orig_dtype)
    model(**data[2]).loss.backward()  # gathers every chunk: the write-back runs
    torch.testing.assert_close(slot.host_view, expected, atol=0, rtol=0)
    optimizer.step_without_host_updates()
    optimizer.zero_grad()
    protrain.close(model)


def _arena_bytes(model) -> int:
    return model._protrain_engine.manager._host_arena.numel()


def test_discarded_gradients_share_one_scratch_area_and_keep_their_norms():
    """wrap(discard_offloaded_grads=True), the profiler's wrap: every offloaded accumulator
    is a view of one scratch area (the arena 4 bytes a trainable offloaded parameter smaller,
    plus the largest one), and the 2-norms clipping reads are still each gradient's own."""
    base = build("llama")
    data = batches("llama", 2)
    n_persist = _n_chunks(base) // 2
    kept, kept_opt, _ = protrain.wrap(copy.deepcopy(base), n_persist=n_persist, lr=0.0,
                                      device="cpu")  # fmt: skip
    model, optimizer, _ = protrain.wrap(copy.deepcopy(base), n_persist=n_persist, lr=0.0,
                                        device="cpu", discard_offloaded_grads=True)  # fmt: skip
    slots = [s for c in model._protrain_engine.manager.offloaded for s in c.trainable_slots]
    assert len(slots) > 1
    assert {s.grad_acc.data_ptr() for s in slots} == {slots[0].grad_acc.data_ptr()}
    largest = max(s.master.numel() for s in slots) * 4
    saved = sum(-(-s.master.numel() * 4 // 64) * 64 for s in slots)
    assert _arena_bytes(kept) - _arena_bytes(model) == saved - -(-largest // 64) * 64
    for b in data:
        kept(**b).loss.backward()
        model(**b).loss.backward()
        want = kept_opt.clip_grad_norm_(1.0)
        got = optimizer.clip_grad_norm_(1.0)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        norms = [s.grad_norm for s in slots]
        ref = [s.grad_norm for c in kept._protrain_engine.manager.offloaded
               for s in c.trainable_slots]  # fmt: skip
        assert len(set(float(n) for n in norms)) > 1  # each its own, not the last one's
        torch.testing.assert_close(torch.stack(norms), torch.stack(ref), atol=0, rtol=0)
        kept_opt.step_without_host_updates()
        kept_opt.zero_grad()
        optimizer.step_without_host_updates()
        optimizer.zero_grad()
    protrain.close(kept)
    protrain.close(model)


def test_discarded_gradients_refuse_whatever_would_read_them():
    base = build("llama")
    data = batches("llama", 2)
    model, optimizer, _ = protrain.wrap(copy.deepcopy(base), n_persist=0, lr=LR, device="cpu",
                                        discard_offloaded_grads=True)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"step_in_backward\(\) reads offloaded gradients"):
        optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    with pytest.raises(RuntimeError, match=r"step\(\) reads offloaded gradients"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="norm_type=1"):
        optimizer.clip_grad_norm_(1.0, norm_type=1.0)
    with pytest.raises(RuntimeError, match="cannot accumulate"):
        model(**data[1]).loss.backward()  # a second micro-batch: a host accumulation
    # refused before anything was added: no gradient is left behind on a parameter
    assert all(p.grad is None for p in model.parameters())
    optimizer.step_without_host_updates()  # no zero_grad: the next backward starts afresh
    model(**data[1]).loss.backward()  # a step's first gradient is fine again
    ref, ref_opt, _ = protrain.wrap(copy.deepcopy(base), n_persist=0, lr=LR, device="cpu")
    ref(**data[1]).loss.backward()
    slots = [(s, r) for c, rc in zip(model._protrain_engine.manager.offloaded,
                                     ref._protrain_engine.manager.offloaded)
             for s, r in zip(c.trainable_slots, rc.trainable_slots)]  # fmt: skip
    assert slots
    for s, r in slots:
        torch.testing.assert_close(s.grad_norm, r.grad_norm, atol=0, rtol=0)
    optimizer.step_without_host_updates()
    protrain.close(ref)
    protrain.close(model)
