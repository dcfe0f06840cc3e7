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


def test_a_ready_task_runs_before_a_more_urgent_one_that_is_not():
    """An update whose gradients are still being copied does not hold back one whose
    gradients are on the host; once it is ready, it runs."""
    worker = HostWorker(1)
    gate, landed, ran = threading.Event(), threading.Event(), []
    worker.submit(gate.wait)
    first = worker.submit(ran.append, "rank-0", priority=0, ready=landed.is_set)
    second = worker.submit(ran.append, "rank-1", priority=1, ready=lambda: True)
    gate.set()
    second.result(timeout=10)
    assert ran == ["rank-1"] and not first.done()
    landed.set()
    first.result(timeout=10)
    assert ran == ["rank-1", "rank-0"]
    worker.shutdown()


def test_an_engine_left_open_at_exit_does_not_abort_the_process(tmp_path):
    """The worker is a daemon thread; an interpreter exit with updates queued runs them
    first (a thread killed inside a torch kernel aborts the process)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "leave_open.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "import protrain\n"
        "from engine.models import batches, build\n"
        "model, opt, _ = protrain.wrap(build('llama'), n_persist=0, lr=1e-2, device='cpu')\n"
        "model(**batches('llama', 1)[0]).loss.backward()\n"
        "opt.step()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
