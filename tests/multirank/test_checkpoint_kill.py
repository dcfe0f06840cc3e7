"""A rank killed (SIGKILL) at any moment of a sharded save loses nothing: the checkpoints
in place stay intact, and `--resume`, on as many ranks or on another number, ends on the
weights of an uninterrupted run. Ranks come from `rank_server.py`, which kills a chosen
rank just before it writes a chosen file and then ends the others, as torchrun does.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tests.train.helpers import tiny_config

import protrain.train.checkpoint as ckpt

from .rank_server import RankServer

STEPS = 4
WINDOW = 6  # micro-batches per step, all ranks together


@pytest.fixture(scope="module")
def server():
    s = RankServer()
    yield s
    s.close()


def _config(tmp_path: Path, name: str, world: int, mode: str = "sharded") -> Path:
    cfg = tiny_config(
        tmp_path,
        micro_batch_size=1,
        sequence_len=32,
        gradient_accumulation_steps=WINDOW // world,
        max_steps=STEPS,
        lr_scheduler="constant",
        warmup_steps=0,
        adam_epsilon=1e-6,
        max_grad_norm=1.0,
        save_steps=1,
        save_total_limit=2,
        output_dir=str(tmp_path / "run"),
    )
    if world > 1:
        cfg["memory"] = {"n_persist": 1, "mode": mode, "chunk_size": f"{128 * world}KiB"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def straight(server, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted run (2 sharded ranks)."""
    tmp = tmp_path_factory.mktemp("straight")
    status = server.run(2, ["train", str(_config(tmp, "a", 2))], tmp / "straight")
    assert status == [0, 0], _logs(tmp)
    return load_file(tmp / "run" / "final" / "model.safetensors")


def _logs(tmp: Path) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(tmp.glob("*.log")))


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if ckpt.CHECKPOINT_RE.match(p.name))


# (who dies, at which file, its nth write of it), the checkpoints left intact, where the
# resume runs
CASES = [
    ((1, "__1_0.distcp:3"), ["checkpoint-1", "checkpoint-2"], 2),  # mid-write, rank 1's data
    ((0, ".metadata:3"), ["checkpoint-1", "checkpoint-2"], 3),  # all data written, no metadata
    ((0, "state.json:3"), ["checkpoint-1", "checkpoint-2"], 1),
    ((0, "manifest.json:3"), ["checkpoint-1", "checkpoint-2"], 2),
    ((0, "checkpoint-3:1"), ["checkpoint-1", "checkpoint-2"], 2),  # verified, not renamed
    ((0, "_trash:1"), ["checkpoint-2", "checkpoint-3"], 2),  # checkpoint-1 half pruned
    ((1, "__1_0.distcp:2"), ["checkpoint-1"], 3),  # replicated mode
]


@pytest.mark.parametrize("kill,left,resume_world", CASES, ids=[c[0][1] for c in CASES])
def test_a_rank_killed_mid_save_leaves_a_resumable_checkpoint(
    server, straight, tmp_path, kill, left, resume_world
):
    mode = "replicated" if kill == CASES[-1][0] else "sharded"
    config = _config(tmp_path, "killed", 2, mode)
    status = server.run(2, ["train", str(config)], tmp_path / "killed", kill=kill)
    assert status[kill[0]] == -signal.SIGKILL, _logs(tmp_path)
    run = tmp_path / "run"
    assert _checkpoints(run) == left, sorted(p.name for p in run.iterdir())
    for name in left:
        assert ckpt.verify(run / name) is None, (name, ckpt.verify(run / name))
    assert not (run / "final").exists()

    config = _config(tmp_path, "resumed", resume_world, mode)
    status = server.run(resume_world, ["train", str(config), "--resume"], tmp_path / "resumed")
    assert status == [0] * resume_world, _logs(tmp_path)
    got = load_file(run / "final" / "model.safetensors")
    for name, want in straight.items():
        if resume_world == 2:  # the same split: the very same bits
            assert torch.equal(got[name], want), name
        else:
            torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6, msg=name)
    assert not [p for p in run.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    assert _checkpoints(run) == ["checkpoint-3", "checkpoint-4"]
    assert json.loads((run / "checkpoint-4" / "manifest.json").read_text()).get("format") == (
        "sharded" if resume_world > 1 else None
    )
