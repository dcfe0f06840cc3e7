"""Stop signals as launchers send them: SLURM and `systemctl stop` signal every process of
the job and torchrun forwards its own copy, so each worker gets the signal twice within
milliseconds ([Note: repeated signals] in stop_signals.py); the resume command printed
under torchrun; a signal during an evaluation stops the run at that step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import protrain.train.checkpoint as ckpt
from protrain.train.stop_signals import REPEAT_WINDOW_S, resume_command

from .helpers import run_script, signal_inside, tiny_config, write_config

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.02)


# -- 1. a repeat within the window is the same request; one after it ends at once ---------

_HOLDER = textwrap.dedent(
    """
    import time
    from protrain.train.stop_signals import StopSignals
    with StopSignals() as stops:
        print("ready", flush=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            time.sleep(0.01)
    """
)


def test_a_repeat_within_the_window_is_the_same_stop_and_a_later_one_ends_at_once(tmp_path):
    log = tmp_path / "log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER], cwd=ROOT, env=ENV, stdout=f, stderr=f
        )
        try:
            _wait_for(log, "ready", proc)
            os.kill(proc.pid, signal.SIGTERM)
            t0 = time.monotonic()
            _wait_for(log, "SIGTERM: stopping after this step", proc)
            # a launcher's copy, and another kind of the same request, inside the window
            os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.2)
            os.kill(proc.pid, signal.SIGINT)
            time.sleep(max(0.0, t0 + REPEAT_WINDOW_S + 0.5 - time.monotonic()))
            assert proc.poll() is None, log.read_text()
            os.kill(proc.pid, signal.SIGINT)  # after the window: at once
            assert proc.wait(timeout=10) == -signal.SIGINT
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert text.count("again within") == 1, text
    assert "SIGTERM again within 2 s: the same stop" in text


# -- 2. the resume command under torchrun -------------------------------------------------

_CLI = ["/venv/lib/python3.11/site-packages/protrain/__main__.py", "train", "c.yaml"]


def test_the_resume_command_keeps_the_launcher():
    assert resume_command(_CLI, {}) == "python -m protrain train c.yaml --resume"
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    torchrun["GROUP_WORLD_SIZE"] = "1"
    expected = "torchrun --nproc-per-node 4 -m protrain train c.yaml --resume"
    assert resume_command(_CLI, torchrun) == expected
    assert resume_command(["/venv/bin/protrain", "train", "c.yaml"], torchrun) == expected
    nodes = {**torchrun, "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}
    assert resume_command(_CLI, nodes) == (
        "torchrun --nnodes 2 --nproc-per-node 4 <your rendezvous options> "
        "-m protrain train c.yaml --resume, on each node"
    )
    other = {"WORLD_SIZE": "2"}  # ranks started by another launcher
    assert resume_command(_CLI, other) == (
        "your launcher's command for the 2 ranks, running: python -m protrain train c.yaml --resume"
    )
    assert resume_command(["script.py"], torchrun) == "train(cfg, resume=True)"


# -- 3. SIGTERM to torchrun and to every worker: saved, and resumed under torchrun --------


def _torchrun(config: Path, *extra: str, **kw) -> subprocess.Popen:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(port), "-m", "protrain", "train", str(config), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, text=True, **kw)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_to_every_process_of_a_torchrun_job_saves_and_resumes(tmp_path):
    cfg = tiny_config(
        tmp_path,
        micro_batch_size=1,
        sequence_len=32,
        gradient_accumulation_steps=3,
        max_steps=30,
        lr_scheduler="constant",
        warmup_steps=0,
        save_minutes=None,  # only the stop saves
        memory={"mode": "sharded", "n_persist": 1, "chunk_size": "512KiB"},
    )
    config = write_config(tmp_path, cfg)
    run = tmp_path / "run"
    log = tmp_path / "stop.log"
    with log.open("w") as f:
        proc = _torchrun(config, stdout=f, stderr=subprocess.STDOUT)
        try:
            _wait_for(log, "step 2/30", proc)
            workers = _children(proc.pid)
            assert len(workers) == 2, workers
            for pid in workers:  # as SLURM or systemd: every process, torchrun last
                os.kill(pid, signal.SIGTERM)
            # torchrun's copy once a worker's handler ran (both at once merge into one),
            # at once, as torchrun forwards it. Not after both: the first handler's wait
            # holds that rank's collectives, so the other rank's handler runs only once
            # that wait is over, and on a loaded host the first window could end before
            # the second line appeared (a fresh clone's suite: 1 of 1; which no launcher's
            # copy waits for).
            deadline = time.monotonic() + 30
            while log.read_text().count("SIGTERM: stopping after this step") < 1:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    stopped = [line for line in text.splitlines() if "stopped by SIGTERM at step" in line]
    assert len(stopped) == 1, text[-4000:]  # rank 0 says it for the job
    # at least the rank whose handler ran saw the copy as a repeat (on the other it may
    # merge with its own signal, still pending behind the first rank's wait)
    assert text.count("SIGTERM again within 2 s: the same stop") >= 1, text[-4000:]
    step = int(stopped[0].split(" at step ")[1].split("/")[0])
    assert 2 <= step < 30
    checkpoint = run / f"checkpoint-{step}"
    assert f"saved in {checkpoint}" in stopped[0]
    assert ckpt.verify(checkpoint) is None
    command = f"torchrun --nproc-per-node 2 -m protrain train {config} --resume"
    assert stopped[0].endswith(f"resume with: {command}"), stopped[0]

    resumed = tmp_path / "resume.log"
    with resumed.open("w") as f:
        proc = _torchrun(config, "--resume", stdout=f, stderr=subprocess.STDOUT)
        try:
            assert proc.wait(timeout=120) == 0, resumed.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert f"resumed from {checkpoint}" in resumed.read_text()
    assert (run / "final" / "model.safetensors").is_file()


# -- 4. a signal during an evaluation stops the run at that step --------------------------

_SIGNAL_IN_EVAL = signal_inside(
    "evaluate", max_steps=6, micro_batch_size=2, gradient_accumulation_steps=1,
    val_set_size=0.05, eval={"steps": 2}, save_minutes=None,
)  # fmt: skip


def test_a_signal_during_an_evaluation_stops_at_that_step(tmp_path):
    proc = run_script(_SIGNAL_IN_EVAL, tmp_path, env=ENV)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "stopped by SIGTERM at step 2/6" in proc.stderr, proc.stderr[-3000:]
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2"
    ]
