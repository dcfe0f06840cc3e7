"""The predicted step time on a CPU device against real steps through ``protrain.wrap``.

The trace's compute totals come from a step run outside the CPU memory accounting (a
``TorchDispatchMode`` that sees every op and, on a tiny model, costs several times the
compute), so the prediction describes a real step on the CPU too.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import protrain
from protrain.plan import PlanRequest
from protrain.plan.auto import profile_and_plan
from protrain.profile.hardware import measure_hardware
from protrain.profile.trace import hf_loss

sys.path.insert(0, str(Path(__file__).parent.parent / "profile"))
import tiny_llama  # noqa: E402


def measured_step_s(model, batch, plan, *, warmup: int = 2, steps: int = 5) -> float:
    """Seconds of the fastest of real steps (forward, backward, optimizer) with the plan's
    knobs: the statistic the prediction's compute is (the fastest free-running step of the
    trace), so that other work on the machine slows neither side of the comparison alone."""
    model, opt, _ = protrain.wrap(
        model,
        n_persist=plan.n_persist,
        n_buffer=plan.n_buffer if plan.n_persist < plan.n_chunks else None,
        n_swap=plan.n_swap,
        n_checkpoint=plan.n_checkpoint,
        chunk_size_bytes=plan.chunk_size_bytes,
        device="cpu",
        lr=1e-3,
    )
    times = []
    try:
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            hf_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        protrain.close(model)
    return min(times)


# A generous budget (every chunk persistent) and a tight one (tensor bytes: chunks
# offloaded, some blocks checkpointed, the host optimizer in the step).
@pytest.mark.parametrize("budget", ["1GiB", 3_500_000])
def test_predicted_step_time_matches_real_steps_on_cpu(budget):
    batch = tiny_llama.batch()
    # A factor of 2 either way: generous on purpose, CI machines are noisy and the steps
    # are milliseconds long; before the fix the prediction was several times the real step.
    # Up to five traces and measurements while the pair falls outside: a trace slowed by
    # something else on the machine once gave 2.06 (a fresh clone's CI); with other
    # processes busy on the 2 cores (load average 7), the median step against the fastest
    # traced one gave 0.24 once, the fastest steps 0.70 to 1.49 over 12 pairs, and at load
    # 8 three pairs in a row gave 2.9 to 4.3. A wrong model is outside every time.
    for _attempt in range(5):
        model = tiny_llama.build(seed=4)
        request = PlanRequest(budget, sample_batch=batch)
        plan, _ = profile_and_plan(model, request, device="cpu", hardware=measure_hardware("cpu"))
        measured = measured_step_s(model, batch, plan)
        ratio = plan.predicted_step_s / measured
        print(f"budget {budget}: {plan.knobs} predicted {plan.predicted_step_s:.4f} s, "
              f"measured {measured:.4f} s, ratio {ratio:.2f}")  # fmt: skip
        if 0.5 <= ratio <= 2.0:
            break
    assert 0.5 <= ratio <= 2.0, (plan.knobs, plan.predicted_step_s, measured, plan.time_terms)
