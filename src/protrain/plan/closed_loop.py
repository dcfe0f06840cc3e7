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
Each is the rate under the concurrency the step really has (copies both ways, the gathers,
the host optimizer, the rank's neighbours on the host), read from the engine's counters
over the steady steps:

- The host AdamW rate: the seconds the host optimizer spends in AdamW
  (``stats["host_adam_s"]``) on this plan's offloaded trainable parameters (this rank's
  shard of them). The clip pass is not corrected: the engine skips it when the clip
  coefficient is 1, so its seconds measure the run's gradient norms, not a rate.
- The copy rates (:class:`MeasuredCopies`, from ``chunks/copy_times.py``): host-to-device
  and device-to-host, bytes over the seconds their copies took on their stream; both
  directions together, the bytes of both over the seconds either was copying (the link's
  busy time), so that the model's copy term of the current plan is at least the measured
  busy time, whether the two directions overlapped or took turns. A direction that moved
  nothing keeps the profile's rate, and so does the duplex rate unless both moved bytes.
  The swapped activations' copies (``activations/transfer.py``) are not counted.
- Compute: the step less the compute stream's waits (for gathers, for the host optimizer)
  and the predicted device AdamW, against the model's compute term; every traced compute
  time is scaled by their ratio (one ratio: the counters do not say which block was
  slower). Only where the copy waits were measured; a step the waits and the device AdamW
  leave nothing of is not corrected. On CUDA the host-optimizer wait is the host thread's,
  an upper bound of the compute stream's.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from protrain.plan.plan import Plan
from protrain.plan.search import NoPlanFits, PlanProblem, search
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import ModelProfile
from protrain.units import GIB

log = logging.getLogger(__name__)

# A step this much slower than predicted is outside the step model's target (10% median
# error, 20% at worst): the rates behind the prediction are wrong for this host.
SLOW_STEP = 0.20
# Another plan is chosen only when predicted this much faster with the corrected rates: a
# smaller gain is within the step model's median error (10%), and a switch costs a close and
# a wrap.
SWITCH_MARGIN = 0.10


@dataclass(frozen=True)
class MeasuredCopies:
    """One step's copies, from the engine's counters (``ChunkManager.stats``, see
    ``chunks/copy_times.py``), averaged over the steady steps; with several micro-batches a
    step, per micro-batch (the model predicts one)."""

    h2d_bytes: float
    h2d_s: float
    d2h_bytes: float
    d2h_s: float
    busy_s: float  # either direction copying
    wait_s: float  # the compute stream waiting for gathers


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
    # the step less its waits and the device AdamW (None: the copy waits were not measured)
    measured_compute_s: float | None = None
    # measured over predicted compute, applied to the traced times (None: not corrected)
    compute_scale: float | None = None

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
    measured_copies: MeasuredCopies | None = None,
    steady: bool = True,
) -> PlanCheck:
    """Compare; return the check, with a corrected plan when the current one would not fit
    or is much slower than predicted and another is clearly faster.

    ``measured_peak_bytes`` is the peak the budget limits (reserved bytes on CUDA).
    ``measured_step_s``: the steady-state step ([Note: steady-state steps]; ``steady=False``
    for a warm-up step, which changes no plan on time). ``measured_host_adam_s`` and
    ``measured_wait_host_optimizer_s``: seconds per step of the host AdamW and of the waits
    for it, over the same steps (None: not measured); ``measured_copies``: the engine's copy
    counters over them (None: not measured).
    Raises :class:`NoPlanFits` when, with the measured bytes counted, no plan fits.
    """
    check = PlanCheck(
        plan.predicted_peak_bytes, int(measured_peak_bytes), plan.predicted_step_s,
        float(measured_step_s), None,
    )  # fmt: skip
    log.info(
        "protrain plan check: peak predicted %.2f GiB, measured %.2f GiB (%+.1f%%); step "
        "predicted %.3f s, measured %.3f s (%+.1f%%)%s",
        check.predicted_peak_bytes / GIB,
        check.measured_peak_bytes / GIB,
        100 * check.peak_error,
        check.predicted_step_s,
        check.measured_step_s,
        100 * check.step_error,
        "" if steady else " (a warm-up step: no steady-state step was run)",
    )
    hardware, check.corrected_rates = _measured_hardware(
        plan, problem, measured_host_adam_s, measured_copies
    )
    if _correct_memory(check, plan, problem, hardware, measured_allocated_bytes):
        return check
    slow = check.measured_step_s > (1 + SLOW_STEP) * check.predicted_step_s
    if steady and slow:
        profile = _measured_compute(check, plan, problem, measured_copies,
                                    measured_wait_host_optimizer_s)  # fmt: skip
        _correct_time(check, plan, _like(problem, profile=profile), hardware,
                      measured_host_adam_s, measured_wait_host_optimizer_s,
                      measured_copies)  # fmt: skip
    return check


def _like(
    problem: PlanProblem,
    *,
    profile: ModelProfile | None = None,
    hardware: HardwareProfile | None = None,
    extra_bytes: int | None = None,
) -> PlanProblem:
    """``problem`` with another profile or hardware, or more measured bytes."""
    profile = problem.profile if profile is None else profile
    hardware = problem.hardware if hardware is None else hardware
    extra_bytes = problem.extra_bytes if extra_bytes is None else extra_bytes
    like = problem
    if profile is not problem.profile or hardware is not problem.hardware:
        like = PlanProblem(
            profile,
            hardware,
            gpu_budget_bytes=problem.gpu_budget_bytes,
            cpu_budget_bytes=problem.cpu_budget_bytes,
            fixed_knobs=problem.fixed,
            clipping=problem.clipping,
            world=problem.world,
            device_step_search=problem.device_step_search,
            optimizer=problem.optimizer,
            optimizer_state=problem.optimizer_state,
        )
    return like if extra_bytes == like.extra_bytes else like.with_extra_bytes(extra_bytes)


def _measured_hardware(
    plan: Plan, problem: PlanProblem, host_adam_s: float | None, copies: MeasuredCopies | None
):
    """The hardware profile with the rates the steps measured ([Note: which rates a step
    measures]), and ``{field: (profile's rate, measured rate)}`` of those replaced."""
    runtime, hw = problem.runtime, problem.hardware
    rates: dict[str, tuple[float, float]] = {}
    # the host steps the offloaded chunks but the device-stepped ones (optim/device_step.py)
    on_device = runtime.device_step_chunks(plan.n_persist, plan.n_device_step)
    host = runtime.trainable[runtime.n_chunks] - runtime.trainable[plan.n_persist]
    params = (host - runtime.trainable_numel(on_device)) / problem.world.shards
    if host_adam_s is not None and host_adam_s > 0 and params > 0:
        # the rate the steps ran at, beside whatever copies they ran: both of the model's
        # rates ([Note: the host AdamW's rate] in plan/runtime.py)
        measured = float(params / host_adam_s)
        rates["cpu_adam_busy_params_per_s"] = (float(runtime.host_adam_rate), measured)
        rates["cpu_adam_params_per_s"] = (float(hw.cpu_adam_params_per_s), measured)
    if copies is not None:
        for name, nbytes, seconds in (
            ("h2d_bytes_per_s", copies.h2d_bytes, copies.h2d_s),
            ("d2h_bytes_per_s", copies.d2h_bytes, copies.d2h_s),
        ):
            if nbytes > 0 and seconds > 0:
                rates[name] = (float(getattr(hw, name)), float(nbytes / seconds))
        if copies.h2d_bytes > 0 and copies.d2h_bytes > 0 and copies.busy_s > 0:
            both = (copies.h2d_bytes + copies.d2h_bytes) / copies.busy_s
            rates["duplex_bytes_per_s"] = (float(hw.duplex_bytes_per_s), float(both))
    if not rates:
        return hw, {}
    return dataclasses.replace(hw, **{k: new for k, (_, new) in rates.items()}), rates


def _measured_compute(check, plan, problem, copies, wait_host_s):
    """The profile with every traced compute time scaled to the compute the steps measured
    ([Note: which rates a step measures]); ``problem.profile`` where none was measured."""
    if copies is None:
        return problem.profile
    terms = plan.time_terms
    compute = (
        check.measured_step_s - copies.wait_s - (wait_host_s or 0.0)
        - terms.get("device_optimizer", 0.0)
    )  # fmt: skip
    check.measured_compute_s = compute
    predicted = terms.get("compute", 0.0)
    if compute <= 0 or predicted <= 0:
        return problem.profile
    check.compute_scale = compute / predicted
    return scaled_compute(problem.profile, check.compute_scale)


def scaled_compute(profile: ModelProfile, scale: float) -> ModelProfile:
    """``profile`` with the times the runtime model reads as compute multiplied by
    ``scale`` (memory figures unchanged)."""

    def times(obj, names):
        return {n: getattr(obj, n) * scale for n in names if getattr(obj, n) is not None}

    blocks = [
        dataclasses.replace(b, **times(b, ("fwd_s", "bwd_s", "recompute_s")))
        for b in profile.blocks
    ]
    names = ("pre_fwd_s", "head_s", "post_bwd_s", "step_s", "optimizer_step_s",
             "free_pre_fwd_s", "free_blocks_fwd_s", "free_fwd_bwd_s",
             "free_loss_forward_s", "free_keep_fwd_bwd_s")  # fmt: skip
    return dataclasses.replace(profile, blocks=blocks, **times(profile, names))


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
    fits = corrected_problem.evaluate(*plan.knobs.values(), n_device_step=plan.n_device_step)[
        "peak_bytes"
    ]
    if fits <= problem.gpu_budget_bytes:
        return False
    try:
        new = search(corrected_problem).plan
    except NoPlanFits:
        log.error("protrain plan check: with the measured peak counted, no plan fits")
        raise
    new.reasons.insert(
        0,
        f"corrected after the first steps: the measured peak was {missing / GIB:.2f} GiB "
        "above the prediction, counted as measured_beyond_model",
    )
    log.warning("protrain plan check: the plan would pass the budget; corrected to %s", new.knobs)
    check.corrected, check.reason = new, "memory"
    return True


def _correct_time(check, plan, problem, hardware, host_adam_s, wait_s, copies) -> None:
    """The search again with the measured rates (and compute, already in ``problem``'s
    profile); a new plan on ``check`` when it is clearly faster than the current one with
    the same rates."""
    measured = _measured_line(check, plan, host_adam_s, wait_s, copies)
    if not check.corrected_rates and check.compute_scale is None:
        log.warning(
            "protrain plan check: %s; nothing measured to correct (no offloaded trainable "
            "parameters, no copy counters), the plan stands",
            measured,
        )
        return
    corrected = [f"{name} {old:.3g} -> {new:.3g}"
                 for name, (old, new) in check.corrected_rates.items()]  # fmt: skip
    if check.compute_scale is not None:
        corrected.append(f"compute x{check.compute_scale:.3g}")
    corrected = ", ".join(corrected)
    corrected_problem = _like(problem, hardware=hardware)
    current_s = corrected_problem.evaluate(*plan.knobs.values(), n_device_step=plan.n_device_step)[
        "step_s"
    ]
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


def _measured_line(check, plan, host_adam_s, wait_s, copies) -> str:
    """Each part of the step measured against its prediction, for the log."""
    terms = plan.time_terms
    parts = [
        f"step measured {check.measured_step_s:.3f} s, predicted {check.predicted_step_s:.3f} s"
        f" ({100 * check.step_error:+.1f}%)"
    ]
    if check.measured_compute_s is not None:
        parts.append(
            f"compute {check.measured_compute_s:.3f} s (predicted "
            f"{terms.get('compute', 0.0):.3f} s)"
        )
    if copies is not None:
        gb = 1e9
        rates = check.corrected_rates

        def direction(name: str, nbytes: float, seconds: float, field: str) -> str:
            text = f"{name} {nbytes / gb:.3g} GB (predicted {terms.get(f'{name}_bytes', 0.0) / gb:.3g})"
            if field in rates:
                old, new = rates[field]
                text += f" at {new / gb:.3g} GB/s (profile {old / gb:.3g})"
            return text + f" in {seconds:.3f} s"

        parts.append(
            "copies: "
            + direction("h2d", copies.h2d_bytes, copies.h2d_s, "h2d_bytes_per_s")
            + ", "
            + direction("d2h", copies.d2h_bytes, copies.d2h_s, "d2h_bytes_per_s")
            + f", link busy {copies.busy_s:.3f} s (predicted {terms.get('copy', 0.0):.3f} s)"
            + f", compute waited {copies.wait_s:.3f} s for gathers (predicted "
            + f"{terms.get('copy_exposed', 0.0):.3f} s)"
        )
    if host_adam_s is not None:
        parts.append(
            f"host AdamW {host_adam_s:.3f} s a step (predicted "
            f"{terms.get('host_optimizer', 0.0):.3f} s)"
        )
    if wait_s is not None:
        waited = (
            f"waited for {wait_s:.3f} s (predicted "
            f"{terms.get('host_optimizer_exposed', 0.0):.3f} s)"
        )
        if host_adam_s is not None:
            parts[-1] += ", " + waited
        else:
            parts.append("host optimizer " + waited)
    return "; ".join(parts)
