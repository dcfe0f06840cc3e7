"""The memory model against measured device bytes, through protrain.wrap, on the CPU device.

The CPU stand-in for a device's allocator is ``protrain.profile.measure``: persistent chunk
storage and masters, resident offloaded chunks, and every storage the main thread's ops
create (tensor bytes, no allocator rounding). Tolerance: from 0.5% under to 2% over, for
traces with every chunk persistent and with every chunk offloaded alike; swap is left out
(on a CPU device its "host" copies are device bytes too).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import protrain
from protrain.knobs import Knobs, OptimizerSettings
from protrain.plan import PlanProblem, PlanRequest, parse_bytes, profile_and_plan, search
from protrain.plan.closed_loop import check_plan
from protrain.profile.trace import hf_loss, trace_model

sys.path.insert(0, str(Path(__file__).parent.parent / "profile"))
import plan_synthetic as syn  # noqa: E402
import tiny_llama  # noqa: E402
from cpu_runs import measured_peak, model_and_traces  # noqa: E402


@pytest.fixture(scope="module")
def model_and_profiles():
    return model_and_traces(seed=1)


@pytest.mark.parametrize(
    "knobs",
    [
        (7, 0, 0, 0),
        (7, 0, 0, 4),
        (7, 0, 0, 2),
        (3, 2, 0, 2),
        (0, 2, 0, 4),
        (0, 3, 0, 0),
        (2, 5, 0, 1),
        (5, 2, 0, 3),
        (1, 4, 0, 0),
    ],  # fmt: skip
)
def test_predicted_peak_matches_measured(model_and_profiles, knobs):
    model, batch, persistent, offloaded = model_and_profiles
    assert persistent.chunks.n_chunks == 7
    measured = measured_peak(model, batch, knobs)
    hw = syn.hardware("cpu")
    for profile in (persistent, offloaded):
        predicted = PlanProblem(profile, hw, gpu_budget_bytes=1 << 40).evaluate(*knobs)
        err = (predicted["peak_bytes"] - measured) / measured
        assert -0.005 <= err <= 0.02, (profile.trace_n_persist, knobs, err, predicted)


def test_planned_knobs_fit_when_run(model_and_profiles):
    model, batch, persistent, _ = model_and_profiles
    budget = 3_500_000  # tensor bytes: less than everything kept, so the search must trade
    plan = search(PlanProblem(persistent, syn.hardware("cpu"), gpu_budget_bytes=budget)).plan
    assert plan.predicted_peak_bytes <= budget
    measured = measured_peak(model, batch, tuple(plan.knobs.values()))
    assert measured <= budget * 1.05, (plan.knobs, measured)


def test_auto_plan_keeps_fixed_knobs(caplog):
    model = tiny_llama.build(seed=2)
    with caplog.at_level("INFO", logger="protrain.plan.auto"):
        request = PlanRequest(
            "6MB", sample_batch=tiny_llama.batch(), knobs=Knobs(n_checkpoint=2, n_persist=None)
        )
        plan, problem = profile_and_plan(model, request, device="cpu", hardware=syn.hardware("cpu"))
    assert plan.n_checkpoint == 2 and plan.fixed_knobs == {"n_checkpoint": 2}
    assert plan.predicted_peak_bytes <= 6_000_000
    assert "knobs fixed by the user: n_checkpoint=2" in caplog.text
    assert problem.gpu_budget_bytes == 6_000_000


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 << 30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes(123) == 123
    with pytest.raises(ValueError):
        parse_bytes("24 parsecs")


def test_closed_loop_corrects_a_plan_that_would_not_fit():
    prof = syn.profile(n_blocks=6, n_chunks=12, seed=7)
    problem = PlanProblem(prof, syn.hardware(), gpu_budget_bytes=4 << 30)
    plan = search(problem).plan
    ok = check_plan(plan, problem, measured_peak_bytes=plan.predicted_peak_bytes - 1,
                    measured_step_s=plan.predicted_step_s * 1.1)  # fmt: skip
    assert ok.corrected is None and ok.step_error == pytest.approx(-1 / 11)
    room = problem.gpu_budget_bytes - plan.predicted_peak_bytes
    over = plan.predicted_peak_bytes + room + (200 << 20)  # the real peak passes the budget
    check = check_plan(plan, problem, measured_peak_bytes=over,
                       measured_step_s=plan.predicted_step_s)  # fmt: skip
    new = check.corrected
    assert new is not None and new.knobs != plan.knobs
    assert new.memory_terms["measured_beyond_model"] == over - plan.predicted_peak_bytes
    assert new.predicted_peak_bytes <= problem.gpu_budget_bytes
    assert "corrected after the first steps" in new.reasons[0]


def test_torch_state_is_clean_after_measuring(model_and_profiles):
    model, *_ = model_and_profiles
    assert not hasattr(model, "_protrain_engine")
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def _lora(model):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                     init_lora_weights=False)  # fmt: skip
    return get_peft_model(model, cfg)


def test_lora_trace_and_memory_model():
    """LoRA: a block spans 4 chunks here, and its backward needs them all at once (n_buffer=2
    passes the engine's check but fails at run time), so the plan's least n_buffer is 4."""
    model = _lora(tiny_llama.build(seed=3))
    batch = tiny_llama.batch()
    profile = trace_model(model, batch, device="cpu", knobs=Knobs(n_persist=0))
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(profile.grad_order) == len(adapters) and all("lora_" in n for n in adapters)
    n = profile.chunks.n_chunks
    problem = PlanProblem(profile, syn.hardware("cpu"), gpu_budget_bytes=1 << 40)
    for knobs in ((n, 0, 0, 0), (n // 2, 4, 0, 2), (0, 4, 0, 4), (0, 5, 0, 0)):
        assert problem.allowed(*knobs)
        measured = measured_peak(model, batch, knobs)
        err = (problem.evaluate(*knobs)["peak_bytes"] - measured) / measured
        assert -0.005 <= err <= 0.02, (knobs, err)


def test_apply_plan_executes_the_knobs():
    from protrain.planned_wrap import apply_plan

    model = tiny_llama.build(seed=4)
    batch = tiny_llama.batch()
    plan, _ = profile_and_plan(model, PlanRequest(3_500_000, sample_batch=batch), device="cpu",
                               hardware=syn.hardware("cpu"))  # fmt: skip
    model, opt, layout, handle = apply_plan(model, plan, device="cpu",
                                            optim=OptimizerSettings(lr=1e-3))  # fmt: skip
    try:
        assert (layout.n_persist, layout.n_chunks) == (plan.n_persist, plan.n_chunks)
        policies = [p.value for p in handle.policies]
        assert policies.count("checkpoint") == plan.n_checkpoint
        assert policies.count("swap") == plan.n_swap
        hf_loss(model, batch).backward()
        opt.step()
    finally:
        handle.remove()
        protrain.close(model)


def test_trace_persist_fills_half_the_budget():
    from protrain.plan.auto import trace_persist
    from protrain.profile.chunk_table import chunk_table

    table = chunk_table(tiny_llama.build(), compute_dtype=torch.float32)
    per = [table.chunk_size_bytes + 16 * n + 4 * t
           for n, t in zip(table.trainable_numel, table.trainable_tensors)]  # fmt: skip
    assert trace_persist(table, sum(per)) is None
    assert trace_persist(table, sum(per[:3])) == 3
    assert trace_persist(table, sum(per[:3]) - 1) == 2
    assert trace_persist(table, 0) == 0


def test_closed_loop_on_cuda_reads_the_allocated_peak_not_the_grown_cache():
    """Under a budget cap the caching allocator grows reserved memory up to the budget: a
    reserved peak at the budget with allocated bytes as predicted is no reason to re-plan;
    allocated bytes above the prediction (less its allocator term) are."""
    prof = dataclasses.replace(syn.profile(n_blocks=6, n_chunks=12, seed=7),
                               allocator_overhead_bytes=64 << 20)  # fmt: skip
    problem = PlanProblem(prof, syn.hardware(), gpu_budget_bytes=4 << 30)
    plan = search(problem).plan
    overhead = plan.memory_terms["allocator_overhead"]
    assert overhead == 64 << 20
    tensors = plan.predicted_peak_bytes - overhead
    at_budget = problem.gpu_budget_bytes + (8 << 20)
    calm = check_plan(plan, problem, measured_peak_bytes=at_budget,
                      measured_step_s=plan.predicted_step_s, measured_allocated_bytes=tensors)  # fmt: skip
    assert calm.corrected is None
    room = problem.gpu_budget_bytes - plan.predicted_peak_bytes
    beyond = room + (200 << 20)
    check = check_plan(plan, problem, measured_peak_bytes=at_budget,
                       measured_step_s=plan.predicted_step_s,
                       measured_allocated_bytes=tensors + beyond)  # fmt: skip
    assert check.corrected is not None
    assert check.corrected.memory_terms["measured_beyond_model"] == beyond
