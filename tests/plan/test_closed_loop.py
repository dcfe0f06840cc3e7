"""The closed loop on time: a steady step much slower than predicted corrects the rates it
measured (host AdamW, copies each way and both together, compute) and re-plans when another
plan is clearly faster with them; a step as predicted, or a warm-up step, changes nothing.
Synthetic profiles: no model, no trace."""

from __future__ import annotations

import dataclasses
import logging

import plan_synthetic as syn
import pytest

from protrain.plan import PlanProblem, search
from protrain.plan.closed_loop import (
    SLOW_STEP,
    SWITCH_MARGIN,
    MeasuredCopies,
    check_plan,
    scaled_compute,
)

BUDGET = 16 << 30  # every chunk would fit: what the plan offloads, it offloads for speed
TRUE_HOST_RATE = 4e9  # host AdamW parameters a second on the "real" host


def _problem(host_rate: float) -> PlanProblem:
    # a slow device AdamW, so that a host AdamW believed nearly free makes offloading pay
    hw = dataclasses.replace(
        syn.hardware(), cpu_adam_params_per_s=host_rate, device_adam_params_per_s=5e9
    )
    return PlanProblem(syn.profile(n_blocks=6, n_chunks=12, seed=7), hw, gpu_budget_bytes=BUDGET)


def _host_params(problem: PlanProblem, n_persist: int) -> float:
    rt = problem.runtime
    return float(rt.trainable[rt.n_chunks] - rt.trainable[n_persist])


def test_a_slow_host_optimizer_replans_to_what_the_measured_rate_favours(caplog):
    problem = _problem(host_rate=400e9)  # the profile's rate: 100 times the host's
    plan = search(problem).plan
    assert plan.n_persist < plan.n_chunks  # it offloads, believing the host step nearly free
    host_s = _host_params(problem, plan.n_persist) / TRUE_HOST_RATE
    measured_step_s = plan.predicted_step_s + host_s  # the host step was not free
    assert measured_step_s > (1 + SLOW_STEP) * plan.predicted_step_s
    with caplog.at_level(logging.WARNING, logger="protrain.plan.closed_loop"):
        check = check_plan(
            plan,
            problem,
            measured_peak_bytes=plan.predicted_peak_bytes,
            measured_step_s=measured_step_s,
            measured_host_adam_s=host_s,
            measured_wait_host_optimizer_s=0.8 * host_s,
        )
    # the plan a search with the host's true rate makes from the start
    expected = search(_problem(host_rate=TRUE_HOST_RATE)).plan
    new = check.corrected
    assert check.reason == "step" and new is not None
    assert new.knobs == expected.knobs != plan.knobs
    assert new.n_persist > plan.n_persist  # fewer host updates on the slow host
    assert new.predicted_step_s == pytest.approx(expected.predicted_step_s)
    old_rate, rate = check.corrected_rates["cpu_adam_busy_params_per_s"]
    assert (old_rate, rate) == (400e9, pytest.approx(TRUE_HOST_RATE))
    assert new.predicted_step_s <= (1 - SWITCH_MARGIN) * check.corrected_step_s
    assert "corrected after the first steps: the steady step" in new.reasons[0]
    (line,) = [r.getMessage() for r in caplog.records if "protrain plan check: step" in
               r.getMessage()]  # fmt: skip
    assert "host AdamW" in line and "corrected cpu_adam_busy_params_per_s" in line
    assert f"re-planned to {new.knobs}" in line


def test_a_step_as_predicted_keeps_the_plan():
    problem = _problem(host_rate=TRUE_HOST_RATE)
    plan = search(problem).plan
    host_s = plan.time_terms["host_optimizer"]
    check = check_plan(
        plan,
        problem,
        measured_peak_bytes=plan.predicted_peak_bytes,
        measured_step_s=plan.predicted_step_s * (1 + SLOW_STEP / 2),
        measured_host_adam_s=host_s,
    )
    assert check.corrected is None and check.reason is None
    assert check.corrected_step_s is None  # not slow: no search again


def test_a_slow_step_the_rates_do_not_explain_keeps_the_plan(caplog):
    """Slow, but the host optimizer ran at the profile's rate: with that rate the search
    finds the same plan, which stands; the log says so."""
    problem = _problem(host_rate=TRUE_HOST_RATE)
    plan = search(problem).plan
    with caplog.at_level(logging.WARNING, logger="protrain.plan.closed_loop"):
        check = check_plan(
            plan,
            problem,
            measured_peak_bytes=plan.predicted_peak_bytes,
            measured_step_s=2 * plan.predicted_step_s,
            measured_host_adam_s=plan.time_terms["host_optimizer"],
        )
    assert check.corrected is None
    assert check.corrected_step_s == pytest.approx(plan.predicted_step_s)
    assert "the plan stands" in caplog.text


def test_a_warm_up_step_changes_no_plan_on_time():
    problem = _problem(host_rate=400e9)
    plan = search(problem).plan
    host_s = _host_params(problem, plan.n_persist) / TRUE_HOST_RATE
    check = check_plan(
        plan,
        problem,
        measured_peak_bytes=plan.predicted_peak_bytes,
        measured_step_s=10 * plan.predicted_step_s,
        measured_host_adam_s=host_s,
        steady=False,
    )
    assert check.corrected is None and check.corrected_step_s is None


# ---- copies and compute: the engine's counters (chunks/copy_times.py) ------------------

PROFILED_LINK = 50e9  # bytes a second each way, as the hardware profile measured it
TRUE_LINK = 4e9  # in training: each way, and both together (the directions take turns)


def _link_problem(link: float, duplex: float) -> PlanProblem:
    """Offloading pays for speed on the profiled link: a slow device AdamW, a host AdamW
    that runs beside the compute."""
    hw = dataclasses.replace(
        syn.hardware(), cpu_adam_params_per_s=TRUE_HOST_RATE, device_adam_params_per_s=5e9,
        h2d_bytes_per_s=link, d2h_bytes_per_s=link, duplex_bytes_per_s=duplex,
    )  # fmt: skip
    return PlanProblem(syn.profile(n_blocks=6, n_chunks=12, seed=7), hw, gpu_budget_bytes=BUDGET)


def _as_measured(plan, truth: PlanProblem, link: float, busy_both: bool = False) -> dict:
    """What the engine's counters read for ``plan`` on the ``truth`` host: the bytes the
    model moves, at ``link`` each way; the two directions take turns (``busy_both``: they
    overlap fully); the waits and host AdamW as the truth predicts them."""
    terms = truth.evaluate(*plan.knobs.values())
    t = terms["time_terms"]
    h2d_s, d2h_s = t["h2d_bytes"] / link, t["d2h_bytes"] / link
    copies = MeasuredCopies(
        h2d_bytes=t["h2d_bytes"], h2d_s=h2d_s, d2h_bytes=t["d2h_bytes"], d2h_s=d2h_s,
        busy_s=max(h2d_s, d2h_s) if busy_both else h2d_s + d2h_s, wait_s=t["copy_exposed"],
    )  # fmt: skip
    return dict(
        measured_peak_bytes=plan.predicted_peak_bytes,
        measured_step_s=terms["step_s"],
        measured_host_adam_s=t["host_optimizer"],
        measured_wait_host_optimizer_s=t["host_optimizer_exposed"],
        measured_copies=copies,
    )


def test_a_slow_link_replans_to_what_the_measured_rates_favour(caplog):
    problem = _link_problem(PROFILED_LINK, 1.8 * PROFILED_LINK)
    plan = search(problem).plan
    assert plan.n_persist < plan.n_chunks  # it offloads for speed, copies hidden
    truth = _link_problem(TRUE_LINK, TRUE_LINK)
    measured = _as_measured(plan, truth, TRUE_LINK)
    assert measured["measured_step_s"] > (1 + SLOW_STEP) * plan.predicted_step_s
    with caplog.at_level(logging.WARNING, logger="protrain.plan.closed_loop"):
        check = check_plan(plan, problem, **measured)
    rates = check.corrected_rates
    for name in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
        assert rates[name] == (PROFILED_LINK, pytest.approx(TRUE_LINK))
    # the directions took turns: together no faster than one
    assert rates["duplex_bytes_per_s"] == (1.8 * PROFILED_LINK, pytest.approx(TRUE_LINK))
    assert check.compute_scale == pytest.approx(1.0)  # the compute was as traced
    assert check.measured_compute_s == pytest.approx(plan.time_terms["compute"])
    # the plan a search with the true link makes from the start
    expected = search(truth).plan
    assert check.reason == "step" and check.corrected.knobs == expected.knobs != plan.knobs
    assert check.corrected.predicted_step_s == pytest.approx(expected.predicted_step_s)
    assert check.corrected_step_s == pytest.approx(measured["measured_step_s"])
    (line,) = [r.getMessage() for r in caplog.records if "protrain plan check: step" in
               r.getMessage()]  # fmt: skip
    for part in ("compute ", "copies: h2d ", "d2h ", "link busy ", "waited ", "host AdamW",
                 "corrected cpu_adam_busy_params_per_s", "h2d_bytes_per_s 5e+10 -> 4e+09",
                 f"re-planned to {expected.knobs}"):  # fmt: skip
        assert part in line, part


def test_overlapping_directions_measure_the_duplex_rate():
    """Both directions busy at once: the duplex rate is their bytes over the busy time."""
    problem = _link_problem(PROFILED_LINK, 1.8 * PROFILED_LINK)
    plan = search(problem).plan
    measured = _as_measured(plan, problem, PROFILED_LINK, busy_both=True)
    measured["measured_step_s"] *= 2  # slow, so that the rates are corrected
    check = check_plan(plan, problem, **measured)
    c = measured["measured_copies"]
    old, duplex = check.corrected_rates["duplex_bytes_per_s"]
    assert duplex == pytest.approx((c.h2d_bytes + c.d2h_bytes) / max(c.h2d_s, c.d2h_s))
    assert duplex > PROFILED_LINK  # faster than either direction alone


def test_slow_compute_scales_the_traced_compute():
    """Copies at the profiled rates, compute twice the trace's: the check scales every
    traced compute time by 2 and predicts the current plan as it ran."""
    problem = _link_problem(PROFILED_LINK, 1.8 * PROFILED_LINK)
    plan = search(problem).plan
    slower = PlanProblem(scaled_compute(problem.profile, 2.0), problem.hardware,
                         gpu_budget_bytes=BUDGET)  # fmt: skip
    measured = _as_measured(plan, slower, PROFILED_LINK, busy_both=True)
    assert measured["measured_step_s"] > (1 + SLOW_STEP) * plan.predicted_step_s
    check = check_plan(plan, problem, **measured)
    assert check.compute_scale == pytest.approx(2.0)
    assert check.corrected_step_s == pytest.approx(measured["measured_step_s"], rel=1e-3)
    # the best plan for the slower compute is less than SWITCH_MARGIN faster: it stands
    best = search(slower).plan
    assert check.corrected is None and best.knobs != plan.knobs
    assert best.predicted_step_s > (1 - SWITCH_MARGIN) * check.corrected_step_s


def test_a_step_as_predicted_with_its_copies_keeps_the_plan():
    problem = _link_problem(PROFILED_LINK, 1.8 * PROFILED_LINK)
    plan = search(problem).plan
    measured = _as_measured(plan, problem, PROFILED_LINK, busy_both=True)
    assert measured["measured_step_s"] == pytest.approx(plan.predicted_step_s)
    check = check_plan(plan, problem, **measured)
    assert check.corrected is None and check.reason is None
    assert check.corrected_step_s is None and check.compute_scale is None
