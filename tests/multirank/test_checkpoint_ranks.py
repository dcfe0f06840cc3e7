"""`protrain train` checkpoints resumed on another number of ranks and in another mode
(gloo on the CPU): 10 steps straight on one process against runs that save and resume
on 1, 2, 3, 2 and 1 ranks in turn, for both modes, full fine-tuning and LoRA.

Every step's global batch is the same 6 micro-batches however it is split (1 x 6, 2 x 3,
3 x 2: train/ranks.py); one process trains with plain PyTorch and writes the plain
checkpoint format, several ranks run the engine at different chunk sizes and write the
sharded format (train/checkpoint/sharded.py). The constant learning rate makes each
segment's `max_steps` change nothing but where it stops. Each segment is one job of
ranks forked from `rank_server.py`.
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

WINDOW = 6  # micro-batches per optimizer step, all ranks together
CHUNK = {2: "512KiB", 3: "384KiB"}  # multiples of 64 x world; layouts differ


def _config(run: Path, world: int, mode: str | None, kind: str, max_steps: int) -> Path:
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
        save_steps=max_steps,
        output_dir=str(run),
    )
    if kind == "lora":
        cfg["adapter"] = {"type": "lora", "r": 4, "dropout": 0.0}
    if world > 1:
        cfg["memory"] = {"n_persist": 1, "mode": mode, "chunk_size": CHUNK[world]}
    path = run.with_name(f"{run.name}-{max_steps}.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _weights(run: Path, kind: str) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    return load_file(run / "final" / name)


# world size and mode of each segment, and the step it ends at
CHAIN = [(1, None, 2), (2, "{mode}", 4), (3, "{mode}", 6), (2, "{mode}", 8), (1, None, 10)]


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """Run every chain, world size by world size: {(kind, mode): run dir}, and the
    one-process references {kind: run dir}; and, for the bitwise check, 2 sharded ranks
    straight against 2 sharded ranks resumed at step 5."""
    root = tmp_path_factory.mktemp("chains")
    runs = {(k, m): root / f"{k}-{m}" for k in ("full", "lora") for m in ("sharded", "replicated")}
    refs = {k: root / f"{k}-straight" for k in ("full", "lora")}
    same = {k: (root / f"{k}-2-straight", root / f"{k}-2-resumed") for k in ("full", "lora")}
    launches: list[tuple[int, list]] = []
    for i, (world, mode, end) in enumerate(CHAIN):
        segments = [
            (_config(run, world, mode and mode.format(mode=m), k, end), i > 0)
            for (k, m), run in runs.items()
        ]
        if i == 0:
            segments += [(_config(run, 1, None, k, 10), False) for k, run in refs.items()]
        if i == 1:
            for k, (straight, resumed) in same.items():
                segments.append((_config(straight, 2, "sharded", k, 10), False))
                segments.append((_config(resumed, 2, "sharded", k, 5), False))
        if i == 3:
            segments += [(_config(r, 2, "sharded", k, 10), True) for k, (_, r) in same.items()]
        launches.append((world, segments))
    server = RankServer()
    try:
        for world, segments in launches:
            for config, resume in segments:
                argv = ["train", str(config)] + (["--resume"] if resume else [])
                status = server.run(world, argv, config.with_suffix(""))
                assert status == [0] * world, _logs(root)
    finally:
        server.close()
    return runs, refs, same


def _logs(root: Path) -> str:
    newest = sorted(root.glob("*.log"), key=lambda p: p.stat().st_mtime)[-2:]
    return "\n".join(p.read_text()[-3000:] for p in newest)


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("mode", ["sharded", "replicated"])
def test_resume_on_1_2_3_2_1_ranks_equals_one_process(chains, kind, mode):
    runs, refs, _ = chains
    run, ref = runs[(kind, mode)], refs[kind]
    assert _losses(run) == pytest.approx(_losses(ref), rel=1e-6, abs=1e-6)
    assert len(_losses(run)) == 10
    got, want = _weights(run, kind), _weights(ref, kind)
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-6, msg=name)
    formats = {
        p.name: json.loads((p / "manifest.json").read_text()).get("format", "plain")
        for p in run.iterdir()
        if p.name.startswith("checkpoint-")
    }
    assert formats == {
        "checkpoint-2": "plain",
        "checkpoint-4": "sharded",
        "checkpoint-6": "sharded",
        "checkpoint-8": "sharded",
        "checkpoint-10": "plain",
    }


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_resume_on_as_many_ranks_is_bitwise(chains, kind):
    _, _, same = chains
    straight, resumed = same[kind]
    assert _losses(resumed) == _losses(straight)
    got, want = _weights(resumed, kind), _weights(straight, kind)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
