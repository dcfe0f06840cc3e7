"""The FSDP2 engine (`fsdp_version: 2`) in the resume matrix (gloo on the CPU):
10 steps straight against 5 steps on N ranks, a resume on M ranks and 5 more, for (N, M)
in (1, 2), (2, 1), (2, 3), (3, 2), full fine-tuning and LoRA: the same losses and weights
as one process of plain PyTorch trained straight through, to 1e-6; at N = M = 2 the very
same bits as two FSDP2 ranks trained straight through. And a rank killed (SIGKILL) in the
middle of a save leaves the checkpoint before it, which resumes to the same weights.

Every step's global batch is the same 6 micro-batches however it is split (1 x 6, 2 x 3,
3 x 2); one FSDP2 process writes the plain checkpoint format, several ranks the sharded
one (`protrain.distributed.fsdp2.checkpoint`). FSDP2's sums over ranks run in another order than
one process's accumulation: measured here, the largest differences are 7e-8 (relative,
losses) and 3e-7 (absolute, weights), well inside 1e-6. Ranks come from `rank_server.py`.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tests.train.helpers import tiny_config

import protrain.train.checkpoint as ckpt

from .rank_server import RankServer

WINDOW = 6  # micro-batches per optimizer step, all ranks together
PAIRS = [(1, 2), (2, 1), (2, 3), (3, 2), (2, 2)]
# (who dies, at which file, its nth write of it), where the resume runs
KILLS = [((1, "__1_0.distcp:2"), 2), ((0, ".metadata:2"), 3)]


def _config(run: Path, world: int, kind: str, max_steps: int, fsdp: bool = True) -> Path:
    cfg = tiny_config(
        run.parent,
        micro_batch_size=1,
        sequence_len=32,
        gradient_accumulation_steps=WINDOW // world,
        max_steps=max_steps,
        lr_scheduler="constant",
        warmup_steps=0,
        adam_epsilon=1e-6,
        max_grad_norm=1.0,
        save_steps=5,
        output_dir=str(run),
    )
    if kind == "lora":
        cfg["adapter"] = {"type": "lora", "r": 4, "dropout": 0.0}
    if fsdp:
        cfg.update(fsdp_version=2, fsdp_config={"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    path = run.with_name(f"{run.name}-{max_steps}.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _weights(run: Path, kind: str) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    return load_file(run / "final" / name)


def _log(config: Path) -> str:
    return config.with_name(f"{config.stem}.rank0.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{(kind, name): run dir}: "plain" (one process, straight), "straight" (2 FSDP2 ranks),
    "N-M" (5 steps on N ranks, resumed on M), "killed-r" (killed in the save of step 10,
    resumed)."""
    root = tmp_path_factory.mktemp("fsdp2-resume")
    server = RankServer()
    out: dict = {}

    def run(world: int, config: Path, resume: bool = False, **kw) -> list[int]:
        argv = ["train", str(config)] + (["--resume"] if resume else [])
        return server.run(world, argv, config.with_suffix(""), **kw)

    try:
        for kind in ("full", "lora"):
            out[kind, "plain"] = root / f"{kind}-plain"
            config = _config(out[kind, "plain"], 1, kind, 10, fsdp=False)
            assert run(1, config) == [0], _log(config)
            out[kind, "straight"] = root / f"{kind}-straight"
            config = _config(out[kind, "straight"], 2, kind, 10)
            assert run(2, config) == [0, 0], _log(config)
            firsts = {}
            for n in sorted({n for n, _ in PAIRS}):
                firsts[n] = root / f"{kind}-first{n}"
                config = _config(firsts[n], n, kind, 5)
                assert run(n, config) == [0] * n, _log(config)
            for n, m in PAIRS:
                resumed = out[kind, f"{n}-{m}"] = root / f"{kind}-{n}-{m}"
                shutil.copytree(firsts[n], resumed)
                shutil.rmtree(resumed / "final")
                config = _config(resumed, m, kind, 10)
                assert run(m, config, resume=True) == [0] * m, _log(config)
        for kill, world in KILLS:  # full fine-tuning
            killed = out["killed", world] = root / f"killed-{world}"
            config = _config(killed, 2, "full", 10)
            status = run(2, config, kill=kill)
            assert status[kill[0]] == -signal.SIGKILL, _log(config)
            left = sorted(p.name for p in killed.iterdir() if ckpt.CHECKPOINT_RE.match(p.name))
            assert left == ["checkpoint-5"], sorted(p.name for p in killed.iterdir())
            assert ckpt.verify(killed / "checkpoint-5") is None
            config = _config(killed, world, "full", 10)
            assert run(world, config, resume=True) == [0] * world, _log(config)
    finally:
        server.close()
    return out


def _assert_close(got: dict, want: dict, tol: float) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{n}-{m}" for n, m in PAIRS])
def test_resumed_on_another_number_of_ranks_equals_one_process(runs, kind, pair):
    resumed = runs[kind, "{}-{}".format(*pair)]
    plain = runs[kind, "plain"]
    losses = _losses(resumed)
    assert len(losses) == 10
    assert losses == pytest.approx(_losses(plain), rel=1e-6, abs=1e-6)
    _assert_close(_weights(resumed, kind), _weights(plain, kind), 1e-6)
    formats = {
        p.name: json.loads((p / "manifest.json").read_text()).get("format", "plain")
        for p in resumed.iterdir()
        if ckpt.CHECKPOINT_RE.match(p.name)
    }
    n, m = pair
    assert formats == {
        "checkpoint-5": "sharded" if n > 1 else "plain",
        "checkpoint-10": "sharded" if m > 1 else "plain",
    }
    if pair == (2, 2):  # the same split as the straight run: the very same bits
        straight = runs[kind, "straight"]
        assert losses == _losses(straight)
        for name, w in _weights(straight, kind).items():
            assert torch.equal(_weights(resumed, kind)[name], w), name


@pytest.mark.parametrize("world", [w for _, w in KILLS])
def test_a_rank_killed_mid_save_resumes_from_the_checkpoint_before(runs, world):
    got = _weights(runs["killed", world], "full")
    if world == 2:  # as the straight run of two ranks, bit for bit
        for name, w in _weights(runs["full", "straight"], "full").items():
            assert torch.equal(got[name], w), name
    else:
        _assert_close(got, _weights(runs["full", "plain"], "full"), 1e-6)
