"""Decisions one rank makes for all: what a plan, a measurement or an error is, everywhere.

The planner profiles and searches on the first rank only (the other ranks would repeat the
same work and hold the model's host copies once more each); every rank must then run the
same plan, since their collectives must match. An error on the deciding rank is raised on
every rank, with its message, instead of leaving the others waiting in a collective; the
copies raised on the other ranks carry ``protrain_agreed = True``, so that the application
prints it once (`protrain/cli.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from protrain.distributed.process_group import DistContext

T = TypeVar("T")
PATIENT_POLL_S = 30.0  # well inside a group's collective timeout (600 s by default)


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


def on_main_patiently(
    ctx: DistContext,
    fn: Callable[[], T],
    device: torch.device | None = None,
    poll_s: float | None = None,
) -> T:
    """``on_main`` for work that may outlast the group's collective timeout (the planner's
    trace and search of a large model, the hashing of a large checkpoint, an export):
    waiting for it in one collective would end the job at that timeout. The first rank
    runs ``fn`` on its main thread (its autocast and grad modes, its signal handlers)
    while a thread of it meets the other ranks every ``poll_s`` in a one-number
    all-reduce that says whether it is done; then its result (or its exception) goes to
    every rank as ``on_main``'s does. ``device``: where the group's backend takes the
    poll's tensor (None: the CPU, which gloo serves). ``poll_s`` None: ``PATIENT_POLL_S``."""
    if not ctx.is_distributed:
        return fn()
    device = device or torch.device("cpu")
    poll_s = PATIENT_POLL_S if poll_s is None else poll_s
    if not ctx.is_main:
        while not _done_over_ranks(ctx, False, device):
            pass
        return on_main(ctx, _not_run)
    done = threading.Event()

    def meet() -> None:
        while not _done_over_ranks(ctx, done.wait(poll_s), device):
            pass

    poller = threading.Thread(target=meet, name="protrain-patient-wait", daemon=True)
    poller.start()
    outcome: tuple[bool, object] = (False, None)
    try:
        outcome = (True, fn())
    except Exception as exc:  # raised on every rank by on_main below
        outcome = (False, exc)
    finally:
        done.set()  # also when interrupted: the others are let go, not left waiting
    poller.join()

    def result():
        ok, value = outcome
        if not ok:
            raise value  # type: ignore[misc]
        return value

    return on_main(ctx, result)


def _done_over_ranks(ctx: DistContext, done: bool, device: torch.device) -> bool:
    t = torch.tensor([1.0 if done else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.item() > 0


def _not_run():
    raise AssertionError("on_main runs its function on the first rank only")


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
