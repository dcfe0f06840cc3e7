"""``Ranks.on_main_patiently`` and the planner's wait: rank 0's work that outlasts the group's collective timeout
(at resume, hashing a large checkpoint) no longer ends the job at that timeout. Two gloo
ranks on a group whose timeout is 2 s: rank 0 works 5 s, the other rank gets its result (or
its exception, with its message); a plain broadcast after the same wait times out."""

from __future__ import annotations

import datetime
import functools
import time
import weakref

import pytest
import torch.distributed as dist
from torch import nn

from protrain.distributed import agree
from protrain.distributed.process_group import DistContext
from protrain.plan import auto
from protrain.train.errors import OutputDirError
from protrain.train.ranks import Ranks

from .ranks import run_ranks

TIMEOUT_S, WORK_S = 2, 5


def _ranks(rank: int, world: int) -> tuple[Ranks, object]:
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    ctx = DistContext(group_ref=weakref.ref(group), rank=rank, world_size=world,
                      local_rank=rank, local_world_size=world, backend="gloo")  # fmt: skip
    return Ranks(ctx), group


def _patient(rank: int, world: int) -> None:
    ranks, group = _ranks(rank, world)

    def slow_value():
        time.sleep(WORK_S)
        return {"checkpoint": "checkpoint-40"}

    def slow_error():
        time.sleep(WORK_S)
        raise OutputDirError("checkpoint-40 is damaged")

    t0 = time.monotonic()
    got = ranks.on_main_patiently(slow_value, poll_s=0.5)
    assert got == {"checkpoint": "checkpoint-40"}, got
    assert time.monotonic() - t0 >= WORK_S - 0.1  # every rank waited for the work
    with pytest.raises(OutputDirError, match="checkpoint-40 is damaged"):
        ranks.on_main_patiently(slow_error, poll_s=0.5)
    assert ranks.on_main_patiently(lambda: 7, poll_s=0.5) == 7  # the group still works
    del group


def test_rank_zero_works_longer_than_the_collective_timeout():
    run_ranks(2, _patient)


def _impatient(rank: int, world: int) -> None:
    ranks, group = _ranks(rank, world)
    if rank == 0:
        time.sleep(WORK_S)
    try:
        ranks.from_main("late")
    except RuntimeError as exc:
        # the waiting rank at the group's timeout; rank 0 then finds its peer gone
        if rank == 1:
            assert "imeout" in str(exc) or "imed out" in str(exc), exc
        return
    assert rank == 0, "the waiting rank got its value past the group's timeout"


def test_a_plain_broadcast_times_out_there():
    """The control: the wait the patient one replaces ends at the group's timeout."""
    run_ranks(2, _impatient)


def _planning(rank: int, world: int) -> None:
    """Rank 0 traces and searches longer than the group's timeout: the other rank gets the
    plan, then rank 0's planning error."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    outcomes = iter(["the plan", ValueError("no plan fits the budget")])

    def slow_plan(**_):
        time.sleep(WORK_S)
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome, "the problem"

    auto._plan_here = slow_plan  # the trace and search, on rank 0 only
    agree.PATIENT_POLL_S = 0.5  # inside this group's timeout
    plan = functools.partial(
        auto.profile_and_plan, nn.Linear(2, 2), {}, gpu_budget_bytes=1 << 30, device="cpu",
        hardware=object(), process_group=group,
    )  # fmt: skip
    got, problem = plan()
    assert got == "the plan" and problem == ("the problem" if rank == 0 else None)
    with pytest.raises(ValueError, match="no plan fits the budget"):
        plan()
    del group


def test_planning_on_rank_zero_outlasts_the_collective_timeout():
    run_ranks(2, _planning)
