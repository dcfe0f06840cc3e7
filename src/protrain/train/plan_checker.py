"""The closed loop of a planned run (`memory: {auto: true}`): the first optimizer steps are
timed and their peak taken, and the plan is checked once against them
(``protrain.plan.check_plan``). `AutoTrainable` holds a :class:`PlanChecker`, tells it
where each micro-batch and step begins and ends, and re-plans where the check asks.

[Note: what is measured]
The planner predicts one micro-batch's forward and backward plus the optimizer step, the
waits for the previous step's host updates included. The measured step is the whole
optimizer step, from its first forward to the end of `optimizer_step`, less the
micro-batches before the last, each counted as long as the last one's forward and backward
(they wait for no host update; the first micro-batch's forward is where the waits land).
The step compared is the median of the steady steps: the `WARMUP_STEPS` after the plan was
applied are left out ([Note: steady-state steps] in `plan/closed_loop.py`), and the
engine's host-optimizer counters are read over the same steps (the host work of the last
warm-up step finished before, of the last step counted after), and so are its copy
counters (bytes and seconds of the host-device copies each way, the link's busy time, the
compute stream's waits for gathers; ``chunks/copy_times.py``), per micro-batch, as the
model predicts one. The peak is the allocator's reserved peak on CUDA; on the CPU, the
engine's device-side tensor bytes (what the planner's CPU accounting counts) over the first
two optimizer steps (the first creates the optimizer state, the second runs with it),
counted from the freshly applied plan as `protrain.profile.measure` does.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from protrain import plan as planner
from protrain.distributed import resolve_context
from protrain.distributed.agree import max_over_ranks, on_main
from protrain.engine import Engine
from protrain.plan import Plan, PlanCheck, PlanProblem
from protrain.plan.closed_loop import MeasuredCopies
from protrain.profile.measure import engine_static_device_bytes
from protrain.profile.memory_clock import TensorBytesCounter

# the engine's copy counters the plan check reads, in MeasuredCopies' order
COPY_COUNTERS = ("h2d_bytes", "h2d_s", "d2h_bytes", "d2h_s", "copy_busy_s", "wait_copy_s")


class PlanChecker:
    """Times the optimizer steps of a planned run until the plan is checked, once."""

    # The first step creates the optimizer state and touches its host pages, the allocator
    # grows to its peak; the second is the first with the state in place but still pays the
    # CPU peak counter (PEAK_STEPS) and the allocator's last growth. From the third on the
    # steps repeat.
    WARMUP_STEPS = 2
    STEADY_STEPS = 3  # a median of three: one outlier does not move it
    CHECK_AFTER_STEPS = WARMUP_STEPS + STEADY_STEPS
    PEAK_STEPS = 2  # CPU: counted steps (the second is the first with optimizer state)

    def __init__(self, device: torch.device, micro_batches: int):
        self.device = device
        self.micro_batches = micro_batches  # a step's (gradient_accumulation_steps)
        self.checked = False
        self.steps_run = 0  # timed optimizer steps so far
        self.micro = 0  # micro-batches of the current optimizer step so far
        self._peak_counter: tuple[TensorBytesCounter, list[int]] | None = None  # CPU only
        self._measured_peak_bytes = 0
        # this optimizer step's times: first forward begun, last forward begun, last
        # backward ended ([Note: what is measured])
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._t_last_backward: float | None = None
        self.step_times: list[float] = []  # the steady steps' ([Note: what is measured])
        self._last_step_s = 0.0
        self._stats_after_warmup: dict | None = None  # the engine's counters then

    def clock(self) -> float:
        """Now, in seconds, after the device's queued work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def micro_batch_begun(self, engine: Engine) -> None:
        """A training micro-batch's forward begins."""
        if self.checked:
            return
        self.micro += 1
        if self.steps_run == 0 and self.micro == 1 and self.device.type != "cuda":
            self._start_peak_counter(engine)
        if self.micro == 1:
            self._t_first = self.clock()
        if self.micro == self.micro_batches:
            self._t_last = self._t_first if self.micro == 1 else self.clock()

    def backward_ended(self, last: bool) -> None:
        """A micro-batch's backward returned; ``last``: the step's last."""
        if last and self._t_last is not None:
            self._t_last_backward = self.clock()

    def step_ended(self, engine: Engine) -> None:
        """The optimizer step (and its zero_grad) returned."""
        if self._t_last_backward is None:
            return
        # the whole optimizer step less the micro-batches before the last, each taken to
        # last as long as the last one (which waits for no host update); never below an
        # even share of the whole (micro-batches of uneven length)
        micro_s = self._t_last_backward - self._t_last
        whole_s = self.clock() - self._t_first
        step_s = max(whole_s - (self.micro - 1) * micro_s, whole_s / self.micro)
        self.step_skipped()
        self.steps_run += 1
        # Timed: steps after the warm-up that ran without the CPU counter's overhead.
        if self.steps_run > self.WARMUP_STEPS and self._peak_counter is None:
            self.step_times.append(step_s)
        self._last_step_s = step_s
        if self.steps_run == self.PEAK_STEPS:
            self.stop_peak_counter()
        if self.steps_run == self.WARMUP_STEPS:  # the host work of the warm-up is done
            self._stats_after_warmup = settled_stats(engine)

    def step_skipped(self) -> None:
        """The step ended without an update (or was timed): the next one starts afresh."""
        self._t_first = self._t_last = self._t_last_backward = None
        self.micro = 0

    def due(self, step: int, total_steps: int) -> bool:
        """Whether the check runs after optimizer step ``step`` of ``total_steps``."""
        if self.checked or self.steps_run == 0:
            return False
        return self.steps_run >= self.CHECK_AFTER_STEPS or step >= total_steps

    def check(self, engine: Engine, plan: Plan, problem: PlanProblem) -> tuple[dict, PlanCheck]:
        """Check ``plan`` against the measured steps (over every rank: collectives); the
        metrics record and the check (``check.corrected``: the plan to run instead, if any).
        Raises ``NoPlanFits`` where nothing fits the measured peak."""
        self.checked = True
        self.stop_peak_counter()
        steady = bool(self.step_times)
        record, measured = self._measured(engine, plan, steady)
        peak, allocated, step_s, host_adam_s, wait_s, copies = measured
        cuda = self.device.type == "cuda"

        def check_here() -> PlanCheck:
            return planner.check_plan(plan, problem, measured_peak_bytes=peak,
                                      measured_step_s=step_s,
                                      measured_allocated_bytes=allocated if cuda else None,
                                      measured_host_adam_s=host_adam_s,
                                      measured_wait_host_optimizer_s=wait_s,
                                      measured_copies=copies, steady=steady)  # fmt: skip

        check = on_main(resolve_context(), check_here)  # the first rank holds the problem
        if check.corrected_step_s is not None:
            record["plan_corrected_step_s"] = check.corrected_step_s
            for name, (_, rate) in check.corrected_rates.items():
                record[f"plan_corrected_{name}"] = rate
            if check.measured_compute_s is not None:
                record["plan_measured_compute_s"] = check.measured_compute_s
            if check.compute_scale is not None:
                record["plan_compute_scale"] = check.compute_scale
        return record, check

    def _measured(self, engine: Engine, plan: Plan, steady: bool) -> tuple[dict[str, Any], tuple]:
        """The metrics record of the measurements, and (peak, allocated, step, host Adam,
        wait for it, copies), each the largest over the ranks (None: not measured)."""
        step_s = statistics.median(self.step_times) if steady else self._last_step_s
        host_adam_s = wait_s = -1.0  # not measured
        copies = [-1.0] * len(COPY_COUNTERS)
        if self._stats_after_warmup is not None and self.steps_run > self.WARMUP_STEPS:
            # the last step's host work and copies are counted too
            before, now = self._stats_after_warmup, settled_stats(engine)
            n = self.steps_run - self.WARMUP_STEPS

            def per_step(key: str) -> float:
                return (now.get(key, 0.0) - before.get(key, 0.0)) / n

            host_adam_s = per_step("host_adam_s")
            wait_s = per_step("wait_cpu_optimizer_s")
            copies = [per_step(key) / self.micro_batches for key in COPY_COUNTERS]
        cuda = self.device.type == "cuda"
        peak = torch.cuda.max_memory_reserved(self.device) if cuda else self._measured_peak_bytes
        allocated = torch.cuda.max_memory_allocated(self.device) if cuda else -1
        # every rank runs the plan: the largest of each is what must fit, the slowest rank's
        # step and host optimizer what the plan is judged by
        values = [peak, allocated, step_s, host_adam_s, wait_s, *copies]
        measured = max_over_ranks(resolve_context(), values, self.device)
        peak, allocated, step_s = int(measured[0]), int(measured[1]), measured[2]
        host_adam_s, wait_s = (v if v >= 0 else None for v in measured[3:5])
        copies = measured[5:]
        measured_copies = MeasuredCopies(*copies) if min(copies) >= 0 else None
        record = {
            "plan_predicted_peak_gib": plan.predicted_peak_bytes / 2**30,
            "plan_measured_peak_gib": peak / 2**30,
            "plan_predicted_step_s": plan.predicted_step_s,
            "plan_measured_step_s": step_s,
            "plan_warmup_steps": self.WARMUP_STEPS,
            "plan_steady_steps": len(self.step_times),
        }
        if host_adam_s is not None:
            record["plan_measured_host_adam_s"] = host_adam_s
        if wait_s is not None:
            record["plan_measured_wait_host_optimizer_s"] = wait_s
        if measured_copies is not None:
            for key, value in zip(COPY_COUNTERS, copies):
                record[f"plan_measured_{key}"] = value
        return record, (peak, allocated, step_s, host_adam_s, wait_s, measured_copies)

    def _start_peak_counter(self, engine: Engine) -> None:
        manager = engine.manager
        static = engine_static_device_bytes(engine.model)
        chunk = manager.layout.chunk_size_bytes
        peak = [0]

        def sample(counter: TensorBytesCounter) -> None:
            peak[0] = max(peak[0], static + counter.live_bytes + len(manager.resident) * chunk)

        self._peak_counter = (TensorBytesCounter(on_op=sample), peak)
        self._peak_counter[0].__enter__()

    def stop_peak_counter(self) -> None:
        """End the CPU peak counter where it runs (the run closes, or the check begins)."""
        if self._peak_counter is not None:
            counter, peak = self._peak_counter
            self._peak_counter = None
            counter.__exit__(None, None, None)
            self._measured_peak_bytes = peak[0]


def settled_stats(engine: Engine) -> dict:
    """The engine's counters with every host task and copy so far counted in (a
    synchronization: between steps only)."""
    engine.optimizer.synchronize()
    engine.manager.settle_counters()
    return dict(engine.optimizer.stats)
