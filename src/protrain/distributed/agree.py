"""Decisions one rank makes for all: what a plan, a measurement or an error is, everywhere.

The planner profiles and searches on the first rank only (the other ranks would repeat the
same work and hold the model's host copies once more each); every rank must then run the
same plan, since their collectives must match. An error on the deciding rank is raised on
every rank, with its message, instead of leaving the others waiting in a collective; the
copies raised on the other ranks carry ``protrain_agreed = True``, so that the application
prints it once (`protrain/cli.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from protrain.distributed.process_group import DistContext

T = TypeVar("T")


def from_main(ctx: DistContext, obj: T) -> T:
    """The first rank's ``obj`` on every rank (pickled: small values only)."""
    if not ctx.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(ctx.group, 0), group=ctx.group)
    return box[0]


def on_main(ctx: DistContext, fn: Callable[[], T]) -> T:
    """``fn()`` run by the first rank, its result (or its exception) on every rank."""
    if not ctx.is_distributed:
        return fn()
    result: tuple[bool, object] = (True, None)
    if ctx.is_main:
        try:
            result = (True, fn())
        except Exception as exc:  # raised below, on every rank alike
            result = (False, exc)
    try:
        ok, value = from_main(ctx, result)
    except Exception as exc:  # an exception that does not pickle: its message still does
        raise RuntimeError(f"protrain: the first rank failed: {result[1]}") from exc
    if not ok:
        raise agreed(ctx, value)  # type: ignore[arg-type]
    return value  # type: ignore[return-value]


def agreed(ctx: DistContext, exc: BaseException) -> BaseException:
    """``exc``, rank 0's verdict about to be raised alike on every rank: marked
    ``protrain_agreed`` on the other ranks, where it is a copy rank 0 reports."""
    if not ctx.is_main:
        exc.protrain_agreed = True  # type: ignore[attr-defined]
    return exc


def max_over_ranks(ctx: DistContext, values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum of every rank's ``values``, reduced on ``device`` (the compute
    device, which the group's backend serves: ``DistContext.check_device``)."""
    if not ctx.is_distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.tolist()


def alike(exc: BaseException) -> BaseException:
    """``exc``, raised alike on every rank by the same check of the same config, checkpoint
    or model: marked as an agreed error is, so that it is printed once (`protrain/cli.py`)."""
    exc.protrain_agreed = True  # type: ignore[attr-defined]
    return exc
