"""`protrain plan` for an FSDP2 config under torchrun (2 gloo ranks): every rank measures
its own peak through the FSDP2 engine, rank 0 prints the largest once, and with
`--gpu-budget` the chunk engine's plan for the same ranks follows, once."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.train.helpers import tiny_config, write_config

from .test_train_ranks import _free_port

WORLD = 2


def test_plan_on_two_ranks_prints_the_largest_peak_once(tmp_path):
    fsdp = {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10_000}
    raw = tiny_config(
        tmp_path, fsdp_version=2, fsdp_config=fsdp, sequence_len=32, gradient_accumulation_steps=1
    )
    config = write_config(tmp_path, raw)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--master-port", str(_free_port()), "-m", "protrain", "plan", str(config),
           "--gpu-budget", "64MiB"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("FSDP2 engine: peak per rank") == 1, out
    assert f"the largest of {WORLD} ranks; tensor bytes counted on the CPU" in out
    assert out.count("Plan: ") == 1, out
    assert f"per rank, {WORLD} ranks" in out
    assert out.index("FSDP2 engine") < out.index("Plan: ")
    assert not (tmp_path / "run").exists()
