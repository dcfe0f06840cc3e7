"""Auto mode's host budget when none is given: 90% of what the kernel reports available,
since pinned host memory past the machine's ends the process without an error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from protrain.plan import NoPlanFits
from protrain.plan import auto as auto_mod
from protrain.plan.host_budget import SHARE, available_host_bytes, default_cpu_budget

sys.path.insert(0, str(Path(__file__).parent.parent / "profile"))
import plan_synthetic as syn  # noqa: E402
import tiny_llama  # noqa: E402

MEMINFO = "MemTotal:       263741864 kB\nMemFree:        1000 kB\nMemAvailable:   262144 kB\n"


def test_available_memory_is_read_from_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text(MEMINFO)
    assert available_host_bytes(info) == 262144 * 1024
    assert default_cpu_budget(info) == int(262144 * 1024 * SHARE)
    info.write_text("MemTotal:       263741864 kB\n")  # an old kernel without the line
    assert available_host_bytes(info) is None and default_cpu_budget(info) is None
    assert default_cpu_budget(tmp_path / "absent") is None


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="MemAvailable is Linux's")
def test_this_host_reports_its_available_memory():
    avail = available_host_bytes()
    assert avail is not None and avail > 0


def _auto(**kwargs):
    return auto_mod.profile_and_plan(
        tiny_llama.build(seed=4),
        tiny_llama.batch(),
        gpu_budget_bytes="2.5MB",  # offloads chunks and swaps blocks: host memory used
        device="cpu",
        hardware=syn.hardware("cpu"),
        **kwargs,
    )


def test_auto_mode_plans_within_the_default_host_budget(monkeypatch):
    free, _ = _auto(cpu_budget_bytes=1 << 40)
    assert free.predicted_host_bytes > 0
    monkeypatch.setattr(auto_mod, "default_cpu_budget", lambda: free.predicted_host_bytes)
    plan, problem = _auto()
    assert problem.cpu_budget_bytes == free.predicted_host_bytes == plan.cpu_budget_bytes
    assert plan.predicted_host_bytes <= problem.cpu_budget_bytes
    # Too little host memory for any plan: the error says the budget was the default and
    # how to change it.
    monkeypatch.setattr(auto_mod, "default_cpu_budget", lambda: 1)
    with pytest.raises(NoPlanFits, match="no plan fits the host budget.*set cpu_budget"):
        _auto()
    # A budget the user gave is kept, and its error is the search's own.
    with pytest.raises(NoPlanFits, match="no plan fits the host budget") as err:
        _auto(cpu_budget_bytes=1)
    assert "No cpu_budget was given" not in str(err.value)
