"""Checkpoints written on four ranks resumed on two and on one, and one written on two
resumed on four (gloo on the CPU): `protrain train` in segments against
one process trained straight through, to 1e-6.

Every step's global batch is 4 micro-batches however it is split (1 x 4, 2 x 2, 4 x 1);
several ranks run the engine in the sharded mode with one persistent chunk and write the
sharded format, at a chunk size per world size, so that the layouts differ between save
and load. The same chains ran on four GPUs (NCCL) in `benchmarks/resume_ranks.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tests.train.helpers import tiny_config

from .rank_server import RankServer

WINDOW = 4
CHUNK = {2: "512KiB", 4: "256KiB"}
STEPS = 2  # a segment's optimizer steps
CHAINS = {"4-2-1": (4, 2, 1), "2-4": (2, 4)}


def _config(run: Path, world: int, end: int) -> Path:
    cfg = tiny_config(
        run.parent,
        micro_batch_size=1,
        sequence_len=32,
        gradient_accumulation_steps=WINDOW // world,
        max_steps=end,
        lr_scheduler="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        save_steps=end,
        output_dir=str(run),
    )
    if world > 1:
        cfg["memory"] = {"n_persist": 1, "mode": "sharded", "chunk_size": CHUNK[world]}
    path = run.with_name(f"{run.name}-{end}.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{chain name: (chain's run dir, its straight reference's run dir)}"""
    root = tmp_path_factory.mktemp("four")
    server = RankServer()
    out = {}
    try:
        for name, chain in CHAINS.items():
            total = STEPS * len(chain)
            ref = root / f"straight-{name}"
            status = server.run(1, ["train", str(_config(ref, 1, total))], ref)
            assert status == [0], (root / f"{ref.name}").with_suffix(".log")
            run = root / f"chain-{name}"
            for i, world in enumerate(chain):
                config = _config(run, world, STEPS * (i + 1))
                argv = ["train", str(config)] + (["--resume"] if i else [])
                status = server.run(world, argv, config.with_suffix(""))
                assert status == [0] * world, _logs(root)
            out[name] = run, ref
    finally:
        server.close()
    return out


def _logs(root: Path) -> str:
    newest = sorted(root.glob("*.log"), key=lambda p: p.stat().st_mtime)[-2:]
    return "\n".join(p.read_text()[-3000:] for p in newest)


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chain_equals_one_process(runs, name):
    run, ref = runs[name]
    chain = CHAINS[name]
    assert len(_losses(run)) == STEPS * len(chain)
    assert _losses(run) == pytest.approx(_losses(ref), rel=1e-6, abs=1e-6)
    got = load_file(run / "final" / "model.safetensors")
    want = load_file(ref / "final" / "model.safetensors")
    assert set(got) == set(want)
    for key, w in want.items():
        torch.testing.assert_close(got[key], w, rtol=1e-6, atol=1e-6, msg=key)
    formats = {
        p.name: json.loads((p / "manifest.json").read_text()).get("format", "plain")
        for p in run.iterdir()
        if p.name.startswith("checkpoint-")
    }
    want_formats = {
        f"checkpoint-{STEPS * (i + 1)}": "plain" if w == 1 else "sharded"
        for i, w in enumerate(chain)
    }
    assert formats == want_formats
