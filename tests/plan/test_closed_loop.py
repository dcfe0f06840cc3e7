"""The closed loop on time: a steady step much slower than predicted corrects the rates it
measured and re-plans when another plan is clearly faster with them; a step as predicted,
or a warm-up step, changes nothing. Synthetic profiles: no model, no trace."""

from __future__ import annotations

import dataclasses
import logging

import plan_synthetic as syn
import pytest

from protrain.plan import PlanProblem, search
from protrain.plan.closed_loop import SLOW_STEP, SWITCH_MARGIN, check_plan

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
