"""The fastest plan whose predicted peak fits the budget.

[Note: why the search is exact and fast]
Memory is a sum: ``model_states(n_persist) + n_buffer * chunk + activations_and_gradients(
n_swap, n_checkpoint, n_persist) + ...``; step time is non-increasing in ``n_buffer`` and
never gets better with more compute or more swap bytes. So:

1. every allowed ``(n_swap, n_checkpoint)`` pair is evaluated at once (numpy over a pairs x
   blocks matrix) for its activation bytes in every traced interval, its compute seconds
   and its swap bytes;
2. a lower bound of each pair's best time, for every allowed ``n_persist`` at once (a pairs
   x ``n_persist`` matrix): its peak counted without the persistent gradient accumulators,
   and ``n_buffer`` the largest that fits (time is non-increasing in it, memory increasing);
3. pairs in order of that bound are evaluated exactly (intervals x ``n_persist``, the
   gradients added) until ``n_candidates`` (k) rows are known and the next bound is no
   better than the k-th best exact time: the plan is the best row, the k rows are its
   candidates. A pair's rows are its k best ``n_persist`` values at their largest fitting
   ``n_buffer``, and for those, the smaller ``n_buffer`` values that make the step slower
   (``n_buffer`` variations where they matter; one with the same time is not another
   candidate). Ties: the earlier pair in bound order, then more persistent chunks, then
   more buffers.

4. ``n_device_step`` (offloaded chunks stepped on the device, ``optim/device_step.py``) is
   chosen last, over the k candidate rows: it changes a row's step time and adds device
   bytes, and the values worth trying are few: per row, the counts around the one where
   the device-stepped chunks' link time meets the host AdamW time of the rest, or around
   the most whose device bytes fit beside the row's, if fewer (:func:`_choose_device_step`,
   at most four evaluations a row). The fastest that fits becomes the plan (a row with
   fewer buffers may have the room the fastest row lacks). Only where the problem asks for
   it (``device_step_search=True``; otherwise 0, or the user's fixed count), not on a CPU
   device (there the "device" step is the host's own work plus copies). With sharded
   chunks a rank steps its own shard of each on the device.

The work is two matrix passes over ``pairs`` plus ``exact_pairs`` evaluations of
intervals x ``n_persist`` (and ``rows`` candidate rows, each a vector over ``n_buffer`` at
most), reported in :attr:`SearchResult.work`. Knobs the user fixed are single values
in these ranges; nothing else is defaulted.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np

from protrain.plan.memory import MemoryModel, policy_matrix
from protrain.plan.plan import KNOBS, Plan, gib
from protrain.plan.runtime import RuntimeModel
from protrain.plan.world import SINGLE, World
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import ModelProfile
from protrain.units import GIB

log = logging.getLogger(__name__)


class NoPlanFits(ValueError):
    """No plan fits the budget; ``smallest_budget_bytes`` is the least GPU budget that would
    (None when unknown). ``kind``: which budget failed, ``"gpu"`` or ``"host"`` (some plan
    fits the GPU, none of those fits the host budget; ``least_host_bytes`` is the least host
    memory of those)."""

    def __init__(self, message: str, smallest_budget_bytes: int | None, kind: str = "gpu"):
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes
        self.kind = kind
        self.least_host_bytes: int | None = None  # kind "host": what the GPU-fitting plans need

    def __reduce__(self):  # pickled whole: the first rank's planning error reaches every rank
        return (type(self), (str(self), self.smallest_budget_bytes, self.kind), self.__dict__)


@dataclass
class SearchResult:
    plan: Plan
    work: dict[str, int] = field(default_factory=dict)


# Fixable besides KNOBS: chosen after them (see the module note), so not among a row's knobs.
DEVICE_STEP = "n_device_step"


def _known_knobs(fixed_knobs: dict[str, int] | None) -> dict[str, int]:
    """The knobs given a value (None: not fixed); an unknown name is an error."""
    fixed = {k: v for k, v in (fixed_knobs or {}).items() if v is not None}
    unknown = sorted(set(fixed) - set(KNOBS) - {DEVICE_STEP})
    if unknown:
        raise ValueError(
            f"fixed_knobs {unknown} are not knobs; the knobs are {KNOBS + (DEVICE_STEP,)}"
        )
    return fixed


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
        clipping: bool = True,
        world: World = SINGLE,
        device_step_search: bool = False,
        optimizer: str = "adamw",
        optimizer_state: str = "fp32",
    ):
        fixed = _known_knobs(fixed_knobs)
        self.world = world
        self.profile = profile
        self.hardware = hardware
        self.gpu_budget_bytes = int(gpu_budget_bytes)
        self.cpu_budget_bytes = cpu_budget_bytes
        self.fixed = fixed
        # Bytes the closed loop measured beyond the prediction (with_extra_bytes; 0 before
        # any real step).
        self.extra_bytes = 0
        # the optimizer the plan is for: its device state (optim/adamw_8bit.py)
        self.optimizer = optimizer
        # the host's Adam moments (optim/state_format.py): their host bytes a parameter
        self.optimizer_state = optimizer_state
        self.memory = MemoryModel(profile, world, optimizer, optimizer_state)
        # Gradient clipping decides when the host optimizer runs (plan.runtime's note).
        self.clipping = bool(clipping)
        self.runtime = RuntimeModel(
            profile, hardware, clipping=self.clipping, world=world, optimizer_state=optimizer_state
        )
        # Whether the search may choose n_device_step itself. Off by default: the device step's
        # CUDA path is tested but its speed is not in the step model; until it is, device
        # steps are used only where n_device_step is fixed by the user.
        self.device_step_search = bool(device_step_search)
        self._check_fixed()

    def with_fixed(self, fixed_knobs: dict[str, int]) -> PlanProblem:
        """The same problem with other fixed knobs, sharing its memory and runtime models."""
        other = copy.copy(self)
        other.fixed = _known_knobs(fixed_knobs)
        other._check_fixed()
        return other

    def with_extra_bytes(self, extra_bytes: int) -> PlanProblem:
        """The same problem with ``extra_bytes`` the closed loop measured beyond the memory
        model's prediction, added to every candidate's peak."""
        other = copy.copy(self)
        other.extra_bytes = int(extra_bytes)
        return other

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
        d = f.get(DEVICE_STEP, 0)
        if d < 0:
            raise ValueError(f"n_device_step={d} is negative")

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

    def buffer_bounds(
        self, n_persist: np.ndarray, recompute: bool | np.ndarray = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Least and most ``n_buffer`` the runtime runs with, for each ``n_persist``: what the
        engine checks: the chunks one module or one block needs at once (``recompute``:
        with checkpointed blocks, what their recompute holds besides), and at least 2."""
        n_off = self.memory.n_chunks - n_persist
        t = self.profile.chunks
        if t.min_buffers_recompute is None:  # a profile saved before it was recorded
            with_recompute = t.min_buffers
        else:  # a tied head's chunk is held through backward where it is offloaded
            tied = t.tied_head_chunk is not None and t.tied_head_chunk >= n_persist
            with_recompute = np.where(tied, t.min_buffers_recompute_tied, t.min_buffers_recompute)
        need = np.where(recompute, with_recompute, t.min_buffers)
        least = np.minimum(n_off, np.maximum(need, 2))
        return least, n_off

    # ---- evaluation -------------------------------------------------------------------

    def evaluate(
        self, n_persist: int, n_buffer: int, n_swap: int, n_checkpoint: int, n_device_step=0
    ) -> dict:
        """Predicted peak, step time and host bytes of one knob setting (no fit check).
        The engine clamps ``n_buffer`` to the offloaded chunks; so does this."""
        n_buffer = min(n_buffer, self.memory.n_chunks - n_persist)
        mem = self.memory.terms(n_persist, n_buffer, n_swap, n_checkpoint, n_device_step)
        if self.extra_bytes:
            mem["measured_beyond_model"] = self.extra_bytes
        pol = policy_matrix(self.memory.n_blocks, np.array([n_swap]), np.array([n_checkpoint]))
        compute, swap = self.runtime.pair_terms(pol)
        fwd_wait = self.runtime.swap_wait_s(pol, "forward")
        step, time_terms = self.runtime.step_s(
            n_persist,
            n_buffer,
            compute[0],
            swap[0],
            fwd_wait[0],
            breakdown=True,
            n_device_step=n_device_step,
        )
        time_terms["swap_wait"] = float(self.runtime.swap_wait_s(pol)[0])  # part of compute
        return {
            "peak_bytes": int(sum(mem.values())),
            "step_s": float(step),
            "host_bytes": self.memory.host_bytes(n_persist, n_swap, n_checkpoint),
            "memory_terms": mem,
            "time_terms": time_terms,
        }

    def allowed(self, n_persist: int, n_buffer: int, n_swap: int, n_checkpoint: int) -> bool:
        """The engine accepts these knobs and they respect the fixed ones."""
        least, most = self.buffer_bounds(np.asarray(n_persist), n_checkpoint > 0)
        knobs = dict(zip(KNOBS, (n_persist, n_buffer, n_swap, n_checkpoint)))
        return (
            0 <= n_persist <= self.memory.n_chunks
            and least <= min(n_buffer, most)
            and n_swap + n_checkpoint <= self.memory.n_blocks
            and all(knobs[k] == v for k, v in self.fixed.items() if k in knobs)
        )


def _fit_buffers(problem: PlanProblem, room: np.ndarray, n_p: np.ndarray, recompute):
    """(n_buffer, fits) for each entry of ``room`` (bytes left for the pool) and ``n_p``;
    ``recompute``: whether the pair (or each pair, broadcast) checkpoints blocks."""
    mem = problem.memory
    least, most = problem.buffer_bounds(n_p, recompute)
    fixed_nb = problem.fixed.get("n_buffer")
    if fixed_nb is not None:
        nb = np.broadcast_to(np.minimum(fixed_nb, most), room.shape)  # the engine clamps it
        return nb, (nb >= least) & (room >= nb * mem.chunk_bytes)
    nb = np.minimum(most, np.floor_divide(np.maximum(room, -1), mem.chunk_bytes))
    return np.maximum(nb, least), (nb >= least) & (room >= 0)


def search(problem: PlanProblem, *, n_candidates: int = 8) -> SearchResult:
    """The fastest plan that fits ``problem``'s budgets; :class:`NoPlanFits` if none does."""
    mem, rt = problem.memory, problem.runtime
    s, c = problem.pairs()
    pol = policy_matrix(mem.n_blocks, s, c)
    seg = mem.segment_activations(pol)  # pairs x segments of intervals
    compute, swap = rt.pair_terms(pol)
    fwd_wait = rt.swap_wait_s(pol, "forward")
    host_swap = mem.swap_host_bytes(pol)
    n_p = problem.persist_values()
    constant = mem.model_states[n_p] + mem.grad_piece[n_p] + mem.allocator_overhead
    constant = constant + mem.other_resident
    constant = constant + problem.extra_bytes
    host_ok = np.ones((len(s), len(n_p)), dtype=bool)
    if problem.cpu_budget_bytes is not None:
        host_ok = mem.host_suffix[n_p][None, :] + host_swap[:, None] <= problem.cpu_budget_bytes

    # Bound: a pair's peak over a few of its intervals (its largest without gradients, and
    # the intervals that hold the most gradients) is at most its peak over all of them, so
    # its best time with that peak is a lower bound of its true best time.
    act_low = _peak_lower_bound(mem, seg, n_p)
    room = problem.gpu_budget_bytes - constant[None, :] - act_low
    nb, gpu_ok = _fit_buffers(problem, room, n_p[None, :], (c > 0)[:, None])
    ok = gpu_ok & host_ok
    t_low = rt.step_s(n_p[None, :], nb, compute[:, None], swap[:, None], fwd_wait[:, None])
    t_low = np.where(ok, t_low, np.inf).min(axis=1)

    k = max(int(n_candidates), 1)
    best: list[tuple] = []  # sort key, then knobs; the k best rows so far
    exact = rows = 0
    order = np.lexsort((c, s, t_low))  # ties: fewer swapped, then fewer checkpointed blocks
    for rank, i in enumerate(order):
        kth = best[k - 1][0][0] if len(best) >= k else np.inf
        if not np.isfinite(t_low[i]) or t_low[i] >= kth:
            break
        exact += 1
        act = mem.peak_over_persist(seg[i], n_p)
        room_i = problem.gpu_budget_bytes - constant - act
        nb_i, ok_i = _fit_buffers(problem, room_i, n_p, c[i] > 0)
        ok_i = ok_i & host_ok[i]
        if not ok_i.any():
            continue
        t = np.where(ok_i, rt.step_s(n_p, nb_i, compute[i], swap[i], fwd_wait[i]), np.inf)
        terms = (compute[i], swap[i], fwd_wait[i])
        found = _pair_rows(problem, n_p, nb_i, t, terms, k, kth, c[i] > 0)
        rows += len(found)
        best += [((tj, rank, -pj, -bj), (pj, bj, int(s[i]), int(c[i]))) for tj, pj, bj in found]
        best.sort(key=lambda r: r[0])
        del best[k:]
    work = {"pairs": len(s), "persist_values": len(n_p), "exact_pairs": exact, "rows": rows}
    if not best:
        raise _no_fit(
            problem,
            _smallest_budget(problem, seg, constant, n_p, c > 0),
            _least_host(problem, seg, constant, n_p, host_swap, gpu_ok, c > 0),
        )
    rows_ = [list(knobs) for _, knobs in best]
    plain = _plain_layout(problem, best[0][0][0])
    if plain is not None:
        rows_ = [plain[0]] + [r for r in rows_ if r != plain[0]][: k - 1]
    n_device_step, why = 0, ""
    work["device_step_evaluations"] = 0
    if plain is None:  # [Note: plain PyTorch's layout first] holds against device steps too
        ri, n_device_step, why, work["device_step_evaluations"] = _choose_device_step(
            problem, rows_
        )
        rows_ = [rows_[ri]] + rows_[:ri] + rows_[ri + 1 :]
    plan = _make_plan(problem, rows_, n_device_step)
    if plain is not None:
        plan.reasons.append(plain[1])
    if why:
        plan.reasons.append(why)
    log.debug("plan search work: %s", work)
    return SearchResult(plan=plan, work=work)


# [Note: plain PyTorch's layout first]
# When every chunk fits on the GPU with no recompute, a plan that offloads or recomputes is
# taken only if it is predicted faster by more than PLAIN_MARGIN. The step model counts the
# host optimizer as hidden behind backward, but on the GPU it competes with the step for
# CPU time and memory bandwidth: Llama-3.2-1B at 70 GiB on an H100 ran 0.79x plain PyTorch
# under a plan that offloaded chunks to save a predicted few percent (predicted 0.087 s,
# measured 0.102 s), and measured steps have run 12-32% over predicted ones on
# such hosts. A gain inside that error is no reason to leave plain PyTorch's layout.
PLAIN_MARGIN = 0.10


def is_plain_layout(plan: Plan) -> bool:
    """Every chunk persistent, nothing swapped or recomputed."""
    return plan.n_persist == plan.n_chunks and plan.n_swap == 0 and plan.n_checkpoint == 0


def ranking_step_s(plan: Plan) -> float:
    """What plans of other chunk sizes or modes are compared by: the predicted step, less
    PLAIN_MARGIN for plain PyTorch's layout ([Note: plain PyTorch's layout first])."""
    credit = 1 - PLAIN_MARGIN if is_plain_layout(plan) else 1.0
    return plan.predicted_step_s * credit


def _plain_layout(problem: PlanProblem, best_s: float) -> tuple[list[int], str] | None:
    """Plain PyTorch's layout (every chunk persistent, no swap, no recompute) and the reason
    for it, when it is allowed, fits both budgets and the fastest plan found is not more
    than PLAIN_MARGIN faster; else None."""
    knobs = [problem.memory.n_chunks, 0, 0, 0]
    if not problem.allowed(*knobs) or problem.fixed.get(DEVICE_STEP):
        return None  # (every chunk persistent: none to step on the device)
    ev = problem.evaluate(*knobs)
    if ev["peak_bytes"] > problem.gpu_budget_bytes:
        return None
    if problem.cpu_budget_bytes is not None and ev["host_bytes"] > problem.cpu_budget_bytes:
        return None
    if best_s < ev["step_s"] * (1 - PLAIN_MARGIN) or best_s >= ev["step_s"]:
        return None  # clearly faster, or plain is the fastest anyway
    fixed_nb = problem.fixed.get("n_buffer")
    if fixed_nb is not None:
        knobs[1] = fixed_nb
    return knobs, (
        f"every chunk persistent, no recompute (plain PyTorch's layout): predicted "
        f"{ev['step_s']:.4f} s a step; the fastest plan that offloads or recomputes "
        f"({best_s:.4f} s) is not faster by more than {PLAIN_MARGIN:.0%}, a gain the step "
        "model's error can hide"
    )


def _pair_rows(problem: PlanProblem, n_p, nb, t, pair_terms, k: int, kth: float, recompute):
    """One pair's best rows ``(step_s, n_persist, n_buffer)``: its ``k`` best ``n_persist``
    values (ties: the most persistent) at their largest fitting ``n_buffer``, and for those,
    each smaller ``n_buffer`` that makes the step slower (time is non-increasing in
    ``n_buffer``: a smaller one with the same time is not a different candidate). Only rows
    faster than ``kth`` (the k-th best so far) can enter the best k."""
    fits = np.flatnonzero(np.isfinite(t) & (t < kth))
    top = fits[np.lexsort((-n_p[fits], t[fits]))][:k]
    out = [(float(t[j]), int(n_p[j]), int(nb[j])) for j in top]
    if "n_buffer" in problem.fixed:
        return out
    least, _ = problem.buffer_bounds(n_p[top], recompute)
    for j, lo in zip(top, least):
        below = np.arange(int(lo), int(nb[j]) + 1)
        if len(below) < 2:
            continue
        tb = problem.runtime.step_s(n_p[j], below, *pair_terms)
        tb[-1] = t[j]  # the row above, as computed for the pair
        slower = np.flatnonzero((tb[:-1] > tb[1:]) & (tb[:-1] < kth))[::-1][: k - 1]
        out += [(float(tb[m]), int(n_p[j]), int(below[m])) for m in slower]
    return out


def _peak_lower_bound(mem, seg: np.ndarray, n_p: np.ndarray) -> np.ndarray:
    """pairs x n_persist: the activation-side peak over a few traced intervals only (each a
    term of the true peak's maximum): the first with the largest activation bytes without
    gradients, and those holding the most gradients or the head. Intervals, not segments:
    the search breaks ties between equal step times by the bound's order, so the bound
    picks the intervals it always picked (a segment-level bound changed 53 of 19,232
    compared plans, at equal predicted times)."""
    grads = mem.grads[:, n_p]  # intervals x n_persist

    def interval(k):  # activation bytes in interval(s) k, one row per pair
        return seg[:, mem.seg_of[k]] + mem.iv_base[k]

    vals = seg + mem.seg_base[None, :]
    hit = vals == vals.max(axis=1, keepdims=True)
    k_star = np.where(hit, mem.seg_first_max[None, :], len(mem.seg_of)).min(axis=1)
    low = (seg[np.arange(len(seg)), mem.seg_of[k_star]] + mem.iv_base[k_star])[:, None]
    low = low + grads[k_star]
    for k in np.unique(np.concatenate([grads.argmax(axis=0), np.flatnonzero(mem.is_head)])):
        low = np.maximum(low, interval(k)[:, None] + grads[k][None, :])
    return low


def _smallest_budget(problem: PlanProblem, seg, constant, n_p, recompute) -> int:
    """The least predicted peak of any allowed plan (same bound-then-exact scheme);
    ``recompute``: per pair, whether it checkpoints blocks."""
    mem = problem.memory
    fixed_nb = problem.fixed.get("n_buffer")

    def static_bytes(rec: bool) -> np.ndarray:
        least, most = problem.buffer_bounds(n_p, rec)
        nb = np.minimum(fixed_nb, most) if fixed_nb is not None else least
        return np.where(nb >= least, constant + nb * mem.chunk_bytes, np.iinfo(np.int64).max // 4)

    static = {False: static_bytes(False), True: static_bytes(True)}
    low = (seg + mem.seg_base[None, :]).max(axis=1) + np.where(
        recompute, static[True].min(), static[False].min()
    )
    smallest = None
    for i in np.argsort(low):
        if smallest is not None and low[i] >= smallest:
            break
        need = int((static[bool(recompute[i])] + mem.peak_over_persist(seg[i], n_p)).min())
        smallest = need if smallest is None else min(smallest, need)
    return smallest


def _least_host(problem: PlanProblem, seg, constant, n_p, host_swap, gpu_ok, recompute) -> float:
    """The least host memory of the plans that fit the GPU budget (inf if none does): pairs
    checked exactly in the order of their least host need among those the lower bound lets
    fit, until the next one's need passes the least found."""
    mem = problem.memory
    need = mem.host_suffix[n_p][None, :] + host_swap[:, None]
    cand = np.where(gpu_ok, need, np.inf)
    pair_least = cand.min(axis=1)
    least = np.inf
    for i in np.argsort(pair_least):
        if not np.isfinite(pair_least[i]) or pair_least[i] >= least:
            break
        act = mem.peak_over_persist(seg[i], n_p)
        _, fit = _fit_buffers(problem, problem.gpu_budget_bytes - constant - act, n_p, recompute[i])
        if fit.any():
            least = min(least, float(need[i][fit].min()))
    return least


def _no_fit(problem: PlanProblem, smallest: int | None, least_host: float) -> NoPlanFits:
    fixed = ", ".join(f"{k}={v}" for k, v in problem.fixed.items()) or "none"
    if smallest is not None and smallest <= problem.gpu_budget_bytes:
        error = NoPlanFits(
            f"no plan fits the host budget of {problem.cpu_budget_bytes / GIB:.2f} GiB: the "
            f"plans that fit the GPU budget need at least {least_host / GIB:.2f} GiB "
            f"({least_host:.0f} bytes) of host memory (fixed knobs: {fixed})",
            None,
            kind="host",
        )
        error.least_host_bytes = int(least_host)
        return error
    return NoPlanFits(
        f"no plan fits the GPU budget of {problem.gpu_budget_bytes / GIB:.2f} GiB: the "
        f"smallest budget that would work is {smallest / GIB:.2f} GiB ({smallest} bytes) "
        f"at batch {problem.profile.batch_size} x {problem.profile.seq_len} (fixed knobs: "
        f"{fixed}); lower the batch or sequence, or give a larger budget",
        smallest,
    )


def _choose_device_step(problem: PlanProblem, rows: list[list[int]]) -> tuple[int, int, str, int]:
    """The candidate row and ``n_device_step`` of the fastest plan that fits, the reason
    (``""`` when not searched) and the evaluations it took. Per row: the counts around the
    balance of device and host time, or around the most whose device bytes fit beside the
    row's own (a row with fewer buffers may leave the room the fastest row does not)."""
    rt, hw = problem.runtime, problem.hardware
    if DEVICE_STEP in problem.fixed:
        return _fixed_device_step(problem, rows, problem.fixed[DEVICE_STEP])
    if not problem.device_step_search or hw.device == "cpu":
        return 0, 0, "", 0
    best = None  # (step_s, row, d)
    fastest_s = None
    evaluations = 0
    for ri, knobs in enumerate(rows):
        n_p = knobs[0]
        chunks = rt.device_step_chunks(n_p, problem.memory.n_chunks)  # every offloaded one
        base = problem.evaluate(*knobs)
        evaluations += 1
        if fastest_s is None:
            fastest_s = base["step_s"]
        if best is None or base["step_s"] < best[0]:
            best = (base["step_s"], ri, 0)
        if not len(chunks):
            continue
        # d chunks on the device (the last d): host time of the others against device time
        host_left = np.concatenate([np.cumsum(rt.host_step_chunk_s(chunks))[::-1], [0.0]])
        dev_time = np.concatenate([[0.0], np.cumsum(rt.device_step_chunk_s(chunks)[::-1])])
        balance = int(np.argmax(dev_time >= host_left))
        room = problem.gpu_budget_bytes - base["peak_bytes"]
        most = 0  # the staging sets' bytes never shrink as d grows (capped at a piece)
        while most < len(chunks) and (
            sum(problem.memory.device_step_terms(n_p, most + 1).values()) <= room
        ):
            most += 1
        center = min(balance, most)
        for d in sorted({d for d in (center - 1, center, center + 1) if 0 < d <= most}):
            ev = problem.evaluate(*knobs, n_device_step=d)
            evaluations += 1
            if ev["peak_bytes"] <= problem.gpu_budget_bytes and ev["step_s"] < best[0]:
                best = (ev["step_s"], ri, d)
    step_s, ri, d = best
    knobs = dict(zip(KNOBS, rows[ri]))
    why = (
        f"n_device_step={d} (offloaded chunks stepped on the device) with {knobs}: predicted "
        f"{step_s:.4f} s, the fastest plan without it {fastest_s:.4f} s ({evaluations} "
        "evaluations over the candidates)"
    )
    return ri, d, why, evaluations


def _fixed_device_step(problem: PlanProblem, rows: list[list[int]], d: int):
    """:func:`_choose_device_step` with ``n_device_step`` fixed: the fastest candidate row
    that has ``d`` offloaded trainable chunks and fits with them."""
    if d == 0:
        return 0, 0, "", 0
    best, evaluations = None, 0
    for ri, knobs in enumerate(rows):
        if len(problem.runtime.device_step_chunks(knobs[0], d)) < d:
            continue  # fewer offloaded trainable chunks than that
        ev = problem.evaluate(*knobs, n_device_step=d)
        evaluations += 1
        fits = ev["peak_bytes"] <= problem.gpu_budget_bytes
        if fits and (best is None or ev["step_s"] < best[0]):
            best = (ev["step_s"], ri)
    if best is None:
        raise NoPlanFits(
            f"n_device_step={d} fits none of the {len(rows)} fastest plans of the budget of "
            f"{problem.gpu_budget_bytes / GIB:.2f} GiB (its staging sets take device memory, "
            "and it needs that many offloaded trainable chunks): use a smaller "
            "n_device_step, or leave it to the planner",
            None,
        )
    return best[1], d, "", evaluations


def _make_plan(problem: PlanProblem, best: list[list[int]], n_device_step: int = 0) -> Plan:
    """The plan of ``best[0]`` with ``n_device_step``; ``best`` (knobs, fastest first)
    becomes its candidates, each evaluated as the plan is (the first with
    ``n_device_step``, the others without)."""
    p = problem.profile
    fixed_nb = problem.fixed.get("n_buffer")
    candidates = []
    for i, knobs in enumerate(best):
        d = n_device_step if i == 0 else 0
        ev = problem.evaluate(*knobs, n_device_step=d)
        if fixed_nb is not None:
            knobs = [knobs[0], fixed_nb, *knobs[2:]]  # the user's value, not the clamped one
        t = ev["step_s"]
        candidates.append(
            {
                **dict(zip(KNOBS, knobs)),
                "predicted_peak_bytes": ev["peak_bytes"],
                "predicted_step_s": t,
                "predicted_tokens_per_s": p.tokens / t if t else 0.0,
                "predicted_host_bytes": ev["host_bytes"],
                "n_device_step": d,
            }
        )
    knobs = [candidates[0][k] for k in KNOBS]
    ev = problem.evaluate(*knobs, n_device_step=n_device_step)
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
        candidates=candidates,
        world_size=problem.world.size,
        distributed_mode=problem.world.distributed_mode,
        chunked_loss_tokens=p.loss_chunk_tokens,
        loss_planned=p.loss_vocab_size is not None,
        n_device_step=n_device_step,
        optimizer=problem.optimizer,
        kernels=list(p.kernels),
    )
    plan.reasons = reasons_for(plan, problem)
    return plan


def reasons_for(plan: Plan, problem: PlanProblem) -> list[str]:
    """Why the search chose ``plan`` for ``problem``, a sentence each (``Plan.reasons``)."""
    out = []
    fixed = plan.fixed_knobs
    if fixed:
        out.append("fixed by the user: " + ", ".join(f"{k}={v}" for k, v in fixed.items()))
    searched = [k for k in KNOBS if k not in fixed]
    if searched:
        out.append("searched: " + ", ".join(searched))
    budget = plan.gpu_budget_bytes
    out.append(
        f"fastest of the plans that fit {gib(budget)}: predicted peak "
        f"{gib(plan.predicted_peak_bytes)} ({gib(budget - plan.predicted_peak_bytes)} left)"
    )
    if plan.n_persist == plan.n_chunks:
        if problem.hardware.device == "cuda":
            out.append("every chunk stays on the GPU: no parameter traffic, no host optimizer")
        else:  # planned for the CPU: the device is the host, nothing moves
            out.append(
                f"every chunk stays on the device ({problem.hardware.device}): no chunk copies, "
                "no separate host optimizer"
            )
    else:
        nxt = problem.memory.model_states[min(plan.n_persist + 1, plan.n_chunks)]
        more = nxt - problem.memory.model_states[plan.n_persist]
        out.append(
            f"n_persist={plan.n_persist} of {plan.n_chunks} chunks: one more persistent chunk "
            f"needs {gib(more)} of model states"
        )
    t = plan.time_terms
    if t:
        out.append(
            f"step {plan.predicted_step_s:.3f} s: compute {t['compute']:.3f} s"
            + (
                f" (of which {t['swap_wait']:.3f} s swapped blocks wait for their copies)"
                if t.get("swap_wait")
                else ""
            )  # fmt: skip
            + f", copies "
            f"{t['copy']:.3f} s ({t['copy_exposed']:.3f} s not hidden), device optimizer "
            f"{t['device_optimizer']:.3f} s, host optimizer {t['host_optimizer']:.3f} s "
            f"({t['host_optimizer_exposed']:.3f} s the next forward waits for)"
        )
    bound = host_bound(plan, problem.hardware)
    if bound:
        out.append(bound)
    if plan.n_checkpoint or plan.n_swap:
        out.append(
            f"activations: {plan.n_swap} blocks swapped, {plan.n_checkpoint} checkpointed, "
            f"{plan.n_blocks - plan.n_swap - plan.n_checkpoint} kept"
        )
    return out


def host_bound(plan: Plan, hardware: HardwareProfile) -> str | None:
    """A sentence where the host's memory sets the step: its update of the offloaded
    parameters takes longer than the step's compute, so no schedule hides it."""
    t = plan.time_terms or {}
    host_s, compute_s = t.get("host_optimizer", 0.0), t.get("compute", 0.0)
    if hardware.device != "cuda" or host_s <= compute_s or host_s == 0.0:
        return None
    text = (
        f"the host is the bound: its update of the offloaded parameters takes {host_s:.3f} s "
        f"against {compute_s:.3f} s of compute ({hardware.host_update} update, "
        f"{t.get('host_bytes_per_param', 0.0):.0f} bytes of host memory a parameter a step"
    )
    if t.get("host_floor") and hardware.host_memory_bytes_per_s:
        roof = hardware.host_memory_bytes_per_s / 1e9
        text += f"; at the host's measured roof of {roof:.0f} GB/s no step is under {t['host_floor']:.3f} s"
    return text + ")"
