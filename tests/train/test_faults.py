"""Faults around a checkpoint that the other files do not cover: a pickle placed in a
checkpoint (never unpickled), a checkpoint of another model (one line, exit 2, nothing of the
run touched), and a signal that arrives while a checkpoint is being written (the save
completes, the run stops resumable, and the resume is exact)."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import protrain.train.checkpoint as ckpt
import protrain.train.checkpoint.plain as plain_ckpt
from protrain.train.config import validate_config
from protrain.train.errors import OutputDirError
from protrain.train.loop import train
from protrain.train.modeling import TINY_TOKENIZER_DIR
from protrain.train.stop_signals import TrainingStopped

from .helpers import tiny_config

# a constant rate: the runs below stop early and resume under a larger max_steps
STEPS = dict(
    micro_batch_size=2,
    gradient_accumulation_steps=1,
    save_total_limit=None,
    lr_scheduler="constant",
    warmup_steps=0,
)


class _Payload:
    """Unpickling this writes `marker`: proof that a file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def _pickle_bytes(marker: Path) -> bytes:
    return pickle.dumps({"state": _Payload(marker)})


def _assert_bit_equal(a: Path, b: Path, name: str = "model.safetensors") -> None:
    x, y = load_file(a / name), load_file(b / name)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.fixture(scope="module")
def straight6(tmp_path_factory) -> Path:
    """Six steps uninterrupted: what every resumed run below must equal bit for bit."""
    root = tmp_path_factory.mktemp("straight")
    return train(validate_config(tiny_config(root, max_steps=6, **STEPS))).final_dir


def _four_steps(tmp_path: Path) -> dict:
    cfg = tiny_config(tmp_path, max_steps=4, save_steps=2, **STEPS)
    train(validate_config(cfg))
    return cfg


@pytest.mark.parametrize("where", ["beside", "instead-of-optimizer"])
def test_a_pickle_placed_in_a_checkpoint_is_never_unpickled(tmp_path, straight6, where):
    cfg = _four_steps(tmp_path)
    run = tmp_path / "run"
    marker = tmp_path / "marker"
    if where == "beside":  # files a torch.save-based trainer would load: never read here
        for name in ("optimizer.pt", "rng_state.pth", "training_args.bin"):
            (run / "checkpoint-4" / name).write_bytes(_pickle_bytes(marker))
    else:  # the optimizer state replaced by a pickle: fails its hash, never parsed
        (run / "checkpoint-4" / "optimizer.safetensors").write_bytes(_pickle_bytes(marker))
    cfg["max_steps"] = 6
    result = train(validate_config(cfg), resume=True)
    assert not marker.exists()
    if where == "instead-of-optimizer":  # set aside as damaged; resumed from checkpoint-2
        assert (run / ".damaged-checkpoint-4").is_dir()
    _assert_bit_equal(result.final_dir, straight6)


def _other_model_dir(path: Path) -> Path:
    """A Llama of another width, saved with the quickstart tokenizer."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for f in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.mark.parametrize("other", ["wider-model", "lora-adapter"])
def test_a_checkpoint_of_another_model_is_one_error_naming_the_file(tmp_path, other):
    cfg = _four_steps(tmp_path / "a")
    run = tmp_path / "a" / "run"
    if other == "wider-model":  # same parameter names, other shapes
        kind = {"model": {"name_or_path": str(_other_model_dir(tmp_path / "m"))}}
    else:  # the same model's LoRA run: other names
        kind = {"adapter": "lora"}
    foreign = tiny_config(tmp_path / "b", max_steps=6, save_steps=6, **STEPS, **kind)
    train(validate_config(foreign))
    shutil.copytree(tmp_path / "b" / "run" / "checkpoint-6", run / "checkpoint-6")
    before = sorted(p.name for p in run.rglob("*"))

    cfg["max_steps"] = 8
    with pytest.raises(OutputDirError) as info:
        train(validate_config(cfg), resume=True)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"--resume: {run / 'checkpoint-6' / 'model.safetensors'} is a checkpoint of another model"
    ), message
    assert "move checkpoint-6 away to resume from the one before" in message
    if other == "wider-model":
        assert "is (512, 64) in the checkpoint, (512, 128) in the model" in message
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing moved, nothing written


def test_a_signal_during_a_save_completes_it_and_the_resume_is_exact(
    tmp_path, straight6, monkeypatch
):
    real, sent = plain_ckpt._save_tensors, []

    def save_then_signal(path: Path, tensors):
        # SIGTERM in the middle of checkpoint-2's save: after its model, before its optimizer
        if path.parent.name == f"{ckpt.TMP_PREFIX}2" and path.name == "optimizer.safetensors":
            os.kill(os.getpid(), signal.SIGTERM)
            sent.append(path)
        return real(path, tensors)

    monkeypatch.setattr(plain_ckpt, "_save_tensors", save_then_signal)
    cfg = tiny_config(tmp_path, max_steps=6, save_steps=2, **STEPS)
    with pytest.raises(TrainingStopped) as info:
        train(validate_config(cfg))
    assert sent and info.value.code == 128 + signal.SIGTERM
    run = tmp_path / "run"
    # the save the signal interrupted completed and verifies; the run stopped right after it
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2"
    ]
    assert ckpt.verify(run / "checkpoint-2") is None
    assert not any(p.name.startswith(ckpt.TMP_PREFIX) for p in run.iterdir())
    assert not (run / "final").exists()

    monkeypatch.setattr(plain_ckpt, "_save_tensors", real)
    result = train(validate_config(cfg), resume=True)
    _assert_bit_equal(result.final_dir, straight6)
