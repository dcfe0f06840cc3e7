"""Several adapters on 2 CPU ranks (gloo, the chunk engine's sharded mode): the streamed
export writes the trained adapters alone, in peft's layout, with the weights one process
trains from the same global batch."""

import yaml
from safetensors.torch import load_file
from tests.multirank.rank_server import RankServer

from protrain.train.config import validate_config
from protrain.train.loop import train

from .helpers import tiny_config
from .test_multi_adapter import _frozen_adapter_dir, one_thread  # noqa: F401 (autouse)

WORLD = 2


def _config(tmp_path, name: str, world: int, old_dir) -> dict:
    cfg = tiny_config(
        tmp_path,
        micro_batch_size=1,
        sequence_len=32,
        gradient_accumulation_steps=WORLD // world,
        max_steps=2,
        output_dir=str(tmp_path / name),
        adapter={
            "type": "lora",
            "r": 4,
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "extra": [
                {"name": "style", "r": 2, "target_modules": ["o_proj"]},
                {"name": "old", "path": str(old_dir)},
            ],
        },
    )
    cfg["datasets"][0]["max_samples"] = 16
    if world > 1:
        cfg["memory"] = {"n_persist": 1, "mode": "sharded", "chunk_size": "256KiB"}
    return cfg


def test_two_ranks_export_the_trained_adapters_as_one_process(tmp_path):
    old_dir = _frozen_adapter_dir(tmp_path)
    one = train(validate_config(_config(tmp_path, "one", 1, old_dir)))
    path = tmp_path / "ranks.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, "ranks", WORLD, old_dir)))
    server = RankServer()
    try:
        status = server.run(WORLD, ["train", str(path)], tmp_path / "ranks-log")
    finally:
        server.close()
    log = (tmp_path / "ranks-log.rank0.log").read_text()
    assert status == [0] * WORLD, log[-3000:]
    assert "not streamed" not in log, log[-3000:]

    final = tmp_path / "ranks" / "final"
    assert sorted(p.name for p in final.iterdir() if p.is_dir()) == ["base_model", "style"]
    for sub in ("", "style"):
        want = load_file(one.final_dir / sub / "adapter_model.safetensors")
        got = load_file(final / sub / "adapter_model.safetensors")
        assert got.keys() == want.keys() and got
        for k in want:
            assert (got[k] - want[k]).abs().max() <= 1e-5, k
