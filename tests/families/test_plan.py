"""The planner on the MoE families of the matrix, LoRA ``all-linear`` (the shape of the
issue's 30B target): the traced profile has one block per decoder layer, its forward and
backward times measured with the router's dispatch and the experts inside them, and the
plan it gives executes."""

from __future__ import annotations

import pytest
from tests.plan.plan_synthetic import hardware

import protrain
from protrain.plan.auto import profile_and_plan
from protrain.planned_wrap import apply_plan
from protrain.profile.trace import hf_loss

from .configs import FAMILIES, batches, n_layers
from .test_engine import base_model

MOE = [name for name, f in FAMILIES.items() if f.kind == "moe"]


@pytest.mark.parametrize("name", MOE)
def test_moe_profile_and_plan(name):
    model = base_model(name, "lora")
    batch = batches(name, 1)[0]
    plan, problem = profile_and_plan(
        model, batch, gpu_budget_bytes=2_000_000, device="cpu", hardware=hardware("cpu")
    )
    blocks = problem.profile.blocks
    assert len(blocks) == n_layers(model)
    assert all(b.fwd_s > 0 and b.saved_bytes > 0 for b in blocks), blocks
    # a block's bwd_s is its backward interval less its forward, timed in another run: on a
    # loaded CPU one tiny block's difference can clip to 0, the blocks' sum cannot
    assert sum(b.bwd_s for b in blocks) > 0, blocks
    model, optimizer, layout, handle = apply_plan(model, plan, device="cpu", lr=1e-3)
    try:
        assert (layout.n_persist, layout.n_chunks) == (plan.n_persist, plan.n_chunks)
        hf_loss(model, batch).backward()
        optimizer.step()
    finally:
        handle.remove()
        protrain.close(model)
