"""The final export of several ranks, streamed one tensor at a time
(`train/checkpoint/streamed_export.py`), against the export gathered on every rank that it replaces:
for both modes of the chunk engine and the FSDP2 engine, full fine-tuning and LoRA, on 2
and 3 ranks, every file is the same, byte for byte. Each run writes both exports
(`rank_server.py`'s `EXPORT_TWICE`), split into files of at most 300 KB so that the
split and its index are compared too (but for the gathered index's total size, see the
test); then the streamed one loads with `from_pretrained`
(and `PeftModel.from_pretrained` over the shipped base) with the weights it holds.
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

INDEX = "model.safetensors.index.json"

# (ranks, engine or mode, full or lora)
CASES = [
    (2, "sharded", "full"),
    (3, "sharded", "lora"),
    (3, "replicated", "full"),
    (2, "replicated", "lora"),
    (3, "fsdp2", "full"),  # uneven dim-0 shards
    (2, "fsdp2", "lora"),
    (2, "sharded", "local"),  # full, from a directory (transformers attaches its conversions)
]


def _config(root: Path, world: int, engine: str, kind: str) -> Path:
    run = root / f"{world}-{engine}-{kind}"
    cfg = tiny_config(
        root,
        micro_batch_size=1,
        sequence_len=32,
        gradient_accumulation_steps=1,
        max_steps=2,
        output_dir=str(run),
    )
    if kind == "lora":
        cfg["adapter"] = {"type": "lora", "r": 4, "dropout": 0.0}
    if kind == "local":
        cfg["model"] = {"name_or_path": str(_local_model(root))}
    if engine == "fsdp2":
        cfg.update(fsdp_version=2, fsdp_config={"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    else:
        cfg["memory"] = {"n_persist": 1, "mode": engine, "chunk_size": f"{128 * world}KiB"}
    path = root / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _local_model(root: Path) -> Path:
    """The tiny model saved as a Hugging Face directory with the quickstart tokenizer."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from protrain.train.modeling import TINY_MODEL_CONFIG, TINY_TOKENIZER_DIR

    path = root / "local-model"
    spec = json.loads(TINY_MODEL_CONFIG.read_text())
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for f in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple, Path]:
    root = tmp_path_factory.mktemp("export")
    server = RankServer()
    out = {}
    try:
        for world, engine, kind in CASES:
            config = _config(root, world, engine, kind)
            logs = config.with_suffix("")
            status = server.run(world, ["train", str(config)], logs, env={"EXPORT_TWICE": "300KB"})
            log = logs.with_name(f"{logs.name}.rank0.log").read_text()
            assert status == [0] * world, log[-3000:]
            assert "not streamed" not in log, log[-3000:]
            out[(world, engine, kind)] = root / logs.name
    finally:
        server.close()
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_streamed_export_is_the_gathered_one(runs, case):
    run = runs[case]
    streamed, gathered = _files(run / "final"), _files(run / "final-gathered")
    assert sorted(streamed) == sorted(gathered)
    for name, data in gathered.items():
        if name == INDEX:  # below
            continue
        if name == "adapter_config.json":  # peft writes target_modules, a set, in any order
            got, want = json.loads(streamed[name]), json.loads(data)
            got["target_modules"], want["target_modules"] = (
                sorted(got["target_modules"]),
                sorted(want["target_modules"]),
            )
            assert got == want
            continue
        assert streamed[name] == data, name
    kind = case[2]
    if kind in ("full", "local"):
        from transformers import AutoModelForCausalLM

        index, before = json.loads(streamed[INDEX]), json.loads(gathered[INDEX])
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 2
        saved = {k: v for f in files for k, v in load_file(run / "final" / f).items()}
        # huggingface_hub sizes a tensor by its whole storage: FSDP2's gathered tensors,
        # views of larger buffers, count more bytes than they hold; the streamed index
        # counts the bytes written
        total = sum(v.numel() * v.dtype.itemsize for v in saved.values())
        assert index["metadata"].pop("total_size") == total
        assert before["metadata"].pop("total_size") >= total
        assert index == before
        model = AutoModelForCausalLM.from_pretrained(run / "final")
    else:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        saved = load_file(run / "final" / "adapter_model.safetensors")
        assert saved and all("lora_" in k for k in saved)
        base = AutoModelForCausalLM.from_pretrained(run / "final" / "base_model")
        model = PeftModel.from_pretrained(base, run / "final")
        saved = {k.replace(".weight", ".default.weight"): v for k, v in saved.items()}
    state = model.state_dict()
    for name, value in saved.items():
        assert torch.equal(state[name], value), name


class _Shards:
    """What the final check reads of a trainable: this rank's own values."""

    def __init__(self, values: dict[str, torch.Tensor]):
        self.values = values

    def own_trainable_values(self) -> dict[str, torch.Tensor]:
        return self.values


def _check_on_rank(rank: int, world: int, bad_rank: int, errors) -> None:
    from protrain.distributed import resolve_context
    from protrain.train.loop import _check_finite_over_ranks
    from protrain.train.nonfinite import NonFiniteError
    from protrain.train.ranks import Ranks

    own = {"w": torch.ones(3), "b": torch.zeros(2)}
    if rank == bad_rank:
        own["b"] = torch.tensor([0.0, float("nan")])
    try:
        _check_finite_over_ranks(_Shards(own), Ranks(resolve_context()))
    except NonFiniteError as exc:
        errors.put((rank, str(exc)))


def test_final_check_reads_each_ranks_own_shards():
    """A NaN in one rank's own shard stops every rank, each with the message naming it
    (the rank that holds it names the weight). Every run above passed the check."""
    import torch.multiprocessing as mp

    from .ranks import run_ranks

    errors = mp.get_context("spawn").SimpleQueue()
    run_ranks(2, _check_on_rank, 1, errors, check_group_freed=True)
    got = []
    while not errors.empty():
        got.append(errors.get())
    assert sorted(got) == [(0, _message("a weight of rank 1")), (1, _message("weight 'b'"))]


def _message(what: str) -> str:
    return (
        f"the final model not written: {what} is not finite (NaN or inf); the checkpoints "
        "already written are kept. Try a lower learning_rate, or set max_grad_norm"
    )


def test_gathered_export_of_several_ranks(runs, tmp_path):
    """The export that is not streamed (rank 0 writes the gathered model while the others
    wait for it, `Ranks.on_main_patiently`): the streamed export's weights."""
    config = _config(tmp_path, 2, "sharded", "full")
    logs = config.with_suffix("")
    server = RankServer()
    try:
        status = server.run(2, ["train", str(config)], logs, env={"EXPORT_GATHERED": "1"})
    finally:
        server.close()
    log = logs.with_name(f"{logs.name}.rank0.log").read_text()
    assert status == [0, 0], log[-3000:]
    assert "export gathered on every rank (not streamed): forced by the test" in log
    got = load_file(tmp_path / logs.name / "final" / "model.safetensors")
    streamed = runs[(2, "sharded", "full")] / "final"
    index = json.loads((streamed / INDEX).read_text())
    want = {
        k: v for f in set(index["weight_map"].values()) for k, v in load_file(streamed / f).items()
    }
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
