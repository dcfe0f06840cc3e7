"""Device-stepped offloaded chunks (``optim/device_step.py``) compute bit for bit what the host
AdamW computes: full fine-tuning (gpt2's odd sizes) and LoRA, decay and no-decay groups,
clipping, accumulation over micro-batches, fp16 loss scaling, a resume from the state dicts,
and the step started in backward; their gradients are the host path's, in the slots' host
accumulators. On the CPU the "device" is the CPU: the same pieces, staging sets and copies
run, synchronously. Pieces of 48 elements cut tensors inside."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain
from protrain.optim import device_step

from .models import batches, build, lora
from .test_equivalence import ACCUM, LR
from .test_flat_host_adam import _assert_bitwise, _groups, _states, _train

STEPS = 2


def _wrap(base, n_device_step, fp16=False):
    model = copy.deepcopy(base)
    groups = [g for g in _groups(model) if g["params"]]
    return protrain.wrap(
        model,
        n_persist=1,
        lr=LR,
        device="cpu",
        param_groups=groups,
        compute_dtype=torch.float16 if fp16 else None,
        n_device_step=n_device_step,
    )


def _stepped_numel(opt) -> int:
    ds = opt._device_step
    return sum(
        s.master.numel() for ci in ds.chunk_ids() for s in opt._manager.chunks[ci].trainable_slots
    )


@pytest.mark.parametrize(
    "kind,mode,fp16,resume",
    [
        ("gpt2", "full", False, True),
        ("llama", "lora", False, False),
        ("llama", "full", True, False),
    ],
)
def test_device_step_equals_host_step(kind, mode, fp16, resume, monkeypatch):
    """gpt2: one device-stepped chunk, then a resume; llama: every offloaded chunk."""
    monkeypatch.setattr(device_step, "PIECE_NUMEL", 48)
    base = build(kind)
    if mode == "lora":
        base = lora(base, kind)
    data = batches(kind, (STEPS + 2) * ACCUM)

    model, opt, layout = _wrap(base, 0, fp16)
    n_trainable = sum(1 for c in opt._manager.offloaded if c.trainable_slots)
    _train(model, opt, data, range(STEPS))
    host = _states(model, opt)
    if resume:
        _train(model, opt, data, range(STEPS, STEPS + 2))
        host_after = _states(model, opt)
    protrain.close(model)
    assert n_trainable >= 2

    n = 1 if resume else n_trainable
    model, opt, _ = _wrap(base, n, fp16)
    _train(model, opt, data, range(STEPS))
    assert opt._device_step.chunk_ids() == frozenset(opt._manager.forward_order[-n:])
    _assert_bitwise(host, _states(model, opt))
    stats = opt.stats
    assert stats["device_steps"] == STEPS
    # gradients, masters and both moments in (fp32)
    assert stats["device_step_h2d_bytes"] == 16 * _stepped_numel(opt) * STEPS
    assert stats["device_step_s"] > 0
    saved = copy.deepcopy(_states(model, opt))
    protrain.close(model)
    if resume:
        model, opt, _ = _wrap(base, n, fp16)  # resumed from the state dicts
        protrain.load_state_dict(model, saved[0])
        opt.load_state_dict(saved[1])
        _train(model, opt, data, range(STEPS, STEPS + 2))
        _assert_bitwise(host_after, _states(model, opt))
        protrain.close(model)


@pytest.mark.parametrize("accum", [1, ACCUM])
def test_device_step_in_backward_without_clipping(monkeypatch, accum):
    """Armed by step_in_backward(): every chunk's update starts in backward as soon as its
    gradients are complete, the device-stepped ones on the device when the window has one
    micro-batch (with more, their last gradients are added on the host, and step() steps
    them rather than the backward's thread waiting for those adds); the same bits as the
    host path."""
    monkeypatch.setattr(device_step, "PIECE_NUMEL", 48)
    base = build("llama")
    data = batches("llama", STEPS * accum)

    def run(n):
        model, opt, _ = _wrap(base, n)
        for step in range(STEPS):
            for mb in range(accum):
                if mb == accum - 1:
                    opt.step_in_backward()
                (model(**data[step * accum + mb]).loss / accum).backward()
            # both device-stepped chunks stepped inside the backward (one call each), or
            # neither, and then both in one call of step()
            before, after = (2 * (step + 1),) * 2 if accum == 1 else (step, step + 1)
            if n:
                assert opt.stats.get("device_steps", 0) == before
            opt.step()
            if n:
                assert opt.stats["device_steps"] == after
            opt.zero_grad()
        out = copy.deepcopy(_states(model, opt))
        protrain.close(model)
        return out

    _assert_bitwise(run(0), run(2))


def _tensors_outside_sets(ds) -> list[str]:
    """Attributes of ``ds`` (a DeviceStep) that hold a tensor, its staging sets and its
    manager left out."""

    def holds(x) -> bool:
        if isinstance(x, torch.Tensor):
            return True
        if isinstance(x, dict):
            return any(holds(v) for v in x.values())
        if isinstance(x, list | tuple | set | frozenset):
            return any(holds(v) for v in x)
        return False

    return [k for k, v in vars(ds).items() if k not in ("manager", "_sets") and holds(v)]


def test_device_step_keeps_no_gradient_on_the_device(monkeypatch):
    """The device-stepped chunks' gradients are accumulated in the slots' pinned host
    accumulators (``grad_acc``, made at wrap), bit for bit those of the host path, and the
    DeviceStep holds no tensor but its staging sets, before and after the step: no device
    memory a parameter. On the CPU a set is its four fp32 buffers (gradients, masters, two
    moments) of one piece; CUDA adds the cast weights' (``staging_bytes``)."""
    monkeypatch.setattr(device_step, "PIECE_NUMEL", 48)
    base = build("llama")
    data = batches("llama", ACCUM)

    def backward(n):
        model, opt, _ = _wrap(base, n)
        made = {s.name: s.grad_acc for c in opt._manager.offloaded for s in c.trainable_slots}
        for mb in range(ACCUM):  # the second micro-batch accumulates on the host worker
            (model(**data[mb]).loss / ACCUM).backward()
        opt.synchronize()
        return model, opt, made

    model, opt, _ = backward(0)
    want = {s.name: s.grad_acc.clone() for c in opt._manager.offloaded for s in c.trainable_slots}
    protrain.close(model)

    model, opt, made = backward(2)
    ds, m = opt._device_step, opt._manager
    slots = [s for ci in sorted(ds.chunk_ids()) for s in m.chunks[ci].trainable_slots]
    arena = m._host_arena
    assert len(ds.chunk_ids()) == 2 and slots
    for s in slots:
        assert s.has_grad and s.grad_acc is made[s.name]
        assert arena.data_ptr() <= s.grad_acc.data_ptr() < arena.data_ptr() + arena.numel()
        assert torch.equal(s.grad_acc, want[s.name]), s.name
    assert _tensors_outside_sets(ds) == [] and ds._sets == []
    opt.step()
    assert opt.stats["device_steps"] == 1
    assert _tensors_outside_sets(ds) == []
    assert len(ds._sets) == device_step._N_SETS
    staged = sum(t.numel() * t.element_size() for st in ds._sets for t in st.fp32.values())
    assert staged == device_step._N_SETS * 48 * 4 * 4
    assert staged == device_step.staging_bytes(48) - device_step._N_SETS * 48 * 4
    protrain.close(model)


def test_device_step_knob_is_checked():
    base = build("llama")
    with pytest.raises(ValueError, match="n_device_step=99 is not allowed"):
        _wrap(base, 99)
    with pytest.raises(ValueError, match="n_device_step=-1 is not allowed"):
        _wrap(base, -1)


def test_split_pieces_cuts_tensors_at_lane_units():
    class _S:
        def __init__(self, n):
            self.master = torch.empty(n)

    items = [(_S(n), None, 0) for n in (40, 7, 100)]
    pieces = device_step.split_pieces(items, 48)
    for p in pieces:
        assert sum(s.hi - s.lo for s in p) <= 48
        for s in p:  # a cut inside a tensor starts at a multiple of 16
            assert s.lo % 16 == 0
            assert s.hi % 16 == 0 or s.hi == s.slot.master.numel()
    covered = {}
    for p in pieces:
        for s in p:
            covered.setdefault(id(s.slot), []).append((s.lo, s.hi))
    assert [sum(b - a for a, b in covered[id(s)]) for s, _, _ in items] == [40, 7, 100]


def test_device_step_merges_copies_of_back_to_back_tensors(monkeypatch):
    """A LoRA piece holds many small tensors whose masters, accumulators and moments lie back
    to back on the host: each kind crosses in as a few merged copies, not one per tensor and
    kind (listed kind after kind, so that no copy of another kind sits between two of one
    kind and blocks their merge)."""
    monkeypatch.setattr(device_step, "PIECE_NUMEL", 1 << 20)  # one piece holds every tensor
    base = lora(build("llama"), "llama")
    data = batches("llama", 1)
    model, opt, _ = _wrap(base, 2)
    seen = []
    merged = device_step._merged

    def counting(pairs):
        out = merged(pairs)
        seen.append((len(pairs), len(out)))
        return out

    monkeypatch.setattr(device_step, "_merged", counting)
    model(**data[0]).loss.backward()
    opt.step()
    chunks = opt._device_step.chunk_ids()
    tensors = sum(len(opt._manager.chunks[ci].trainable_slots) for ci in chunks)
    # one call per kind (4 in, 3 out), each over every tensor of the piece
    assert len(chunks) == 2 and tensors >= 4
    assert [n for n, _ in seen] == [tensors] * 7, seen
    # one copy per chunk and kind: a chunk's tensors lie back to back (one param group here)
    assert [out for _, out in seen] == [len(chunks)] * 7, seen
    protrain.close(model)
