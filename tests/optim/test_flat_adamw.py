"""FlatAdamW against torch's per-parameter fused AdamW, bit for bit: on masters carved as the
chunk manager carves them, back to back (flat runs) or each followed by its accumulator (a
run per parameter); LoRA-shaped and odd-sized parameters, two parameter groups, parameters
without a gradient at some steps, the fp16 unscale and clip of the step task, and a resume
from the per-parameter state."""

from __future__ import annotations

import pytest
import torch

from protrain.chunks.chunk import ParamSlot
from protrain.chunks.layout import ParamPlacement
from protrain.chunks.manager import _align64, _carve
from protrain.optim import flat_adamw
from protrain.optim.flat_adamw import FlatAdamW
from protrain.optim.hybrid_adamw import _step_host_piece

# LoRA-shaped (rank 16) and odd-sized; groups 0 (decay) and 1 (no decay)
SHAPES = [(16, 96), (80, 16), (16, 4096), (7,), (13, 5), (64, 16), (16, 48), (1,), (3, 33),
          (16, 64), (96, 16), (32,), (16, 16)]  # fmt: skip
GROUPS = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
HYPER = [
    {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
    {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
]


def _slots(values: list[torch.Tensor], flat: bool, packed: bool = False) -> list[ParamSlot]:
    """Slots whose masters and accumulators are carved from one arena as the manager does:
    ``flat``: every master, then every accumulator; else master, accumulator, master...
    ``packed``: without the manager's 64-byte alignment (odd sizes back to back too)."""
    nbytes = [v.numel() * 4 for v in values]
    arena = torch.zeros(2 * sum(_align64(n) for n in nbytes), dtype=torch.uint8)
    off = 0
    carved = {}
    order = [("m", i) for i in range(len(values))] + [("g", i) for i in range(len(values))]
    if not flat:
        order = [(k, i) for i in range(len(values)) for k in ("m", "g")]
    for k, i in order:
        carved[k, i], end = _carve(arena, off, nbytes[i], torch.float32, values[i].shape)
        off = off + nbytes[i] if packed else end
    slots = []
    for i, v in enumerate(values):
        p = torch.nn.Parameter(v.clone())
        pl = ParamPlacement([f"p{i}"], 0, 0, v.numel(), tuple(v.shape), torch.float32, True)
        s = ParamSlot(p, pl, 0, i, torch.float32, torch.device("cpu"), p.data)
        s.master, s.grad_acc = carved["m", i], carved["g", i]
        s.master.copy_(v)
        slots.append(s)
    return slots


def _reference(values: list[torch.Tensor], groups: list[int] = GROUPS):
    params = [torch.nn.Parameter(v.clone()) for v in values]
    inner = [
        {"params": [p for p, g in zip(params, groups) if g == gi], **HYPER[gi]} for gi in (0, 1)
    ]
    return params, torch.optim.AdamW([g for g in inner if g["params"]], fused=True)


def _grads(step: int, scale: float = 1.0, shapes=SHAPES) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(s, generator=gen) * scale * 10 ** (step % 3 - 1) for s in shapes]
    if step == 1:  # some parameters get no gradient: neither decayed nor counted
        for i in (1, 4, 9):
            grads[i] = None
    return grads


def _step_both(adam, slots, params, ref, grads, inv_scale=None, clip_coef=None) -> None:
    for s, p, g in zip(slots, params, grads):
        p.grad = None if g is None else g.clone()
        if g is not None:
            s.grad_acc.copy_(g)
    with_grad = [s for s, g in zip(slots, grads) if g is not None]
    _step_host_piece(adam, with_grad, HYPER, inv_scale, clip_coef, {})
    ref_grads = [p.grad for p in params if p.grad is not None]
    if inv_scale is not None:  # as the step task did per tensor
        torch._amp_foreach_non_finite_check_and_unscale_(ref_grads, torch.zeros(1), inv_scale)
    if clip_coef is not None:
        torch._foreach_mul_(ref_grads, clip_coef)
    ref.step()
    for s, p, g in zip(slots, params, grads):
        if g is not None:  # the step task unscales and clips the accumulators in place
            assert torch.equal(s.grad_acc, p.grad), s.name


def _assert_same(adam, slots, params, ref) -> None:
    for s, p in zip(slots, params):
        assert torch.equal(s.master, p.detach()), s.name
        mine, theirs = adam.state.get(s.master), ref.state.get(p)
        assert (mine is None) == (not theirs), s.name
        if mine is not None:
            assert mine.keys() == theirs.keys()
            for k, v in theirs.items():
                assert mine[k].dtype == v.dtype and mine[k].shape == v.shape, (s.name, k)
                assert torch.equal(mine[k], v), (s.name, k)


def _values() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.parametrize("flat", [True, False])
def test_bitwise_equal_to_per_parameter_fused_adamw(flat):
    values = _values()
    slots = _slots(values, flat)
    adam = FlatAdamW(slots, GROUPS)
    params, ref = _reference(values)
    if flat:  # runs end at a group change or after a size that is not a multiple of 16
        assert [len(r.slots) for r in adam.runs] == [4, 1, 3, 1, 2, 2]
    else:
        assert len(adam.runs) == len(slots)
    for step in range(4):
        _step_both(adam, slots, params, ref, _grads(step))
        _assert_same(adam, slots, params, ref)
    # the parameters left out at step 1 keep their own step count
    assert float(adam.state[slots[1].master]["step"]) == 3.0
    assert float(adam.state[slots[0].master]["step"]) == 4.0


def test_odd_sizes_back_to_back_end_their_runs():
    """Masters packed without the manager's alignment: a run still ends after each size that
    is not a multiple of 16, so no tensor's scalar tail moves into vector lanes (joined, 495
    of 160,593 exp_avg_sq elements differed by an ulp after 4 steps on this AVX2 CPU)."""
    shapes = [(8 * k + 7,) for k in range(1, 60)] + [(16, 64), (48,)]
    values = [torch.randn(s, generator=torch.Generator().manual_seed(1)) for s in shapes]
    groups = [0] * len(shapes)
    slots = _slots(values, flat=True, packed=True)
    adam = FlatAdamW(slots, groups)
    assert [len(r.slots) for r in adam.runs] == [1] * 59 + [2]
    params, ref = _reference(values, groups)
    for step in (0, 2, 3):
        _step_both(adam, slots, params, ref, _grads(step, shapes=shapes))
        _assert_same(adam, slots, params, ref)


def test_fp16_unscale_and_clip_in_the_step_task():
    values = _values()
    slots = _slots(values, flat=True)
    adam = FlatAdamW(slots, GROUPS)
    params, ref = _reference(values)
    inv_scale = torch.full((1,), 1.0 / 1024)
    for step in range(3):
        _step_both(adam, slots, params, ref, _grads(step, 1024.0), inv_scale, torch.tensor(0.37))
        _assert_same(adam, slots, params, ref)


def test_resume_from_per_parameter_state():
    values = _values()
    slots = _slots(values, flat=True)
    adam = FlatAdamW(slots, GROUPS)
    params, ref = _reference(values)
    for step in range(2):
        _step_both(adam, slots, params, ref, _grads(step))
    # what HybridAdamW.state_dict writes (copies on the CPU), into a fresh engine's piece
    saved = {s.index: {k: v.clone() for k, v in adam.state[s.master].items()} for s in slots}
    resumed_slots = _slots([s.master.clone() for s in slots], flat=True)
    resumed = FlatAdamW(resumed_slots, GROUPS)
    for s in resumed_slots:
        resumed.state[s.master] = saved[s.index]
    for step in range(2, 4):
        _step_both(resumed, resumed_slots, params, ref, _grads(step))
        _assert_same(resumed, resumed_slots, params, ref)
    resumed.state.pop(resumed_slots[0].master)  # a parameter without state starts afresh
    assert resumed_slots[0].master not in resumed.state
    assert len(resumed.state) == len(slots) - 1


def test_state_of_another_shape_is_refused():
    slots = _slots(_values(), flat=True)
    adam = FlatAdamW(slots, GROUPS)
    bad = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}
    with pytest.raises(ValueError, match="exp_avg.*5 elements; its master has 1536"):
        adam.state[slots[0].master] = bad
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        adam.state[slots[0].master] = {**bad, "max_exp_avg_sq": torch.zeros(5)}


def test_lane_unit_divides_the_vector_width():
    """The rule of [Note: flat runs] holds where torch's fp32 vector width divides 16."""
    width = {"AVX512": 16, "AVX2": 8, "DEFAULT": 8}.get(torch.backends.cpu.get_cpu_capability())
    assert width is not None and flat_adamw._LANE_UNIT % width == 0
