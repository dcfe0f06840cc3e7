"""The step-time and memory models of device-stepped offloaded chunks ([Note: device-stepped
chunks] in plan/runtime.py) and the search's choice of ``n_device_step``."""

from __future__ import annotations

import dataclasses

import numpy as np
import plan_synthetic as syn
import pytest

from protrain.optim.device_step import PIECE_NUMEL, staging_bytes
from protrain.plan import NoPlanFits, PlanProblem, search
from protrain.plan.memory import policy_matrix
from protrain.plan.runtime import RuntimeModel
from protrain.plan.world import World

GIB = 1 << 30


def _terms(rt, p, n_p, d):
    pol = policy_matrix(len(p.blocks), np.array([0]), np.array([0]))
    compute, swap = rt.pair_terms(pol)
    return rt.step_s(n_p, 3, compute[0], swap[0], breakdown=True, n_device_step=d)


def test_device_step_terms():
    p, hw = syn.profile(8, 10), dataclasses.replace(syn.hardware(), cpu_adam_params_per_s=0.5e9)
    rt = RuntimeModel(p, hw, clipping=True)
    t0, b0 = _terms(rt, p, 2, 0)
    t2, b2 = _terms(rt, p, 2, 2)
    trn = np.asarray(p.chunks.trainable_numel[-2:], dtype=np.float64)
    tb = float(np.sum(p.chunks.trainable_bytes[-2:]))
    assert b2["device_step_h2d_bytes"] == 16 * trn.sum()
    assert b2["device_step_d2h_bytes"] == 12 * trn.sum() + tb
    # gradients, masters and moments in, cast weights in instead of fp32 masters
    assert b2["h2d_bytes"] - b0["h2d_bytes"] == pytest.approx(16 * trn.sum() - (4 * trn.sum() - tb))
    # masters, moments and cast weights out, no write-back; the gradients go out in
    # backward as a host-stepped chunk's
    assert b2["d2h_bytes"] - b0["d2h_bytes"] == pytest.approx(12 * trn.sum())
    assert b0["host_optimizer"] - b2["host_optimizer"] == pytest.approx(
        trn.sum() * rt.host_s_per_param
    )
    tb8 = p.chunks.trainable_bytes[8]
    link = max(16 * trn[0] / hw.h2d_bytes_per_s, (12 * trn[0] + tb8) / hw.d2h_bytes_per_s,
               (28 * trn[0] + tb8) / hw.duplex_bytes_per_s)  # fmt: skip
    assert rt.device_step_chunk_s(np.array([8]))[0] == pytest.approx(
        max(link, trn[0] / hw.device_adam_params_per_s)
    )
    assert b2["device_step"] > 0 and b0["device_step"] == 0
    assert t2 < t0  # the host AdamW was the bound
    # n_device_step=0 is the model without it
    assert t0 == _terms(rt, p, 2, 0)[0] and "device_step" in b0

    # each starts once its gradients are on the host: with clipping, every gradient (the
    # first offloaded chunk's largest tensor comes last, as for the host steps); without,
    # its own largest tensor's copy after its backward, inside the backward
    chunks = rt.device_step_chunks(2, 2)
    out_s = 4 * np.asarray(p.chunks.max_trainable_numel) / hw.d2h_bytes_per_s
    no_clip = RuntimeModel(p, hw, clipping=False)
    early = no_clip._device_done(chunks, 2)
    assert (early < rt._device_done(chunks, 2)).all()
    assert rt._device_done(chunks, 2)[-1] == pytest.approx(
        out_s[2] + rt.device_step_chunk_s(chunks).sum()
    )
    last = chunks[-1]  # the first in backward: it starts after its backward and copy-out
    assert early[-1] == pytest.approx(
        out_s[last] - no_clip._bwd_after[last] + rt.device_step_chunk_s(chunks[-1:])[0]
    )

    problem = PlanProblem(p, hw, gpu_budget_bytes=100 * GIB)
    mem0 = problem.evaluate(2, 3, 0, 0)["memory_terms"]
    mem2 = problem.evaluate(2, 3, 0, 0, n_device_step=2)["memory_terms"]
    # the staging sets alone: fp32 gradients, masters, two moments and the cast weights of
    # one piece a set; the gradients are accumulated on the host, no bytes a parameter
    assert not any(k.startswith("device_step") for k in mem0)
    assert mem2.keys() - mem0.keys() == {"device_step_staging"}
    assert mem2["device_step_staging"] == staging_bytes() == 3 * 20 * PIECE_NUMEL
    assert sum(mem2.values()) - sum(mem0.values()) == staging_bytes()
    # fewer parameters than a piece: the sets shrink to them
    small = dataclasses.replace(p.chunks, trainable_numel=[1000] * p.chunks.n_chunks)
    tiny = PlanProblem(dataclasses.replace(p, chunks=small), hw, gpu_budget_bytes=100 * GIB)
    assert tiny.memory.device_step_terms(2, 2) == {"device_step_staging": staging_bytes(2000)}


@pytest.mark.parametrize("cpu_adam", [0.3e9, 1e13])
def test_search_takes_device_steps_where_the_host_adamw_is_the_bound(cpu_adam):
    p = syn.profile(8, 10)
    hw = dataclasses.replace(syn.hardware(), cpu_adam_params_per_s=cpu_adam)
    problem = PlanProblem(
        p, hw, gpu_budget_bytes=100 * GIB, fixed_knobs={"n_persist": 2}, device_step_search=True
    )
    result = search(problem)
    plan = result.plan
    assert 1 <= result.work["device_step_evaluations"] <= 4 * len(plan.candidates)
    assert any(r.startswith("n_device_step=") for r in plan.reasons)
    knobs = list(plan.knobs.values())
    without = problem.evaluate(*knobs)["step_s"]
    if cpu_adam < 1e12:  # slow host: the device steps some, and the step is faster
        assert plan.n_device_step > 0
        assert plan.predicted_step_s < without
    else:
        assert plan.n_device_step == 0
        assert plan.predicted_step_s == without
    assert plan.candidates[0]["n_device_step"] == plan.n_device_step


def test_a_fixed_device_step_count_is_planned_with():
    p = syn.profile(8, 10)
    hw = dataclasses.replace(syn.hardware(), cpu_adam_params_per_s=1e13)  # fast host: 0 best
    fixed = {"n_persist": 2, "n_device_step": 1}
    plan = search(PlanProblem(p, hw, gpu_budget_bytes=100 * GIB, fixed_knobs=fixed)).plan
    assert plan.n_device_step == 1 and plan.fixed_knobs["n_device_step"] == 1
    assert "device_step_staging" in plan.memory_terms
    with pytest.raises(NoPlanFits, match="n_device_step=9 fits none"):
        search(PlanProblem(p, hw, gpu_budget_bytes=100 * GIB,
                           fixed_knobs={"n_persist": 2, "n_device_step": 9}))  # fmt: skip
    with pytest.raises(ValueError, match="n_device_step=-1 is negative"):
        PlanProblem(p, hw, gpu_budget_bytes=GIB, fixed_knobs={"n_device_step": -1})


def test_a_device_step_fits_beside_a_plan_with_room_for_its_staging_alone():
    """A tight budget: the plan's own peak plus the staging sets. The device-stepped
    chunks' gradients take no device memory (4 bytes a parameter of them would not fit)."""
    p = syn.profile(8, 10)
    hw = dataclasses.replace(syn.hardware(), cpu_adam_params_per_s=1e13)
    knobs = {"n_persist": 2, "n_buffer": 3, "n_swap": 0, "n_checkpoint": 0}
    peak = PlanProblem(p, hw, gpu_budget_bytes=100 * GIB).evaluate(*knobs.values())["peak_bytes"]
    budget = peak + staging_bytes()
    assert 4 * sum(p.chunks.trainable_numel[-2:]) > 64 << 20  # what the old term added
    plan = search(PlanProblem(p, hw, gpu_budget_bytes=budget,
                              fixed_knobs={**knobs, "n_device_step": 2})).plan  # fmt: skip
    assert plan.n_device_step == 2 and plan.predicted_peak_bytes == budget
    with pytest.raises(NoPlanFits, match="n_device_step=2 fits none"):
        search(PlanProblem(p, hw, gpu_budget_bytes=budget - 1,
                           fixed_knobs={**knobs, "n_device_step": 2}))  # fmt: skip


def test_sharded_ranks_plan_their_own_shards():
    """With sharded chunks each rank steps its shard on the device: the link bytes are a
    rank's 1/N (the staging sets, a piece each, the same), and a fixed count is planned
    with, as on one rank."""
    p = syn.profile(8, 10)
    hw = dataclasses.replace(syn.hardware(), cpu_adam_params_per_s=0.3e9,
                             collective_bytes_per_s=100e9, all_gather_bytes_per_s=80e9,
                             reduce_scatter_bytes_per_s=50e9, world_size=2,
                             local_world_size=2)  # fmt: skip
    trn = float(np.sum(p.chunks.trainable_numel[-2:]))
    one = PlanProblem(p, hw, gpu_budget_bytes=100 * GIB)
    two = PlanProblem(p, hw, gpu_budget_bytes=100 * GIB, world=World(2, 2, "sharded"))
    e1 = one.evaluate(2, 3, 0, 0, n_device_step=2)
    e2 = two.evaluate(2, 3, 0, 0, n_device_step=2)
    assert e1["memory_terms"]["device_step_staging"] == staging_bytes()
    assert e2["memory_terms"]["device_step_staging"] == staging_bytes()
    assert "device_step_grads" not in e1["memory_terms"] | e2["memory_terms"]
    assert e2["time_terms"]["device_step_h2d_bytes"] == pytest.approx(16 * trn / 2)
    fixed = {"n_persist": 2, "n_device_step": 1}
    plan = search(PlanProblem(p, hw, gpu_budget_bytes=100 * GIB, fixed_knobs=fixed,
                              world=World(2, 2, "sharded"))).plan  # fmt: skip
    assert plan.n_device_step == 1
    found = search(PlanProblem(p, hw, gpu_budget_bytes=100 * GIB, fixed_knobs={"n_persist": 2},
                               world=World(2, 2, "sharded"), device_step_search=True))  # fmt: skip
    assert found.work["device_step_evaluations"] > 0


def test_search_leaves_device_steps_off_on_a_cpu_device():
    p = dataclasses.replace(syn.profile(8, 10), device="cpu")
    hw = dataclasses.replace(syn.hardware("cpu"), cpu_adam_params_per_s=0.3e9)
    result = search(
        PlanProblem(
            p, hw, gpu_budget_bytes=100 * GIB, fixed_knobs={"n_persist": 2}, device_step_search=True
        )
    )
    assert result.plan.n_device_step == 0
    assert result.work["device_step_evaluations"] == 0


def test_search_leaves_device_steps_to_the_user_by_default():
    """Until the CUDA path is measured the search chooses no device steps by itself, even
    where the model predicts a gain (the slow host of the test above)."""
    p = syn.profile(8, 10)
    hw = dataclasses.replace(syn.hardware(), cpu_adam_params_per_s=0.3e9)
    result = search(PlanProblem(p, hw, gpu_budget_bytes=100 * GIB, fixed_knobs={"n_persist": 2}))
    assert result.plan.n_device_step == 0
    assert result.work["device_step_evaluations"] == 0
