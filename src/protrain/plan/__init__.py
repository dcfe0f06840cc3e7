"""Deciding: the memory model (``memory``), the step-time model (``runtime``), the search
over ``(n_persist, n_buffer, n_swap, n_checkpoint)`` (``search``), the ``Plan`` value
(``plan``), its explanation (``explain``), profile + search in one call (``auto``) and the
check of a plan against the first real steps (``closed_loop``)."""

from protrain.plan.plan import KNOBS, Plan
from protrain.plan.search import NoPlanFits, PlanProblem, search

__all__ = ["KNOBS", "NoPlanFits", "Plan", "PlanProblem", "search"]
