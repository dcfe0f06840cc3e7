"""The memory model with ``optimizer="adamw_8bit"`` (``plan/memory.py``): persistent chunks
count bitsandbytes' 8-bit state, the host and the trace's own states stay fp32. Synthetic
profiles: no trace."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from plan_synthetic import profile

from protrain.optim.adamw_8bit import QMAP_BYTES
from protrain.plan.memory import MemoryModel, device_optimizer_bytes


def test_8bit_model_states_count_the_8bit_state_and_nothing_else_changes():
    p = profile(6, 8)
    p = dataclasses.replace(p, step_start_bytes=int(1.5e9))
    fp32 = MemoryModel(p)
    q = MemoryModel(p, optimizer="adamw_8bit")
    t = p.chunks
    per_chunk = t.chunk_size_bytes + device_optimizer_bytes(
        t.trainable_numel, t.trainable_tensors, "adamw_8bit"
    )
    want = np.concatenate([[0], np.cumsum(per_chunk)])
    big = np.cumsum(np.asarray(t.max_trainable_numel) >= 4096) > 0
    want[1:] += np.where(big, QMAP_BYTES, 0)
    assert np.array_equal(q.model_states, want)
    assert (q.model_states[1:] < fp32.model_states[1:]).all()
    # the host keeps fp32 moments; the trace's resident rest is read against its fp32 states
    assert np.array_equal(q.host_suffix, fp32.host_suffix)
    assert q.other_resident == fp32.other_resident > 0
    for n_persist in (0, 3, 8):
        a, b = fp32.terms(n_persist, 2, 0, 6), q.terms(n_persist, 2, 0, 6)
        assert {k: v for k, v in a.items() if k != "model_states"} == {
            k: v for k, v in b.items() if k != "model_states"
        }


def test_8bit_bytes_of_a_one_tensor_chunk_are_exact():
    # one tensor per chunk: bitsandbytes' state of that tensor plus its fp32 master
    trn = np.asarray([100, 4095, 4096, 1 << 24, (1 << 24) + 1])
    got = device_optimizer_bytes(trn, np.ones_like(trn), "adamw_8bit")
    want = [12 * 100, 12 * 4095, 6 * 4096 + 8 * 16, 6 * (1 << 24) + 8 * (1 << 16),
            6 * ((1 << 24) + 1) + 8 * ((1 << 16) + 1)]  # fmt: skip
    assert got.tolist() == want


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="'adamw', 'adamw_8bit'"):
        MemoryModel(profile(2, 4), optimizer="lion")


def test_the_search_plans_with_the_8bit_state():
    """At the same knobs the 8-bit plan's predicted peak is lower by the model states
    alone; at a budget between the two peaks, 8 persistent chunks fit only with 8-bit state.
    The plan names its optimizer, and applying it with the other one is refused."""
    from plan_synthetic import hardware

    from protrain.plan.search import NoPlanFits, PlanProblem, search

    p = profile(6, 8)
    hw = hardware()
    fp32 = PlanProblem(p, hw, gpu_budget_bytes=1 << 40)
    q = PlanProblem(p, hw, gpu_budget_bytes=1 << 40, optimizer="adamw_8bit")
    assert q.memory.optimizer == "adamw_8bit" and fp32.memory.optimizer == "adamw"
    knobs = {"n_persist": 8, "n_buffer": 0, "n_swap": 0, "n_checkpoint": 6}
    peaks = [search(x.with_fixed(knobs)).plan.predicted_peak_bytes for x in (fp32, q)]
    assert peaks[0] - peaks[1] == fp32.memory.model_states[8] - q.memory.model_states[8] > 0
    budget = (peaks[0] + peaks[1]) // 2
    fixed = {"n_swap": 0, "n_checkpoint": 6, "n_persist": 8}
    with pytest.raises(NoPlanFits):
        search(PlanProblem(p, hw, gpu_budget_bytes=budget, fixed_knobs=fixed))
    plan = search(
        PlanProblem(p, hw, gpu_budget_bytes=budget, fixed_knobs=fixed, optimizer="adamw_8bit")
    ).plan
    assert plan.n_persist == 8 and plan.predicted_peak_bytes <= budget
    assert plan.optimizer == "adamw_8bit"
    assert search(fp32.with_fixed(knobs)).plan.optimizer == "adamw"
    import torch

    from protrain.knobs import OptimizerSettings
    from protrain.planned_wrap import apply_plan

    with pytest.raises(ValueError, match="the plan was made for optimizer='adamw_8bit'"):
        apply_plan(torch.nn.Linear(2, 2), plan, optim=OptimizerSettings(optimizer="adamw"))


def test_host_bytes_follow_the_optimizer_state():
    """The host's moments in ``optimizer_state``'s format: 8, 4 or 2 bytes a parameter (8-bit:
    and an absmax per block, each tensor's last counted whole); the device side unchanged."""
    p = profile(6, 8)
    t = p.chunks
    trn = np.asarray(t.trainable_numel, dtype=np.int64)
    tensors = np.asarray(t.trainable_tensors, dtype=np.int64)
    fp32 = MemoryModel(p)
    saved = {"bf16": 4 * trn, "8bit": 6 * trn - np.ceil(trn / 32).astype(np.int64) - 8 * tensors}
    for fmt, less in saved.items():
        m = MemoryModel(p, optimizer_state=fmt)
        want = fp32.host_suffix - np.concatenate([np.cumsum(less[::-1])[::-1], [0]])
        assert np.array_equal(m.host_suffix, want), fmt
        assert np.array_equal(m.model_states, fp32.model_states)
