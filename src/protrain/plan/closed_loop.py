"""After the first real steps: compare what happened with what the plan predicted, and
correct a plan that is off.

The difference is logged, always. Two corrections, each a new plan that the caller applies
in place (model and optimizer state carried over):

- **Memory.** When the measured peak is above the prediction, the missing bytes are a
  measured term of their own (``measured_beyond_model``): the search runs again with it,
  and if the current knobs no longer fit, the new plan is returned before the budget is
  passed. On CUDA the caller also gives the peak of allocated bytes: the missing bytes are
  then the allocated peak above the prediction less its allocator term, since under a
  budget cap the caching allocator grows its cache up to the budget, and a reserved peak at
  the budget says nothing about what the tensors need (a 16 GiB run measured 16.01 GiB
  reserved for 14.82 allocated, 14.82 predicted, and was corrected for nothing).
- **Time.** When the measured steady-state step is more than :data:`SLOW_STEP` slower than
  predicted, the rates the steps measured replace the hardware profile's, the search runs
  again with them, and the plan changes only when the corrected prediction of another plan
  is at least :data:`SWITCH_MARGIN` faster than the corrected prediction of the current
  one. One line says what was measured, what was corrected and what was chosen.

[Note: steady-state steps]
The steps right after a wrap (or a re-plan) are not the plan's step: the first creates the
optimizer state and touches its host pages for the first time, the caching allocator grows
to its peak and kernels are chosen; the app once compared such a step, 0.974 s measured for
0.172 s predicted. The caller skips the warm-up steps and gives the median of the steps
after them (an outlier, a checkpoint save or a page-cache flush, does not move a median);
the engine's counters are read over the same steps. A check without a steady step (a run
shorter than the warm-up) is logged and changes no plan on time.

[Note: which rates a step measures]
The host AdamW rate: the engine counts the seconds the host optimizer spends in AdamW
(``HybridAdamW.stats["host_adam_s"]``) on this plan's offloaded trainable parameters (this
rank's shard of them), which is the rate under the concurrency the step really has (copies
both ways, the gathers, the rank's neighbours on the host). The clip pass is not corrected:
the engine skips it when the clip coefficient is 1, so its seconds measure the run's
gradient norms, not a rate. The copy rates stay the hardware profile's: the engine counts no
copy seconds. The seconds the forward waited for the host optimizer are logged next to the
model's exposed host-optimizer term.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from protrain.plan.plan import Plan
from protrain.plan.search import NoPlanFits, PlanProblem, search

log = logging.getLogger(__name__)
_GIB = 1 << 30

# A step this much slower than predicted is outside the step model's target (10% median
# error, 20% at worst): the rates behind the prediction are wrong for this host.
SLOW_STEP = 0.20
# Another plan is chosen only when predicted this much faster with the corrected rates: a
# smaller gain is within the step model's median error (10%), and a switch costs a close and
# a wrap.
SWITCH_MARGIN = 0.10


@dataclass
class PlanCheck:
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_step_s: float
    measured_step_s: float
    corrected: Plan | None  # None: the plan stands
    reason: str | None = None  # what the correction was for: "memory" or "step"
    # the current plan's step predicted with the rates the steps measured (None: not slow)
    corrected_step_s: float | None = None
    # hardware profile field -> (profile's rate, measured rate)
    corrected_rates: dict[str, tuple[float, float]] = field(default_factory=dict)

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
    measured_host_adam_s: float | None = None,
    measured_wait_host_optimizer_s: float | None = None,
    steady: bool = True,
) -> PlanCheck:
    """Compare; return the check, with a corrected plan when the current one would not fit
    or is much slower than predicted and another is clearly faster.

    ``measured_peak_bytes`` is the peak the budget limits (reserved bytes on CUDA).
    ``measured_step_s``: the steady-state step ([Note: steady-state steps]; ``steady=False``
    for a warm-up step, which changes no plan on time). ``measured_host_adam_s`` and
    ``measured_wait_host_optimizer_s``: seconds per step of the host AdamW and of the waits
    for it, over the same steps (None: not measured).
    Raises :class:`NoPlanFits` when, with the measured bytes counted, no plan fits.
    """
    check = PlanCheck(
        plan.predicted_peak_bytes, int(measured_peak_bytes), plan.predicted_step_s,
        float(measured_step_s), None,
    )  # fmt: skip
    log.info(
        "protrain plan check: peak predicted %.2f GiB, measured %.2f GiB (%+.1f%%); step "
        "predicted %.3f s, measured %.3f s (%+.1f%%)%s",
        check.predicted_peak_bytes / _GIB,
        check.measured_peak_bytes / _GIB,
        100 * check.peak_error,
        check.predicted_step_s,
        check.measured_step_s,
        100 * check.step_error,
        "" if steady else " (a warm-up step: no steady-state step was run)",
    )
    hardware, check.corrected_rates = _measured_hardware(plan, problem, measured_host_adam_s)
    if _correct_memory(check, plan, problem, hardware, measured_allocated_bytes):
        return check
    slow = check.measured_step_s > (1 + SLOW_STEP) * check.predicted_step_s
    if steady and slow:
        _correct_time(
            check, plan, problem, hardware, measured_host_adam_s, measured_wait_host_optimizer_s
        )
    return check


def _like(problem: PlanProblem, **changes) -> PlanProblem:
    """``problem`` with other hardware or more measured bytes."""
    args = dict(
        gpu_budget_bytes=problem.gpu_budget_bytes,
        cpu_budget_bytes=problem.cpu_budget_bytes,
        fixed_knobs=problem.fixed,
        extra_bytes=problem.extra_bytes,
        clipping=problem.clipping,
        world=problem.world,
    )
    hardware = changes.pop("hardware", problem.hardware)
    return PlanProblem(problem.profile, hardware, **{**args, **changes})


def _measured_hardware(plan: Plan, problem: PlanProblem, host_adam_s: float | None):
    """The hardware profile with the rates the steps measured ([Note: which rates a step
    measures]), and ``{field: (profile's rate, measured rate)}`` of those replaced."""
    runtime = problem.runtime
    params = (runtime.trainable[runtime.n_chunks] - runtime.trainable[plan.n_persist]) / (
        problem.world.shards
    )
    if host_adam_s is None or host_adam_s <= 0 or params <= 0:
        return problem.hardware, {}
    rate = float(params / host_adam_s)
    hardware = dataclasses.replace(problem.hardware, cpu_adam_busy_params_per_s=rate)
    return hardware, {"cpu_adam_busy_params_per_s": (float(runtime.host_adam_rate), rate)}


def _correct_memory(check, plan, problem, hardware, allocated_bytes) -> bool:
    """A new plan on ``check`` when the measured peak says the current one would not fit."""
    if allocated_bytes is None:
        missing = check.measured_peak_bytes - check.predicted_peak_bytes
    else:
        overhead = plan.memory_terms.get("allocator_overhead", 0)
        missing = int(allocated_bytes) - (check.predicted_peak_bytes - overhead)
    if missing <= 0:
        return False
    corrected_problem = _like(problem, hardware=hardware, extra_bytes=problem.extra_bytes + missing)
    fits = corrected_problem.evaluate(*plan.knobs.values())["peak_bytes"]
    if fits <= problem.gpu_budget_bytes:
        return False
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
    check.corrected, check.reason = new, "memory"
    return True


def _correct_time(check, plan, problem, hardware, host_adam_s, wait_s) -> None:
    """The search again with the measured rates; a new plan on ``check`` when it is
    clearly faster than the current one with the same rates."""
    terms = plan.time_terms
    measured = (
        f"step measured {check.measured_step_s:.3f} s, predicted {check.predicted_step_s:.3f} s"
        f" ({100 * check.step_error:+.1f}%)"
    )
    if host_adam_s is not None:
        measured += (
            f"; host AdamW {host_adam_s:.3f} s a step (predicted "
            f"{terms.get('host_optimizer', 0.0):.3f} s)"
        )
    if wait_s is not None:
        measured += (
            f", waited for {wait_s:.3f} s (predicted "
            f"{terms.get('host_optimizer_exposed', 0.0):.3f} s)"
        )
    if not check.corrected_rates:
        log.warning(
            "protrain plan check: %s; no rate measured to correct (no offloaded trainable "
            "parameters), the plan stands",
            measured,
        )
        return
    corrected = "; ".join(
        f"{name} {old:.3g} -> {new:.3g}" for name, (old, new) in check.corrected_rates.items()
    )
    corrected_problem = _like(problem, hardware=hardware)
    current_s = corrected_problem.evaluate(*plan.knobs.values())["step_s"]
    check.corrected_step_s = current_s
    best = search(corrected_problem).plan  # the current knobs fit: so does some plan
    faster = best.knobs != plan.knobs and best.predicted_step_s <= (1 - SWITCH_MARGIN) * current_s
    if faster:
        chosen = f"re-planned to {best.knobs}, predicted {best.predicted_step_s:.3f} s"
    else:
        chosen = (
            f"the plan stands (best {best.knobs} predicted {best.predicted_step_s:.3f} s, "
            f"less than {SWITCH_MARGIN:.0%} faster)"
        )
    log.warning(
        "protrain plan check: %s; corrected %s; the current plan predicted with them %.3f s; %s",
        measured,
        corrected,
        current_s,
        chosen,
    )
    if faster:
        best.reasons.insert(
            0,
            f"corrected after the first steps: the steady step was {check.measured_step_s:.3f}"
            f" s for {check.predicted_step_s:.3f} s predicted; with the measured rates "
            f"({corrected}) this plan is predicted {best.predicted_step_s:.3f} s against "
            f"{current_s:.3f} s for the previous one",
        )
        check.corrected, check.reason = best, "step"
