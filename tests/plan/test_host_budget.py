"""Auto mode's host budget when none is given: 90% of what the kernel reports available,
since pinned host memory past the machine's ends the process without an error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from protrain.plan import NoPlanFits, PlanRequest
from protrain.plan import auto as auto_mod
from protrain.plan.host_budget import (
    SHARE,
    available_host_bytes,
    cgroup_available_bytes,
    default_cpu_budget,
    meminfo_available_bytes,
)

sys.path.insert(0, str(Path(__file__).parent.parent / "profile"))
import plan_synthetic as syn  # noqa: E402
import tiny_llama  # noqa: E402

MEMINFO = "MemTotal:       263741864 kB\nMemFree:        1000 kB\nMemAvailable:   262144 kB\n"


def _no_cgroup(tmp_path):
    return {"fs": tmp_path / "nofs", "proc_cgroup": tmp_path / "no-cgroup"}


def test_available_memory_is_read_from_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text(MEMINFO)
    none = _no_cgroup(tmp_path)
    assert available_host_bytes(info, **none) == 262144 * 1024
    assert default_cpu_budget(info, **none) == int(262144 * 1024 * SHARE)
    for text in ("MemTotal:       263741864 kB\n", "MemAvailable: lots\n", "MemAvailable:\n"):
        info.write_text(text)  # an old kernel without the line, or one we cannot read
        assert meminfo_available_bytes(info) is None
        assert default_cpu_budget(info, **none) is None
    assert default_cpu_budget(tmp_path / "absent", **none) is None


def _cgroup(tmp_path, files: dict[str, str], proc: str):
    fs = tmp_path / "cgroup"
    for name, text in files.items():
        (fs / name).parent.mkdir(parents=True, exist_ok=True)
        (fs / name).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return fs, tmp_path / "proc_cgroup"


def test_a_memory_cgroup_bounds_it(tmp_path):
    """In a container the node's MemAvailable is not what the process may take: the least
    room over its cgroup and those above it is."""
    gib = 1 << 30
    fs, proc = _cgroup(tmp_path, {  # cgroup v2: the job 8 GiB of 10, its parent 30 of 40
        "memory.max": "max", "memory.current": "1",
        "slurm/memory.max": str(40 * gib), "slurm/memory.current": str(30 * gib),
        "slurm/job1/memory.max": str(10 * gib), "slurm/job1/memory.current": str(3 * gib),
        # a GiB of the job's usage is file cache the kernel reclaims first: not counted
        "slurm/job1/memory.stat": f"anon {2 * gib}\ninactive_file {gib}\nactive_file 5\n",
    }, "0::/slurm/job1\n")  # fmt: skip
    assert cgroup_available_bytes(fs, proc) == 8 * gib
    info = tmp_path / "meminfo"
    info.write_text(MEMINFO.replace("262144 kB", f"{100 * gib // 1024} kB"))
    assert available_host_bytes(info, fs, proc) == 8 * gib
    (fs / "slurm/job1/memory.max").write_text("max")  # now the parent is the tighter
    assert cgroup_available_bytes(fs, proc) == 10 * gib
    fs1, proc1 = _cgroup(tmp_path / "v1", {  # cgroup v1, "no limit" written as a huge number
        "memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "5",
        "memory/job/memory.limit_in_bytes": str(6 * gib), "memory/job/memory.usage_in_bytes": "0",
    }, "4:memory:/job\n3:cpuset:/\n")  # fmt: skip
    assert cgroup_available_bytes(fs1, proc1) == 6 * gib
    (fs1 / "memory/job/memory.limit_in_bytes").write_text("9223372036854771712")
    assert cgroup_available_bytes(fs1, proc1) is None  # no level limits it
    assert available_host_bytes(info, fs1, proc1) == 100 * gib


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="MemAvailable is Linux's")
def test_this_host_reports_its_available_memory():
    avail = available_host_bytes()
    assert avail is not None and avail > 0


def _auto(cpu_budget_bytes=None):
    request = PlanRequest(
        "2.5MB",  # offloads chunks and swaps blocks: host memory used
        cpu_budget_bytes,
        sample_batch=tiny_llama.batch(),
    )
    return auto_mod.profile_and_plan(
        tiny_llama.build(seed=4), request, device="cpu", hardware=syn.hardware("cpu")
    )


def test_auto_mode_plans_within_the_default_host_budget(monkeypatch):
    free, _ = _auto(cpu_budget_bytes=1 << 40)
    assert free.predicted_host_bytes > 0
    budget = free.predicted_host_bytes - 1  # the fastest plan no longer fits the host
    monkeypatch.setattr(auto_mod, "default_cpu_budget", lambda: budget)
    plan, problem = _auto()
    assert problem.cpu_budget_bytes == budget == plan.cpu_budget_bytes
    assert plan.predicted_host_bytes <= budget and plan.knobs != free.knobs
    # Too little host memory for any plan: the error says the budget was the default and
    # how to change it.
    monkeypatch.setattr(auto_mod, "default_cpu_budget", lambda: 1)
    with pytest.raises(NoPlanFits, match="no plan fits the host budget.*set cpu_budget") as err:
        _auto()
    assert err.value.kind == "host"
    # the least host memory a plan that fits the GPU needs, not a plan that does not fit
    need = int(str(err.value).split(" GiB (")[1].split(" bytes)")[0])
    assert 0 < need <= free.predicted_host_bytes
    # A budget the user gave is kept, and its error is the search's own.
    with pytest.raises(NoPlanFits, match="no plan fits the host budget") as err:
        _auto(cpu_budget_bytes=1)
    assert "No cpu_budget was given" not in str(err.value)


def test_the_budget_is_read_after_the_trace(monkeypatch):
    """The trace pins an arena of its own and gives it back: the budget is read after."""
    order = []
    real_profile = auto_mod.profile_model
    monkeypatch.setattr(auto_mod, "profile_model",
                        lambda *a, **k: order.append("trace") or real_profile(*a, **k))  # fmt: skip
    monkeypatch.setattr(auto_mod, "default_cpu_budget", lambda: order.append("budget") or None)
    _auto()
    assert order == ["trace", "budget"]


def test_a_host_failure_at_one_chunk_size_is_not_hidden_by_another_sizes_gpu_failure(
    monkeypatch,
):
    """Over the chunk-size candidates, a size whose plans fit the GPU but not the host says
    what to change (host memory); another size's "smallest GPU budget" would mislead."""
    from protrain.plan import chunk_size
    from protrain.plan.search import NoPlanFits as Fits

    calls = []

    def fake_search(problem, **kwargs):
        calls.append(problem)
        if len(calls) % 2:
            raise Fits("no plan fits the GPU budget", 123, kind="gpu")
        raise Fits("no plan fits the host budget", None, kind="host")

    monkeypatch.setattr(chunk_size, "search", fake_search)
    with pytest.raises(Fits) as err:
        _auto(cpu_budget_bytes=1 << 40)
    assert len(calls) > 1 and err.value.kind == "host"


def test_app_message_for_a_host_failure_names_the_host_budget():
    from protrain.train.planning import no_plan_fits_message

    class Settings:
        request = PlanRequest(24 << 30)

    exc = NoPlanFits("no plan fits the host budget of 9.00 GiB: ...", None, kind="host")
    text = no_plan_fits_message(exc, Settings())
    assert text.startswith("memory.cpu_budget (unset): no plan fits the host budget")
    assert "gpu_budget" not in text
    Settings.request = PlanRequest(24 << 30, 8 << 30)
    assert no_plan_fits_message(exc, Settings()).startswith("memory.cpu_budget = 8.00GiB: ")


def test_a_host_failure_names_the_least_host_memory_of_plans_that_fit_the_gpu():
    """Swept over host budgets: a host failure's figure is above the budget that failed, and
    planning with exactly that figure succeeds (the figure is exact, not a lower bound)."""
    from protrain.plan import PlanProblem, search

    _, problem = _auto(cpu_budget_bytes=1 << 40)
    free = search(PlanProblem(problem.profile, problem.hardware,
                              gpu_budget_bytes=problem.gpu_budget_bytes)).plan  # fmt: skip
    failures = 0
    for host in range(0, free.predicted_host_bytes, max(free.predicted_host_bytes // 40, 1)):
        at = PlanProblem(problem.profile, problem.hardware,
                         gpu_budget_bytes=problem.gpu_budget_bytes, cpu_budget_bytes=host)  # fmt: skip
        try:
            search(at)
            continue
        except NoPlanFits as exc:
            assert exc.kind == "host"
            least = exc.least_host_bytes
        failures += 1
        assert least > host
        ok = PlanProblem(problem.profile, problem.hardware,
                         gpu_budget_bytes=problem.gpu_budget_bytes, cpu_budget_bytes=least)  # fmt: skip
        assert search(ok).plan.predicted_host_bytes <= least
    assert failures > 0
