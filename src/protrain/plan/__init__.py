"""Deciding: the memory model (``memory``), the step-time model (``runtime``), the search
over ``(n_persist, n_buffer, n_swap, n_checkpoint)`` (``search``), the ``Plan`` value
and its explanation (``plan``), profile + search in one call (``auto``) and the
check of a plan against the first real steps (``closed_loop``); what a planning call is
asked is one ``PlanRequest`` (``request``), the knobs it decides one ``protrain.knobs.Knobs``. The planner decides and
never executes: ``protrain.planned_wrap`` wraps with a plan's knobs."""

from protrain.knobs import Knobs
from protrain.plan.auto import plan_for, profile_and_plan, profile_model
from protrain.plan.closed_loop import PlanCheck, check_plan
from protrain.plan.plan import KNOBS, Plan, candidates_table, explain
from protrain.plan.request import PlanRequest, parse_bytes
from protrain.plan.search import NoPlanFits, PlanProblem, search

__all__ = [
    "KNOBS",
    "Knobs",
    "NoPlanFits",
    "Plan",
    "PlanCheck",
    "PlanProblem",
    "PlanRequest",
    "candidates_table",
    "check_plan",
    "explain",
    "parse_bytes",
    "plan_for",
    "profile_and_plan",
    "profile_model",
    "search",
]
