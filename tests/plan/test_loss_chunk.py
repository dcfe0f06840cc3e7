"""The loss chunk (chunked_loss_tokens) as a searched knob: traced at the smallest chunk,
the others derived, checked against traces at those chunks and against a real run."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import protrain
import protrain.plan.auto as auto
from protrain.knobs import OptimizerSettings
from protrain.plan import (
    Plan,
    PlanRequest,
    candidates_table,
    explain,
    profile_and_plan,
    profile_model,
)
from protrain.plan.loss_chunk import LossChunks, at_loss_chunk, loss_chunk_candidates
from protrain.plan.search import NoPlanFits
from protrain.planned_wrap import apply_plan
from protrain.profile.measure import measure_steps
from protrain.profile.trace import trace_model
from protrain.train.planning import (
    PlanSettings,
    loss_chunk_of,
    no_plan_fits_message,
    plan_memory,
    planner_loss,
)

sys.path.insert(0, str(Path(__file__).parent))
import plan_synthetic  # noqa: E402

VOCAB, FLOOR = 4096, 32  # the logits dominate the head; 128 positions: chunks 64 and 32
CPU = torch.device("cpu")


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, use_cache=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _batch() -> dict:
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _chunks(floor: int = FLOOR) -> LossChunks:
    return LossChunks(loss_at=lambda c: planner_loss(CPU, c), vocab_size=VOCAB, floor_tokens=floor)


@pytest.fixture(scope="module")
def traced():
    model, batch = _model(), _batch()
    request = PlanRequest(1 << 40, sample_batch=batch, loss_chunks=_chunks())
    prof = profile_model(model, request, device="cpu")
    return model, batch, prof


def _plan(model, batch, prof, budget):
    request = PlanRequest(budget, 1 << 40, sample_batch=batch)
    return profile_and_plan(model, request, device="cpu", profile=prof,
                            hardware=plan_synthetic.hardware("cpu"))[0]  # fmt: skip


def _head_peak(prof) -> int:
    return max(iv.peak_bytes for iv in prof.intervals if iv.kind == "head")


def test_candidates_off_then_powers_of_two_down_to_the_floor():
    assert loss_chunk_candidates(128, 32) == [None, 64, 32]
    assert loss_chunk_candidates(9216, 1024) == [None, 8192, 4096, 2048, 1024]
    assert loss_chunk_candidates(1024, 1024) == [None]  # one chunk would be the whole logits
    with pytest.raises(ValueError, match="floor_tokens=0 is not allowed"):
        _chunks(floor=0)


def test_trace_runs_the_smallest_chunk_and_budgets_its_logits_only(monkeypatch):
    """The trace holds one smallest chunk's logits, not the whole: at a budget whose half is
    the whole logits, the trace still keeps chunks persistent."""
    model, batch = _model(), _batch()
    asked, seen = [], []
    chunks = LossChunks(
        loss_at=lambda c: asked.append(c) or planner_loss(CPU, c), vocab_size=VOCAB,
        floor_tokens=FLOOR,
    )  # fmt: skip
    monkeypatch.setattr(auto, "trace_model",
                        lambda m, b, knobs, **kw: seen.append(knobs.n_persist) or SimpleNamespace())  # fmt: skip
    whole = auto.full_logits_bytes(model, 2, 64, torch.float32)
    t = auto.chunk_table(model, compute_dtype=torch.float32)
    first = t.chunk_size_bytes + 16 * t.trainable_numel[0] + 4 * t.trainable_tensors[0]
    budget = 2 * (whole + first - 1)  # half: the whole logits and not quite one chunk's states
    auto.profile_model(
        model, PlanRequest(budget, sample_batch=batch, loss_chunks=chunks), device="cpu"
    )
    auto.profile_model(model, PlanRequest(budget, sample_batch=batch), device="cpu")
    assert asked == [FLOOR]
    assert seen[0] != 0 and seen[1] == 0  # the plain loss's whole logits took the half


def test_derived_chunks_against_traces_at_those_chunks(traced):
    """Memory model: head peak(c) = traced peak + 8 bytes x vocab x (positions(c) -
    positions(traced)) in fp32; an upper bound within 5% of a trace at that chunk. Time:
    "off" is the free-running step less its loss forward (not the traced step's, which
    carries the trace's overheads)."""
    model, batch, prof = traced
    assert prof.loss_chunk_tokens == FLOOR and prof.loss_chunk_candidates == [None, 64, 32]
    assert prof.loss_forward_s > 0
    assert 0 < prof.free_loss_forward_s < prof.free_fwd_bwd_s - prof.free_blocks_fwd_s
    for chunk in (64, None):
        measured = trace_model(model, batch, device="cpu", loss_fn=planner_loss(CPU, chunk))
        derived = at_loss_chunk(prof, chunk)
        assert derived.loss_chunk_tokens == chunk
        assert _head_peak(measured) <= _head_peak(derived) <= 1.05 * _head_peak(measured)
    off = at_loss_chunk(prof, None)
    assert off.free_fwd_bwd_s == pytest.approx(prof.free_fwd_bwd_s - prof.free_loss_forward_s)
    assert off.head_s == pytest.approx(max(prof.head_s - prof.free_loss_forward_s, 0.0))
    assert at_loss_chunk(prof, 64).free_fwd_bwd_s == prof.free_fwd_bwd_s
    # the step with nothing recomputed moves by the same loss forward
    # (clipped at 0 as head_s is: two timings of a tiny model on a loaded CPU can cross)
    assert off.free_keep_fwd_bwd_s == pytest.approx(
        max(prof.free_keep_fwd_bwd_s - prof.free_loss_forward_s, 0.0)
    )
    # a profile without a free-running step (older ones): the traced loss forward
    old = dataclasses.replace(prof, free_fwd_bwd_s=None, free_loss_forward_s=None)
    assert at_loss_chunk(old, None).head_s == pytest.approx(
        max(prof.head_s - prof.loss_forward_s, 0.0)
    )


def test_search_takes_off_when_it_fits_and_a_chunk_when_it_does_not(traced):
    model, batch, prof = traced
    roomy = _plan(model, batch, prof, 1 << 40)
    assert roomy.loss_planned and roomy.chunked_loss_tokens is None
    # the least budget of each: the smallest chunk's, and a plain loss traced whole
    with pytest.raises(NoPlanFits) as least:
        _plan(model, batch, prof, 1)
    assert least.value.binding_knobs == {"chunked_loss_tokens": FLOOR}
    assert "chunked_loss_tokens" in str(least.value)
    settings = SimpleNamespace(request=PlanRequest(1))
    assert no_plan_fits_message(least.value, settings).endswith(
        "with the loss at its least memory (memory.chunked_loss_tokens = 32) (set "
        "memory.gpu_budget to at least that)"
    )
    request = PlanRequest(1 << 40, sample_batch=batch, loss_fn=planner_loss(CPU, None))
    whole = profile_model(model, request, device="cpu")
    with pytest.raises(NoPlanFits) as refused:
        _plan(model, batch, whole, 1)
    new, old = least.value.smallest_budget_bytes, refused.value.smallest_budget_bytes
    assert new < old
    budget = (new + old) // 2  # the 6 GiB case: a plain loss is refused here
    with pytest.raises(NoPlanFits):
        _plan(model, batch, whole, budget)
    plan = _plan(model, batch, prof, budget)
    assert plan.chunked_loss_tokens in (32, 64) and plan.predicted_peak_bytes <= budget
    text = explain(plan)
    assert f"loss in chunks of {plan.chunked_loss_tokens} tokens" in text
    assert "loss chunk" in candidates_table(plan).splitlines()[0]
    back = Plan.from_json(plan.to_json())
    assert (back.chunked_loss_tokens, back.loss_planned) == (plan.chunked_loss_tokens, True)

    # a real run of that plan with its loss chunk stays within the prediction
    model2, opt, _, handle = apply_plan(_model(), plan, device="cpu",
                                        optim=OptimizerSettings(lr=1e-3))  # fmt: skip
    loss = planner_loss(CPU, plan.chunked_loss_tokens)

    def step():
        loss(model2, batch).backward()
        opt.step()
        opt.zero_grad()

    try:
        peak = measure_steps(model2, step, steps=1, warmup=1, device="cpu").peak_allocated_bytes
    finally:
        handle.remove()
        protrain.close(model2)
    assert peak <= plan.predicted_peak_bytes


def test_the_plans_loss_chunk_is_the_apps_and_exact(traced):
    model, batch, prof = traced
    settings = PlanSettings(CPU, torch.float32, PlanRequest(1 << 40, 1 << 40),
                            chunked_loss_tokens=None, loss_chunk_floor_tokens=FLOOR)  # fmt: skip
    plan = _plan(model, batch, at_loss_chunk(prof, 64), 1 << 40)
    assert loss_chunk_of(plan, settings) == plan.chunked_loss_tokens
    plan.chunked_loss_tokens = 64  # as a tight budget would choose
    assert loss_chunk_of(plan, settings) == 64
    whole = planner_loss(CPU, None)(model, batch)
    assert planner_loss(CPU, 64)(model, batch).item() == pytest.approx(whole.item(), abs=1e-6)
    # fixed by the user: traced and trained at the user's value, nothing searched
    settings.chunked_loss_tokens = 48
    fixed, _ = plan_memory(model, batch, settings)
    assert not fixed.loss_planned and loss_chunk_of(fixed, settings) == 48
