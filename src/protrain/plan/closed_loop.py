"""After the first real steps: compare what happened with what the plan predicted.

The difference is logged, always. When the measured peak is above the prediction, the
missing bytes are a measured term of their own (``measured_beyond_model``): the search runs
again with it, and if the current knobs no longer fit, the new plan is returned so the
caller can re-wrap before the budget is passed. On CUDA the caller also gives the peak of
allocated bytes: the missing bytes are then the allocated peak above the prediction less
its allocator term, since under a budget cap the caching allocator grows its cache up to
the budget, and a reserved peak at the budget says nothing about what the tensors need
(a 16 GiB run measured 16.01 GiB reserved for 14.82 allocated, 14.82 predicted, and was
corrected for nothing). The step-time error is reported, not
corrected: a slower step never runs out of memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from protrain.plan.plan import Plan
from protrain.plan.search import NoPlanFits, PlanProblem, search

log = logging.getLogger(__name__)
_GIB = 1 << 30


@dataclass
class PlanCheck:
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_step_s: float
    measured_step_s: float
    corrected: Plan | None  # None: the plan stands

    @property
    def peak_error(self) -> float:
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def step_error(self) -> float:
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s


def check_plan(
    plan: Plan,
    problem: PlanProblem,
    *,
    measured_peak_bytes: int,
    measured_step_s: float,
    measured_allocated_bytes: int | None = None,
) -> PlanCheck:
    """Compare; return the check, with a corrected plan when the current one would not fit.

    ``measured_peak_bytes`` is the peak the budget limits (reserved bytes on CUDA).
    Raises :class:`NoPlanFits` when, with the measured bytes counted, no plan fits.
    """
    check = PlanCheck(
        plan.predicted_peak_bytes, int(measured_peak_bytes), plan.predicted_step_s,
        float(measured_step_s), None,
    )  # fmt: skip
    log.info(
        "protrain plan check: peak predicted %.2f GiB, measured %.2f GiB (%+.1f%%); step "
        "predicted %.3f s, measured %.3f s (%+.1f%%)",
        check.predicted_peak_bytes / _GIB,
        check.measured_peak_bytes / _GIB,
        100 * check.peak_error,
        check.predicted_step_s,
        check.measured_step_s,
        100 * check.step_error,
    )
    if measured_allocated_bytes is None:
        missing = check.measured_peak_bytes - check.predicted_peak_bytes
    else:
        overhead = plan.memory_terms.get("allocator_overhead", 0)
        missing = int(measured_allocated_bytes) - (check.predicted_peak_bytes - overhead)
    if missing <= 0:
        return check
    corrected_problem = PlanProblem(
        problem.profile,
        problem.hardware,
        gpu_budget_bytes=problem.gpu_budget_bytes,
        cpu_budget_bytes=problem.cpu_budget_bytes,
        fixed_knobs=problem.fixed,
        extra_bytes=problem.extra_bytes + missing,
        clipping=problem.clipping,
        world=problem.world,
    )
    fits = corrected_problem.evaluate(*plan.knobs.values())["peak_bytes"]
    if fits <= problem.gpu_budget_bytes:
        return check
    try:
        new = search(corrected_problem).plan
    except NoPlanFits:
        log.error("protrain plan check: with the measured peak counted, no plan fits")
        raise
    new.reasons.insert(
        0,
        f"corrected after the first steps: the measured peak was {missing / _GIB:.2f} GiB "
        "above the prediction, counted as measured_beyond_model",
    )
    log.warning("protrain plan check: the plan would pass the budget; corrected to %s", new.knobs)
    check.corrected = new
    return check
