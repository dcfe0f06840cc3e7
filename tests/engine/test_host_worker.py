"""The host worker runs queued tasks lowest priority first, ties in submission order."""

from __future__ import annotations

import threading

import pytest

from protrain.runtime.host_worker import LAST, URGENT, HostWorker


def test_queued_tasks_run_by_priority_then_submission_order():
    worker = HostWorker(1)
    gate, ran = threading.Event(), []
    worker.submit(gate.wait)  # holds the thread while the queue fills
    futures = [
        worker.submit(ran.append, name, priority=p)
        for name, p in [
            ("update-3", 3),
            ("barrier", LAST),
            ("update-1", 1),
            ("acc-a", URGENT),
            ("update-2", 2),
            ("acc-b", URGENT),
            ("update-1b", 1),
        ]  # fmt: skip
    ]
    gate.set()
    for f in futures:
        f.result(timeout=10)
    assert ran == ["acc-a", "acc-b", "update-1", "update-1b", "update-2", "update-3", "barrier"]
    worker.shutdown()


def test_errors_reach_the_future_and_the_worker_goes_on():
    worker = HostWorker(1)

    def boom():
        raise ValueError("host task failed")

    bad = worker.submit(boom)
    good = worker.submit(lambda: 7)
    with pytest.raises(ValueError, match="host task failed"):
        bad.result(timeout=10)
    assert good.result(timeout=10) == 7
    worker.barrier()
    worker.shutdown()


def test_shutdown_runs_what_is_queued_and_refuses_more():
    worker = HostWorker(1)
    gate, ran = threading.Event(), []
    worker.submit(gate.wait)
    queued = [worker.submit(ran.append, i) for i in range(3)]
    gate.set()
    worker.shutdown(wait=True)
    assert ran == [0, 1, 2] and all(f.done() for f in queued)
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)
