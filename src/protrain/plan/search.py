"""The fastest plan whose predicted peak fits the budget.

[Note: why the search is exact and fast]
Memory is a sum: ``model_states(n_persist) + n_buffer * chunk + activations(n_swap,
n_checkpoint) + ...``, and step time never gets worse with more persistent chunks' worth
of traffic removed or more buffers (it is non-increasing in ``n_buffer``) and never gets
better with more compute or more swap bytes. So:

1. every allowed ``(n_swap, n_checkpoint)`` pair is evaluated at once (numpy over a pairs x
   blocks matrix) for its activation peak, compute seconds and swap bytes;
2. pairs dominated on all three (another pair no larger in each) are dropped: they can never
   be the fastest that fits;
3. for each remaining pair and every allowed ``n_persist`` (one numpy vector), ``n_buffer`` is
   the largest that fits (time is non-increasing in it, memory increasing), and the time of
   that plan is computed.

The work is ``pairs`` (one matrix pass) plus ``frontier pairs x n_persist values`` (vector
evaluations), reported in :attr:`SearchResult.work`. Knobs the user fixed are single values
in these ranges; nothing else is defaulted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from protrain.plan.memory import MemoryModel, policy_matrix
from protrain.plan.plan import KNOBS, Plan
from protrain.plan.runtime import RuntimeModel
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import ModelProfile

log = logging.getLogger(__name__)
_GIB = 1 << 30


class NoPlanFits(ValueError):
    """No plan fits the budget; ``smallest_budget_bytes`` is the least that would."""

    def __init__(self, message: str, smallest_budget_bytes: int | None):
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes


@dataclass
class SearchResult:
    plan: Plan
    work: dict[str, int] = field(default_factory=dict)


class PlanProblem:
    """A profile, the hardware, the budgets and the user's fixed knobs."""

    def __init__(
        self,
        profile: ModelProfile,
        hardware: HardwareProfile,
        *,
        gpu_budget_bytes: int,
        cpu_budget_bytes: int | None = None,
        fixed_knobs: dict[str, int] | None = None,
        extra_bytes: int = 0,
    ):
        fixed = {k: v for k, v in (fixed_knobs or {}).items() if v is not None}
        unknown = sorted(set(fixed) - set(KNOBS))
        if unknown:
            raise ValueError(f"fixed_knobs {unknown} are not knobs; the knobs are {KNOBS}")
        self.profile = profile
        self.hardware = hardware
        self.gpu_budget_bytes = int(gpu_budget_bytes)
        self.cpu_budget_bytes = cpu_budget_bytes
        self.fixed = fixed
        # Bytes the closed loop measured beyond the prediction (0 before any real step).
        self.extra_bytes = int(extra_bytes)
        self.memory = MemoryModel(profile)
        self.runtime = RuntimeModel(profile, hardware)
        self._check_fixed()

    def _check_fixed(self) -> None:
        n, b = self.memory.n_chunks, self.memory.n_blocks
        f = self.fixed
        if "n_persist" in f and not 0 <= f["n_persist"] <= n:
            raise ValueError(f"n_persist={f['n_persist']} is not in 0..{n} (this model's chunks)")
        for k in ("n_swap", "n_checkpoint"):
            if k in f and not 0 <= f[k] <= b:
                raise ValueError(f"{k}={f[k]} is not in 0..{b} (this model's blocks)")
        if f.get("n_swap", 0) + f.get("n_checkpoint", 0) > b:
            raise ValueError(f"n_swap + n_checkpoint is more than the model's {b} blocks")
        if "n_buffer" in f and f["n_buffer"] < 0:
            raise ValueError(f"n_buffer={f['n_buffer']} is negative")

    # ---- knob ranges ------------------------------------------------------------------

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        b = self.memory.n_blocks
        s_vals = [self.fixed["n_swap"]] if "n_swap" in self.fixed else range(b + 1)
        c_vals = [self.fixed["n_checkpoint"]] if "n_checkpoint" in self.fixed else range(b + 1)
        s, c = np.meshgrid(np.asarray(list(s_vals)), np.asarray(list(c_vals)), indexing="ij")
        ok = s + c <= b
        return s[ok].astype(np.int64), c[ok].astype(np.int64)

    def persist_values(self) -> np.ndarray:
        n = self.memory.n_chunks
        if "n_persist" in self.fixed:
            return np.asarray([self.fixed["n_persist"]], dtype=np.int64)
        return np.arange(n + 1, dtype=np.int64)

    def buffer_bounds(self, n_persist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Least and most ``n_buffer`` the engine accepts for each ``n_persist``."""
        n_off = self.memory.n_chunks - n_persist
        least = np.minimum(n_off, max(self.runtime.min_buffers, 2))
        return least, n_off

    # ---- evaluation -------------------------------------------------------------------

    def evaluate(self, n_persist: int, n_buffer: int, n_swap: int, n_checkpoint: int) -> dict:
        """Predicted peak, step time and host bytes of one knob setting (no fit check)."""
        mem = self.memory.terms(n_persist, n_buffer, n_swap, n_checkpoint)
        if self.extra_bytes:
            mem["measured_beyond_model"] = self.extra_bytes
        pol = policy_matrix(self.memory.n_blocks, np.array([n_swap]), np.array([n_checkpoint]))
        compute, swap = self.runtime.pair_terms(pol)
        step, time_terms = self.runtime.step_s(
            n_persist, n_buffer, compute[0], swap[0], breakdown=True
        )
        return {
            "peak_bytes": int(sum(mem.values())),
            "step_s": float(step),
            "host_bytes": self.memory.host_bytes(n_persist, n_swap, n_checkpoint),
            "memory_terms": mem,
            "time_terms": time_terms,
        }

    def allowed(self, n_persist: int, n_buffer: int, n_swap: int, n_checkpoint: int) -> bool:
        """The engine accepts these knobs and they respect the fixed ones."""
        least, most = self.buffer_bounds(np.asarray(n_persist))
        knobs = dict(zip(KNOBS, (n_persist, n_buffer, n_swap, n_checkpoint)))
        return (
            0 <= n_persist <= self.memory.n_chunks
            and least <= min(n_buffer, most)
            and n_swap + n_checkpoint <= self.memory.n_blocks
            and all(knobs[k] == v for k, v in self.fixed.items())
        )


def _frontier(act: np.ndarray, compute: np.ndarray, swap: np.ndarray) -> np.ndarray:
    """Indices of pairs that no other pair beats or ties on all three at once."""
    order = np.lexsort((swap, compute, act))
    kept: list[int] = []
    kc = np.empty(0)
    ks = np.empty(0)
    for i in order:
        if kept and np.any((kc <= compute[i]) & (ks <= swap[i])):
            continue
        kept.append(i)
        kc = np.append(kc, compute[i])
        ks = np.append(ks, swap[i])
    return np.asarray(kept, dtype=np.int64)


def search(problem: PlanProblem, *, n_candidates: int = 8) -> SearchResult:
    """The fastest plan that fits ``problem``'s budgets; :class:`NoPlanFits` if none does."""
    mem, rt = problem.memory, problem.runtime
    s, c = problem.pairs()
    pol = policy_matrix(mem.n_blocks, s, c)
    act = mem.activation_peak_of(pol)
    compute, swap = rt.pair_terms(pol)
    host_swap = mem.swap_host_bytes(pol)
    front = _frontier(act, compute, swap)

    n_p = problem.persist_values()
    least, most = problem.buffer_bounds(n_p)
    fixed_nb = problem.fixed.get("n_buffer")
    constant = mem.model_states[n_p] + mem.grad_piece[n_p] + mem.allocator_overhead
    constant = constant + problem.extra_bytes
    budget = problem.gpu_budget_bytes
    best: list[tuple] = []
    evaluations = 0
    for i in front:
        room = budget - constant - act[i]
        if fixed_nb is not None:
            nb = np.minimum(fixed_nb, most)  # the engine clamps n_buffer to the offloaded count
            ok = (nb >= least) & (room >= nb * mem.chunk_bytes)
        else:
            nb = np.minimum(most, np.floor_divide(np.maximum(room, -1), mem.chunk_bytes))
            ok = (nb >= least) & (room >= 0)
            nb = np.maximum(nb, least)
        if problem.cpu_budget_bytes is not None:
            ok &= mem.host_suffix[n_p] + host_swap[i] <= problem.cpu_budget_bytes
        evaluations += len(n_p)
        if not ok.any():
            continue
        t = rt.step_s(n_p, nb, compute[i], swap[i])
        t = np.where(ok, t, np.inf)
        j = len(t) - 1 - int(np.argmin(t[::-1]))  # ties: the most persistent chunks
        peak = int(constant[j] + nb[j] * mem.chunk_bytes + act[i])
        best.append((float(t[j]), peak, int(n_p[j]), int(nb[j]), int(s[i]), int(c[i])))
    work = {"pairs": len(s), "frontier_pairs": len(front), "persist_evaluations": evaluations}
    if not best:
        raise _no_fit(problem, act, host_swap)
    # Among equal times: fewer swapped, then fewer checkpointed blocks, more persistent chunks.
    best.sort(key=lambda r: (round(r[0], 12), r[4], r[5], -r[2], r[1]))
    step_s, peak, *knobs = best[0]
    plan = _make_plan(problem, knobs, best[:n_candidates])
    log.debug("plan search work: %s", work)
    return SearchResult(plan=plan, work=work)


def _no_fit(problem: PlanProblem, act: np.ndarray, host_swap: np.ndarray) -> NoPlanFits:
    mem = problem.memory
    n_p = problem.persist_values()
    least, n_off = problem.buffer_bounds(n_p)
    nb = (
        np.minimum(problem.fixed.get("n_buffer", 0), n_off)
        if "n_buffer" in problem.fixed
        else least
    )
    nb = np.where(nb >= least, nb, np.iinfo(np.int64).max // 4)
    static = mem.model_states[n_p] + mem.grad_piece[n_p] + nb * mem.chunk_bytes
    smallest = int(static.min() + act.min() + mem.allocator_overhead + problem.extra_bytes)
    fixed = ", ".join(f"{k}={v}" for k, v in problem.fixed.items()) or "none"
    if smallest <= problem.gpu_budget_bytes and problem.cpu_budget_bytes is not None:
        host = int((mem.host_suffix[n_p].min()) + host_swap.min())
        return NoPlanFits(
            f"no plan fits the host budget of {problem.cpu_budget_bytes / _GIB:.2f} GiB: the "
            f"least host memory any plan needs is {host / _GIB:.2f} GiB (fixed knobs: {fixed})",
            None,
        )
    return NoPlanFits(
        f"no plan fits the GPU budget of {problem.gpu_budget_bytes / _GIB:.2f} GiB: the "
        f"smallest budget that would work is {smallest / _GIB:.2f} GiB ({smallest} bytes) "
        f"at batch {problem.profile.batch_size} x {problem.profile.seq_len} (fixed knobs: "
        f"{fixed}); lower the batch or sequence, or give a larger budget",
        smallest,
    )


def _make_plan(problem: PlanProblem, knobs: list[int], best: list[tuple]) -> Plan:
    from protrain.plan.explain import reasons_for

    p = problem.profile
    ev = problem.evaluate(*knobs)
    plan = Plan(
        **dict(zip(KNOBS, knobs)),
        chunk_size_bytes=p.chunks.chunk_size_bytes,
        n_chunks=p.chunks.n_chunks,
        n_blocks=p.n_blocks,
        tokens_per_step=p.tokens,
        gpu_budget_bytes=problem.gpu_budget_bytes,
        cpu_budget_bytes=problem.cpu_budget_bytes,
        predicted_peak_bytes=ev["peak_bytes"],
        predicted_step_s=ev["step_s"],
        predicted_host_bytes=ev["host_bytes"],
        memory_terms=ev["memory_terms"],
        time_terms=ev["time_terms"],
        fixed_knobs=dict(problem.fixed),
        candidates=[
            {
                **dict(zip(KNOBS, k)),
                "predicted_peak_bytes": peak,
                "predicted_step_s": t,
                "predicted_tokens_per_s": p.tokens / t if t else 0.0,
            }
            for t, peak, *k in best
        ],
    )
    plan.reasons = reasons_for(plan, problem)
    return plan
