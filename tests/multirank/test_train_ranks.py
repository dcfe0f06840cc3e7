"""`protrain train` under torchrun on CPU processes (gloo): the same training as one process,
and a rank that dies ends the job.

Two ranks with accumulation A train on the same global batch as one process with
accumulation 2A (train/ranks.py): rank r takes micro-batches r, r + 2, ... of each step,
and the engine sums the gradients over ranks. One process runs plain PyTorch (no memory
knobs); the ranks run the engine, in both modes, with offloaded chunks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.train.helpers import QUICKSTART_DATA, tiny_config, write_config

STEPS = 4


def _torchrun(n: int, config: Path, *extra: str, script: str | None = None, env_extra=None, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n)]
    cmd += ["--master-port", str(_free_port())]
    cmd += [script] if script else ["-m", "protrain"]
    cmd += ["train", str(config), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen(cmd, env=env, text=True, **kw)


def _output(n: int, config: Path, timeout_s: float, **kw) -> tuple[int, str]:
    """The exit status and the combined output of a `torchrun` of `n` ranks (killed past
    `timeout_s`)."""
    proc = _torchrun(n, config, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _config(tmp_path: Path, name: str, accum: int, clip: bool = True, **memory) -> Path:
    cfg = tiny_config(
        tmp_path,
        gradient_accumulation_steps=accum,
        max_steps=STEPS,
        max_grad_norm=1.0 if clip else None,
        save_steps=2,
        output_dir=str(tmp_path / name),
    )
    if memory:
        cfg["memory"] = memory
    return write_config(tmp_path, cfg, f"{name}.yaml")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process plain PyTorch run, with and without clipping."""
    runs = {}

    def run(clip: bool, accum: int = 4) -> Path:
        if (clip, accum) not in runs:
            tmp = tmp_path_factory.mktemp("one")
            config = _config(tmp, "one", accum, clip=clip)
            cmd = [sys.executable, "-m", "protrain", "train", str(config)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[(clip, accum)] = tmp / "one"
        return runs[(clip, accum)]

    return run


@pytest.mark.parametrize(
    "world,mode,clip",
    [(2, "sharded", True), (2, "replicated", True), (2, "sharded", False), (3, "sharded", True)],
)
def test_ranks_train_as_one_process(tmp_path, one_process, world, mode, clip):
    """Without clipping the engine starts host updates inside the last backward
    (step_in_backward), and the non-finite check reads the norm over every rank. Three
    ranks split each chunk into shards that cut parameters unevenly."""
    one_process = one_process(clip, 2 * world)
    config = _config(tmp_path, mode, 2, clip=clip, n_persist=1, n_buffer=2, mode=mode)
    proc = _torchrun(world, config, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("done: 4 steps") == 1, "rank 0 alone reports"
    run = tmp_path / mode
    assert _losses(run) == pytest.approx(_losses(one_process), rel=1e-5)
    want = load_file(one_process / "final" / "model.safetensors")
    got = load_file(run / "final" / "model.safetensors")
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=name)
    # the checkpoints are sharded (every rank wrote its part); the last one, converted to the
    # one-process format, equals the exported model
    from protrain.train.checkpoint.convert import convert_checkpoint

    last = load_file(
        convert_checkpoint(run / "checkpoint-4", tmp_path / "plain") / "model.safetensors"
    )
    for name, w in got.items():
        torch.testing.assert_close(last[name], w, rtol=0, atol=0, msg=name)


def test_a_killed_rank_ends_the_job(tmp_path):
    config = _config(tmp_path, "killed", 1, n_persist=1, n_buffer=2)
    cfg_text = config.read_text().replace("max_steps: 4", "max_steps: 100000")
    config.write_text(cfg_text)
    log = tmp_path / "torchrun.log"
    with log.open("w") as f:
        proc = _torchrun(2, config, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "step 3/" not in log.read_text():
            time.sleep(0.5)
        assert "step 3/" in log.read_text(), log.read_text()[-3000:]
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        t0 = time.monotonic()
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        ended_s = time.monotonic() - t0
    text = log.read_text()
    assert proc.returncode != 0
    assert ended_s < 60, ended_s
    assert all(not _alive(pid) for pid in workers)
    assert "Signal 9 (SIGKILL)" in text or "exitcode  : -9" in text, text[-3000:]


@pytest.mark.parametrize("kind", ["runtime", "data"])
def test_a_rank_that_raises_ends_the_job_with_its_message(tmp_path, kind):
    """A traceback, or for a user error one `error:` line, from the rank that failed (here
    rank 1, not a node's local rank 0: its own error is printed all the same)."""
    config = _config(tmp_path, "raises", 1, n_persist=1, n_buffer=2)
    config.write_text(config.read_text().replace("max_steps: 4", "max_steps: 100000"))
    script = str(Path(__file__).with_name("raise_on_rank.py"))
    t0 = time.monotonic()
    code, out = _output(2, config, 240, script=script, env_extra={"RAISE_ON_RANK": kind})
    assert code != 0
    assert "rank 1 failed on purpose at step 3" in out, out[-3000:]
    if kind == "data":
        assert out.count("error: rank 1 failed on purpose at step 3") == 1, out[-3000:]
    assert "step 3/" not in out  # rank 0 did not go on without it
    assert time.monotonic() - t0 < 240


@pytest.mark.parametrize("problem", ["config", "output_dir", "wrap_class", "data"])
def test_an_error_every_rank_has_is_printed_once(tmp_path, problem):
    """A bad config (every rank reads it alike, before the ranks start), rank 0's verdict
    on output_dir (agreed to every rank), a check every rank makes alike of the same
    model (an FSDP2 wrap class it lacks), and a bad row (every rank checks every row):
    one `error:` line for the job, not one a rank."""
    config = _config(tmp_path, "alike", 1)
    if problem == "data":
        rows = tmp_path / "rows.jsonl"
        rows.write_text(QUICKSTART_DATA.read_text() + '{"messages": 5}\n')
        config.write_text(config.read_text().replace(str(QUICKSTART_DATA), str(rows)))
        expect = "field 'messages': must be a list of messages, got int"
    elif problem == "config":
        config.write_text(config.read_text().replace("micro_batch_size: ", "micro_batch_size: -"))
        expect = "micro_batch_size = -"
    elif problem == "wrap_class":
        fsdp = "fsdp_version: 2\nfsdp_config:\n  transformer_layer_cls_to_wrap: NoSuchLayer\n"
        config.write_text(config.read_text() + fsdp)
        expect = "no module of class NoSuchLayer in LlamaForCausalLM; its layer class: "
    else:
        (tmp_path / "alike" / "final").mkdir(parents=True)  # a finished run is there
        expect = "already holds a training run"
    code, out = _output(2, config, 180)
    assert code != 0
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expect in errors[0], out[-3000:]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )
