"""The multi-node launch of the docs (docs/multinode.md), on one machine: two `torchrun`
launchers on localhost, one process each, meet through a c10d rendezvous as two gloo
"nodes", train and save; the run then resumes on one node (one process) with the same
global batch and ends where the two nodes would have.

The two nodes share this machine's file system, as the nodes of a cluster must share
output_dir (every rank writes its own part of a checkpoint).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.multirank.test_train_ranks import _free_port, _losses
from tests.train.helpers import tiny_config, write_config

pytestmark = pytest.mark.slow  # two launchers and a resume: about a minute on 2 cores


def _launch_node(config: Path, port: int, log: Path) -> subprocess.Popen:
    """One node's launcher, as docs/multinode.md writes it (one process a node here)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    cmd += ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "protrain-test"]
    cmd += ["-m", "protrain", "train", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _two_nodes(config: Path, tmp_path: Path) -> str:
    port = _free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [_launch_node(config, port, log) for log in logs]
    try:
        for node in nodes:
            node.wait(timeout=300)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    text = "\n".join(log.read_text() for log in logs)
    assert [n.returncode for n in nodes] == [0, 0], text[-4000:]
    return text


def test_two_nodes_train_and_save_then_one_node_resumes(tmp_path):
    # 2 nodes x 1 rank x accumulation 1 x 2 rows = 4 rows a step; checkpoints at 2 and 4
    common = dict(sequence_len=32, micro_batch_size=2, max_steps=4, save_steps=2)
    memory = {"n_persist": 1, "n_buffer": 2}  # the engine, offloading: sharded checkpoints
    nodes_cfg = tiny_config(
        tmp_path, **common, gradient_accumulation_steps=1, memory=memory,
        output_dir=str(tmp_path / "nodes"),
    )  # fmt: skip
    out = _two_nodes(write_config(tmp_path, nodes_cfg, "nodes.yaml"), tmp_path)
    assert out.count("done: 4 steps") == 1, "the job's rank 0 alone reports"
    nodes = tmp_path / "nodes"
    assert {p.name for p in (nodes / "checkpoint-2").iterdir()} >= {"state.json"}

    # one node, one process, from checkpoint-2: accumulation 2 keeps the global batch
    one = tmp_path / "one"
    one.mkdir()
    shutil.copytree(nodes / "checkpoint-2", one / "checkpoint-2")
    shutil.copy(nodes / "config.yaml", one / "config.yaml")
    shutil.copy(nodes / "metrics.jsonl", one / "metrics.jsonl")
    one_cfg = {**nodes_cfg, "gradient_accumulation_steps": 2, "output_dir": str(one)}
    cmd = [sys.executable, "-m", "protrain", "train", "--resume"]
    cmd.append(str(write_config(tmp_path, one_cfg, "one.yaml")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resumed from" in done.stderr and "checkpoint-2 at step 2" in done.stderr

    # steps 3 and 4 on one process are the two nodes' steps 3 and 4
    assert _losses(one) == pytest.approx(_losses(nodes), rel=1e-5)
    want = load_file(nodes / "final" / "model.safetensors")
    got = load_file(one / "final" / "model.safetensors")
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=name)
