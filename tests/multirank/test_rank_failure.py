"""A rank that fails or is killed under torchrun (gloo, CPU): every node ends with one line
(which rank, what happened, the newest intact checkpoint, the command that resumes), and
the surviving ranks print no traceback of their failed collective
(`protrain/train/rank_failure.py`). Each rank's own output is read from torchrun's log
files (`--log-dir --tee 3`); the console also holds torchrun's own report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.train.helpers import tiny_config, write_config

from .test_train_ranks import _children, _free_port

TRACEBACK = "Traceback (most recent call last)"


def _start(config: Path, log_dir: Path, console: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(_free_port()), "--log-dir", str(log_dir), "--tee", "3"]
    cmd += ["-m", "protrain", "train", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with console.open("w") as f:
        return subprocess.Popen(cmd, env=env, text=True, stdout=f, stderr=subprocess.STDOUT)


def _stderr(log_dir: Path, local_rank: int) -> str:
    (path,) = log_dir.glob(f"**/attempt_0/{local_rank}/stderr.log")
    return path.read_text()


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _config(tmp_path: Path, **overrides) -> Path:
    cfg = tiny_config(
        tmp_path,
        gradient_accumulation_steps=1,
        output_dir=str(tmp_path / "run"),
        memory={"n_persist": 1, "n_buffer": 2},
        **overrides,
    )
    return write_config(tmp_path, cfg)


def _wait(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_error_of_rank_0_alone_ends_rank_1_without_a_traceback(tmp_path):
    """output_dir is a file: rank 0 alone finds it (it takes the run's lock) while rank 1
    waits in a collective; rank 0 prints the one line, rank 1 nothing."""
    config = _config(tmp_path)
    (tmp_path / "run").write_text("not a folder")
    proc = _start(config, tmp_path / "logs", tmp_path / "console.log")
    assert _wait(proc, 180) != 0
    first, second = _stderr(tmp_path / "logs", 0), _stderr(tmp_path / "logs", 1)
    assert _errors(first) == [f"error: output_dir {str(tmp_path / 'run')!r} is a file, not a directory (rank 0)"], first[-3000:]  # fmt: skip
    assert TRACEBACK not in first, first[-3000:]
    assert second.strip() == "", second[-3000:]  # its node's line is rank 0's
    assert "exitcode  : 3" in (tmp_path / "console.log").read_text()  # rank 1's documented code


def test_a_killed_rank_leaves_one_line_and_no_traceback(tmp_path):
    """Rank 1 killed with SIGKILL after a checkpoint: the survivor says which rank ended,
    the newest intact checkpoint and the command that resumes, in one line."""
    config = _config(tmp_path, max_steps=100000, save_steps=2)
    console = tmp_path / "console.log"
    proc = _start(config, tmp_path / "logs", console)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and "step 3/" not in console.read_text():
        time.sleep(0.5)
    assert "step 3/" in console.read_text(), console.read_text()[-3000:]
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    assert _wait(proc, 60) != 0
    survivor = _stderr(tmp_path / "logs", 0)
    (line,) = _errors(survivor)
    assert line.startswith(f"error: rank 1 (pid {workers[-1]}) ended without an error"), line
    assert "killed" in line and "is the newest intact checkpoint" in line, line
    assert f"{tmp_path / 'run'}/checkpoint-" in line, line
    assert line.endswith(f"torchrun --nproc-per-node 2 -m protrain train {config} --resume"), line
    assert TRACEBACK not in survivor, survivor[-3000:]
