"""`memory.auto` and `protrain plan` under torchrun (gloo, CPU): the first rank plans for
every rank, the run trains as one process does, and the plan is printed once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .test_train_ranks import _config, _free_port, _losses, _torchrun
from .test_train_ranks import one_process as one_process  # noqa: F401 (a fixture)

WORLD = 2


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The hardware profile, measured by the ranks together once for the module."""
    path = str(tmp_path_factory.mktemp("hardware"))
    os.environ["PROTRAIN_CACHE_DIR"] = path  # inherited by the torchrun processes
    yield path
    del os.environ["PROTRAIN_CACHE_DIR"]


def test_auto_mode_on_two_ranks_trains_as_one_process(tmp_path, one_process, cache):
    one = one_process(True, 2 * WORLD)
    config = _config(tmp_path, "auto", 2, auto=True, gpu_budget="64MiB")
    proc = _torchrun(WORLD, config, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("memory plan:") == 1, "rank 0 alone logs the plan"
    assert f"per rank, {WORLD} ranks" in out
    assert _losses(tmp_path / "auto") == pytest.approx(_losses(one), rel=1e-5)
    rows = (tmp_path / "auto" / "metrics.jsonl").read_text()
    assert "plan_measured_peak_gib" in rows  # the check after the first steps ran


def test_plan_under_torchrun_prints_the_per_rank_plan_once(tmp_path, cache):
    config = _config(tmp_path, "plan", 2, auto=True, gpu_budget="64MiB", mode="replicated")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--master-port", str(_free_port()), "-m", "protrain", "plan", str(config)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Plan: ") == 1
    assert f"per rank, {WORLD} ranks, replicated mode" in done.stdout
    assert "best candidates:" in done.stdout
