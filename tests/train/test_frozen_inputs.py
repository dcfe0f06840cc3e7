"""Frozen inputs (`train/frozen_inputs.py`): the base model's files and the frozen extra
adapters are checked before any data is read, recorded in every checkpoint, and a resume
that would read other files is refused unless `--accept-changed-inputs` says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from protrain.train import loop
from protrain.train.config import validate_config
from protrain.train.errors import ConfigError, OutputDirError
from protrain.train.frozen_inputs import safetensors_problem
from protrain.train.loop import train
from protrain.train.modeling import TINY_TOKENIZER_DIR, build_tiny_base

from .test_multi_adapter import _frozen_adapter_dir, small_config


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model_dir(path: Path, seed: int) -> Path:
    """The tiny model's architecture with weights of ``seed``, and its tokenizer."""
    cfg = validate_config(small_config(path, seed=seed))
    build_tiny_base(cfg).save_pretrained(path)
    for f in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    return path


def _no_data_work(monkeypatch):
    """Fail the test if the run reaches its tokenizer (the data work)."""

    def refuse(cfg):
        raise AssertionError("the tokenizer was loaded before the check")

    monkeypatch.setattr(loop, "load_tokenizer", refuse)


def test_a_replaced_frozen_adapter_is_refused_at_resume_unless_accepted(tmp_path, protrain_log):
    old = _frozen_adapter_dir(tmp_path / "a", seed=7)
    adapter = {"type": "lora", "r": 4, "extra": [{"name": "old", "path": str(old)}]}
    cfg = small_config(tmp_path, max_steps=2, save_steps=2, adapter=adapter)
    train(validate_config(cfg))
    run = tmp_path / "run"
    recorded = json.loads((run / "checkpoint-2" / "state.json").read_text())["trainer"]
    assert set(recorded["frozen_inputs"]) == {"adapter:old"}  # tiny: no model files

    # the folder now holds another adapter of the same shape
    shutil.rmtree(old)
    shutil.copytree(_frozen_adapter_dir(tmp_path / "b", seed=8), old)
    cfg["max_steps"] = 4
    with pytest.raises(OutputDirError) as info:
        train(validate_config(cfg), resume=True)
    assert str(info.value) == (
        f"--resume: the frozen adapter 'old' (adapter.extra[0].path = {str(old)!r}) is not "
        "what checkpoint-2 was trained with (adapter_model.safetensors changed); restore "
        "those files, or pass --accept-changed-inputs to continue with them as they are now"
    )
    assert not (run / "checkpoint-4").exists()

    result = train(validate_config(cfg), resume=True, accept_changed_inputs=True)
    assert result.steps == 4 and (run / "checkpoint-4").is_dir()
    assert any("--accept-changed-inputs: the frozen adapter 'old'" in line for line in protrain_log)


def test_base_model_weights_replaced_before_resume_are_refused(tmp_path):
    model = _model_dir(tmp_path / "model", seed=1)
    cfg = small_config(
        tmp_path, max_steps=2, save_steps=2, adapter="lora", model={"name_or_path": str(model)}
    )
    train(validate_config(cfg))
    other = _model_dir(tmp_path / "other", seed=2)  # the same architecture, other weights
    shutil.copy(other / "model.safetensors", model / "model.safetensors")
    cfg["max_steps"] = 4
    with pytest.raises(OutputDirError) as info:
        train(validate_config(cfg), resume=True)
    assert str(info.value).startswith(
        f"--resume: model.name_or_path = {str(model)!r} is not what checkpoint-2 was trained "
        "with (model.safetensors changed); restore those files, or pass --accept-changed-inputs"
    ), info.value


@pytest.mark.parametrize("damage", ["truncated", "random-bytes"])
def test_a_damaged_model_file_is_one_line_before_the_data(tmp_path, monkeypatch, damage):
    model = _model_dir(tmp_path / "model", seed=1)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(
            torch.randint(0, 256, (len(data),), dtype=torch.uint8).numpy().tobytes()
        )
    _no_data_work(monkeypatch)
    cfg = small_config(tmp_path, model={"name_or_path": str(model)})
    with pytest.raises(ConfigError) as info:
        train(validate_config(cfg))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"model.name_or_path: {weights} is not a readable safetensors file ("
    ), message
    assert ("truncated: tensor" if damage == "truncated" else "random bytes?") in message
    assert not (tmp_path / "run").exists()


def test_an_intact_safetensors_file_has_no_problem(tmp_path):
    model = _model_dir(tmp_path / "model", seed=1)
    assert safetensors_problem(model / "model.safetensors") is None


@pytest.mark.parametrize("case", ["missing", "not-peft", "damaged-weights"])
def test_a_bad_extra_adapter_path_is_found_before_the_data(tmp_path, monkeypatch, case):
    path = tmp_path / "adapter"
    if case == "not-peft":
        path.mkdir()
    elif case == "damaged-weights":
        _frozen_adapter_dir(tmp_path)
        (tmp_path / "old_adapter").rename(path)
        weights = path / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    adapter = {"type": "lora", "extra": [{"name": "old", "path": str(path)}]}
    _no_data_work(monkeypatch)
    with pytest.raises(ConfigError) as info:
        train(validate_config(small_config(tmp_path, adapter=adapter)))
    expected = {
        "missing": f"adapter.extra[0].path = {str(path)!r}: no such file or directory",
        "not-peft": f"adapter.extra[0].path = {str(path)!r} is not a PEFT adapter directory",
        "damaged-weights": f"adapter.extra[0].path: {path / 'adapter_model.safetensors'} is "
        "not a readable safetensors file (truncated",
    }[case]
    assert str(info.value).startswith(expected), info.value
    assert not (tmp_path / "run").exists()


def test_accept_changed_inputs_is_allowed_with_resume_only(tmp_path, capsys):
    from protrain.cli import main

    from .helpers import write_config

    path = write_config(tmp_path, small_config(tmp_path))
    assert main(["train", str(path), "--accept-changed-inputs"]) == 2
    assert capsys.readouterr().err == (
        "error: --accept-changed-inputs is allowed only with --resume\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]},
        {"dtype": "F32", "shape": [2], "data_offsets": [None, 8]},
        {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]},
        {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]},
    ],
)
def test_a_header_of_the_wrong_types_is_a_problem_not_a_traceback(tmp_path, entry):
    """A header that parses as JSON but whose offsets or shape are no whole numbers."""
    import json
    import struct

    header = json.dumps({"w": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    assert "not whole numbers" in safetensors_problem(path)
