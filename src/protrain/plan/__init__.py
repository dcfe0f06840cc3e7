"""Deciding: the memory model (``memory``), the step-time model (``runtime``), the search
over ``(n_persist, n_buffer, n_swap, n_checkpoint)`` (``search``), the ``Plan`` value
and its explanation (``plan``), profile + search in one call (``auto``) and the
check of a plan against the first real steps (``closed_loop``). The planner decides and
never executes: ``protrain.planned_wrap`` wraps with a plan's knobs."""

from protrain.plan.auto import parse_bytes, plan_for, profile_and_plan, profile_model
from protrain.plan.closed_loop import PlanCheck, check_plan
from protrain.plan.plan import KNOBS, Plan, candidates_table, explain
from protrain.plan.search import NoPlanFits, PlanProblem, search

__all__ = [
    "KNOBS",
    "NoPlanFits",
    "Plan",
    "PlanCheck",
    "PlanProblem",
    "candidates_table",
    "check_plan",
    "explain",
    "parse_bytes",
    "plan_for",
    "profile_and_plan",
    "profile_model",
    "search",
]
