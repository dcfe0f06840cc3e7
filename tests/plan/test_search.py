"""Search correctness on synthetic profiles, against brute force over every knob setting."""

from __future__ import annotations

import itertools

import numpy as np
import plan_synthetic as syn
import pytest

from protrain.activations.policy import ActivationPolicy, place_policies
from protrain.plan import NoPlanFits, Plan, PlanProblem, candidates_table, search
from protrain.plan.memory import CHECKPOINT, KEEP, SWAP, policy_matrix
from protrain.plan.search import PLAIN_MARGIN, is_plain_layout, ranking_step_s

GIB = 1 << 30


def brute_force(problem: PlanProblem):
    """(step_s, knobs) of the fastest allowed plan that fits, by evaluating every setting."""
    n, b = problem.memory.n_chunks, problem.memory.n_blocks
    best = None
    for knobs in itertools.product(range(n + 1), range(n + 1), range(b + 1), range(b + 1)):
        if not problem.allowed(*knobs):
            continue
        ev = problem.evaluate(*knobs)
        if ev["peak_bytes"] > problem.gpu_budget_bytes:
            continue
        if problem.cpu_budget_bytes is not None and ev["host_bytes"] > problem.cpu_budget_bytes:
            continue
        if best is None or ev["step_s"] < best[0] - 1e-12:
            best = (ev["step_s"], knobs)
    plain = _plain(problem, best)
    return plain if plain is not None else best


def _plain(problem: PlanProblem, best):
    """(step_s, knobs) of plain PyTorch's layout where the search must prefer it: it fits
    and ``best`` is not more than PLAIN_MARGIN faster ([Note: plain PyTorch's layout
    first])."""
    knobs = (problem.memory.n_chunks, 0, 0, 0)
    if best is None or not problem.allowed(*knobs):
        return None
    ev = problem.evaluate(*knobs)
    if ev["peak_bytes"] > problem.gpu_budget_bytes:
        return None
    if best[0] < ev["step_s"] * (1 - PLAIN_MARGIN) or best[0] >= ev["step_s"]:
        return None
    return ev["step_s"], knobs


def test_policy_matrix_is_the_placement_rule():
    b = 7
    pairs = [(s, c) for s in range(b + 1) for c in range(b + 1 - s)]
    pol = policy_matrix(b, np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]))
    code = {ActivationPolicy.KEEP: KEEP, ActivationPolicy.CHECKPOINT: CHECKPOINT,
            ActivationPolicy.SWAP: SWAP}  # fmt: skip
    for row, (s, c) in zip(pol, pairs):
        assert list(row) == [code[p] for p in place_policies(b, s, c)], (s, c)


@pytest.mark.parametrize("budget_gib", [1.2, 1.6, 2.0, 2.6, 3.5, 6.0])
def test_search_finds_the_fastest_fitting_plan(budget_gib):
    prof = syn.profile(n_blocks=4, n_chunks=7, seed=1)
    problem = PlanProblem(prof, syn.hardware(), gpu_budget_bytes=int(budget_gib * GIB))
    expected = brute_force(problem)
    if expected is None:
        with pytest.raises(NoPlanFits):
            search(problem)
        return
    plan = search(problem).plan
    assert plan.predicted_peak_bytes <= problem.gpu_budget_bytes
    # the fastest over the four knobs; device-stepped chunks, chosen after them over the
    # candidates (plan/search.py), only where they make it faster still
    if plan.n_device_step == 0:
        assert plan.predicted_step_s == pytest.approx(expected[0], rel=1e-9)
    else:
        assert plan.predicted_step_s < expected[0]
    ev = problem.evaluate(*plan.knobs.values(), n_device_step=plan.n_device_step)
    assert ev["step_s"] == plan.predicted_step_s
    assert ev["peak_bytes"] == plan.predicted_peak_bytes == sum(plan.memory_terms.values())
    assert plan.memory_terms["other_resident"] == 100 * syn.MIB
    assert problem.allowed(*plan.knobs.values())


@pytest.mark.parametrize(
    "fixed",
    [{"n_persist": 2}, {"n_buffer": 3}, {"n_checkpoint": 4}, {"n_swap": 1, "n_checkpoint": 1}],
)
def test_fixed_knobs_are_kept_and_the_rest_searched(fixed):
    prof = syn.profile(n_blocks=4, n_chunks=7, seed=2)
    problem = PlanProblem(prof, syn.hardware(), gpu_budget_bytes=3 * GIB, fixed_knobs=fixed)
    plan = search(problem).plan
    for k, v in fixed.items():
        assert getattr(plan, k) == v
    assert plan.fixed_knobs == fixed
    assert any("fixed by the user" in r for r in plan.reasons)
    assert plan.predicted_step_s == pytest.approx(brute_force(problem)[0], rel=1e-9)


def test_host_budget_is_respected():
    prof = syn.profile(n_blocks=4, n_chunks=7, seed=3)
    free = search(PlanProblem(prof, syn.hardware(), gpu_budget_bytes=int(1.4 * GIB))).plan
    cpu_budget = free.predicted_host_bytes - 1
    problem = PlanProblem(
        prof, syn.hardware(), gpu_budget_bytes=int(1.4 * GIB), cpu_budget_bytes=cpu_budget
    )
    expected = brute_force(problem)
    if expected is None:
        with pytest.raises(NoPlanFits):
            search(problem)
    else:
        plan = search(problem).plan
        assert plan.predicted_host_bytes <= cpu_budget
        assert plan.predicted_step_s == pytest.approx(expected[0], rel=1e-9)


def test_step_time_is_monotonic_in_the_budget():
    """What the search minimizes (the predicted step, plain PyTorch's layout credited with
    PLAIN_MARGIN) never grows with the budget; once plain's layout fits, it is the plan."""
    prof = syn.profile(n_blocks=12, n_chunks=40, seed=4)
    times, plain = [], []
    for budget in np.linspace(2, 40, 25):
        try:
            plan = search(
                PlanProblem(prof, syn.hardware(), gpu_budget_bytes=int(budget * GIB))
            ).plan
            times.append(ranking_step_s(plan))
            plain.append(is_plain_layout(plan))
        except NoPlanFits:
            times.append(float("inf"))
            plain.append(False)
    assert all(a >= b - 1e-12 for a, b in zip(times, times[1:])), times
    assert times[-1] < float("inf")
    assert plain[-1] and plain == sorted(plain)  # from some budget on, always plain


def test_no_fit_names_the_smallest_budget_that_works():
    prof = syn.profile(n_blocks=6, n_chunks=12, seed=5)
    with pytest.raises(NoPlanFits) as err:
        search(PlanProblem(prof, syn.hardware(), gpu_budget_bytes=GIB // 4))
    smallest = err.value.smallest_budget_bytes
    assert smallest is not None and "smallest budget that would work" in str(err.value)
    plan = search(PlanProblem(prof, syn.hardware(), gpu_budget_bytes=smallest)).plan
    assert plan.predicted_peak_bytes == smallest
    with pytest.raises(NoPlanFits):
        search(PlanProblem(prof, syn.hardware(), gpu_budget_bytes=smallest - 1))


def test_no_fit_with_fixed_knobs_uses_them():
    prof = syn.profile(n_blocks=6, n_chunks=12, seed=5)
    fixed = {"n_persist": 6, "n_checkpoint": 0, "n_swap": 0}
    with pytest.raises(NoPlanFits) as err:
        search(PlanProblem(prof, syn.hardware(), gpu_budget_bytes=GIB, fixed_knobs=fixed))
    smallest = err.value.smallest_budget_bytes
    plan = search(
        PlanProblem(prof, syn.hardware(), gpu_budget_bytes=smallest, fixed_knobs=fixed)
    ).plan
    assert plan.n_persist == 6 and plan.predicted_peak_bytes == smallest


def test_bad_fixed_knobs_are_errors():
    prof = syn.profile(n_blocks=4, n_chunks=7)
    for fixed in ({"n_persist": 8}, {"n_swap": 3, "n_checkpoint": 2}, {"n_chunks": 1}):
        with pytest.raises(ValueError):
            PlanProblem(prof, syn.hardware(), gpu_budget_bytes=GIB, fixed_knobs=fixed)


def test_search_work_for_300_chunks_and_100_blocks():
    prof = syn.profile(n_blocks=100, n_chunks=300, seed=6, chunk_mib=32)
    problem = PlanProblem(prof, syn.hardware(), gpu_budget_bytes=24 * GIB)
    # The search's work, not its seconds, is what a test can bound on a shared machine; its
    # time is benchmarks/search_time.py's.
    work = search(problem).work
    assert work["pairs"] == 101 * 102 // 2  # every (n_swap, n_checkpoint) once, as one matrix
    assert work["persist_values"] == 301
    assert work["exact_pairs"] <= 200, work  # the bound leaves few pairs to evaluate exactly


def test_plan_round_trips_through_json():
    prof = syn.profile(n_blocks=4, n_chunks=7)
    plan = search(PlanProblem(prof, syn.hardware(), gpu_budget_bytes=3 * GIB,
                              fixed_knobs={"n_swap": 0})).plan  # fmt: skip
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert "best candidates" in str(again) and "n_persist" in str(again)
    assert plan.candidates[0]["predicted_step_s"] == plan.predicted_step_s


def brute_force_rows(problem: PlanProblem) -> list[tuple[float, tuple]]:
    """Every allowed fitting knob setting whose n_buffer matters (the next larger fitting
    n_buffer is faster, or there is none), fastest first."""
    n, b = problem.memory.n_chunks, problem.memory.n_blocks
    fits = {}
    for knobs in itertools.product(range(n + 1), range(n + 1), range(b + 1), range(b + 1)):
        if knobs[1] > n - knobs[0] or not problem.allowed(*knobs):
            continue
        ev = problem.evaluate(*knobs)
        if ev["peak_bytes"] <= problem.gpu_budget_bytes:
            fits[knobs] = ev["step_s"]
    rows = []
    for (p, nb, s, c), t in fits.items():
        up = fits.get((p, nb + 1, s, c))
        if up is None or t > up:
            rows.append((t, (p, nb, s, c)))
    return sorted(rows, key=lambda r: r[0])


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("budget_gib", [1.6, 2.6, 40.0])
def test_best_candidates_are_the_k_fastest_fitting_plans(device, budget_gib):
    prof = syn.profile(n_blocks=4, n_chunks=7, seed=8)
    problem = PlanProblem(prof, syn.hardware(device), gpu_budget_bytes=int(budget_gib * GIB))
    result = search(problem, n_candidates=8)
    plan, cands = result.plan, result.plan.candidates
    expected = brute_force_rows(problem)
    plain = _plain(problem, expected[0] if expected else None)
    if plain is not None:  # plain PyTorch's layout first, then the fastest others
        expected = [plain] + [r for r in expected if r[1] != plain[1]]
    assert len(cands) == min(8, len(expected))
    if budget_gib == 40.0:
        assert len(cands) == 8  # a generous budget: k rows, not just the chosen plan
    assert {k: cands[0][k] for k in plan.knobs} == plan.knobs
    assert cands[0]["predicted_step_s"] == plan.predicted_step_s
    times = [c["predicted_step_s"] for c in cands]
    assert times[1:] == sorted(times[1:])
    assert times == pytest.approx([t for t, _ in expected[: len(cands)]], rel=1e-9)
    keys = [tuple(c[k] for k in plan.knobs) for c in cands]
    assert len(set(keys)) == len(keys)
    for c, key in zip(cands, keys):
        assert problem.allowed(*key)
        assert c["predicted_peak_bytes"] <= problem.gpu_budget_bytes
        assert c["predicted_peak_bytes"] == problem.evaluate(*key)["peak_bytes"]
    table = candidates_table(plan).splitlines()
    assert len(table) == 1 + len(cands)
    assert result.work["exact_pairs"] <= result.work["pairs"]


def test_best_candidates_work_stays_bounded_for_300_chunks():
    prof = syn.profile(n_blocks=100, n_chunks=300, seed=6, chunk_mib=32)
    problem = PlanProblem(prof, syn.hardware(), gpu_budget_bytes=1000 * GIB)  # everything fits
    result = search(problem, n_candidates=8)
    cands = result.plan.candidates
    assert len(cands) == 8 and cands[0]["predicted_step_s"] == result.plan.predicted_step_s
    assert is_plain_layout(result.plan)  # it fits: plain PyTorch's layout, then the fastest
    rest = [c["predicted_step_s"] for c in cands[1:]]
    assert rest == sorted(rest) and rest[0] >= cands[0]["predicted_step_s"] * (1 - PLAIN_MARGIN)
    assert result.work["exact_pairs"] <= 200 and result.work["rows"] <= 8 * 8, result.work


def test_the_reasons_say_when_the_host_is_the_bound():
    """A plan whose host update outlasts its compute says so, with the bytes a parameter and
    the floor at the measured roof; one that hides it, or runs on the CPU, says nothing."""
    import dataclasses

    from protrain.plan.search import host_bound

    plan = Plan(
        n_persist=0, n_buffer=2, n_swap=0, n_checkpoint=0, chunk_size_bytes=1, n_chunks=4,
        n_blocks=2, tokens_per_step=1, gpu_budget_bytes=1, cpu_budget_bytes=None,
        predicted_peak_bytes=1, predicted_step_s=2.0, predicted_host_bytes=1,
        time_terms={"compute": 0.5, "host_optimizer": 1.5, "host_bytes_per_param": 32.0,
                    "host_floor": 1.2},
    )  # fmt: skip
    hw = dataclasses.replace(syn.hardware(), host_update="one_pass", host_memory_bytes_per_s=1e11)
    text = host_bound(plan, hw)
    assert text.startswith("the host is the bound") and "32 bytes" in text
    assert "roof of 100 GB/s no step is under 1.200 s" in text
    assert host_bound(plan, syn.hardware("cpu")) is None
    hidden = dataclasses.replace(plan, time_terms={"compute": 2.0, "host_optimizer": 1.5})
    assert host_bound(hidden, hw) is None
