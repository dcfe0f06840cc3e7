"""The FSDP2 engine (`fsdp_version: 2`): 2 gloo ranks under torchrun train as one process of
plain PyTorch with twice the accumulation, with either wrap policy, with and without
activation checkpointing; size-based units as FSDP1 chooses them; its config errors.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.multirank.test_train_ranks import _losses, _torchrun
from tests.train.helpers import tiny_config, write_config
from torch import nn

from protrain.distributed.fsdp2 import size_based_units
from protrain.train.config import validate_config
from protrain.train.errors import ConfigError

STEPS = 3


def _config(tmp_path: Path, name: str, accum: int, fsdp_config: dict | None) -> Path:
    cfg = tiny_config(
        tmp_path,
        gradient_accumulation_steps=accum,
        max_steps=STEPS,
        max_grad_norm=1.0,
        save_steps=2,
        output_dir=str(tmp_path / name),
    )
    if fsdp_config is not None:
        cfg["fsdp_version"] = 2
        cfg["fsdp_config"] = fsdp_config
    return write_config(tmp_path, cfg, f"{name}.yaml")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("one")
    config = _config(tmp, "one", 4, None)
    done = subprocess.run(
        [sys.executable, "-m", "protrain", "train", str(config)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "one"


def _run(n: int, config: Path, *extra: str) -> str:
    proc = _torchrun(n, config, *extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def _assert_same_weights(got_dir: Path, want_dir: Path, rtol: float = 1e-5) -> None:
    want = load_file(want_dir / "model.safetensors")
    got = load_file(got_dir / "model.safetensors")
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=rtol, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "fsdp_config",
    [
        {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
        {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "activation_checkpointing": True},
        {"auto_wrap_policy": "SIZE_BASED_WRAP", "activation_checkpointing": True},
        {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 100_000},
    ],
    ids=["layers", "layers-ac", "size-default-ac", "size-100k"],
)
def test_two_ranks_train_as_one_process(tmp_path, one_process, fsdp_config):
    config = _config(tmp_path, "fsdp", 2, fsdp_config)
    out = _run(2, config)
    assert out.count(f"done: {STEPS} steps") == 1, "rank 0 alone reports"
    if fsdp_config["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP":
        assert "TRANSFORMER_BASED_WRAP, 4 units + root (classes LlamaDecoderLayer)" in out
    elif "min_num_params" not in fsdp_config:
        assert "fsdp_config.min_num_params not set: 100000000" in out
    run = tmp_path / "fsdp"
    assert _losses(run) == pytest.approx(_losses(one_process), rel=1e-5)
    _assert_same_weights(run / "final", one_process / "final")
    # the last checkpoint is whole and equals the export
    _assert_same_weights(run / f"checkpoint-{STEPS}", run / "final", rtol=0)
    if fsdp_config["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and fsdp_config.get(
        "activation_checkpointing"
    ):
        _resume_from_checkpoint_2(run, config, one_process)


def _resume_from_checkpoint_2(run: Path, config: Path, one_process: Path) -> None:
    """The optimizer state written by rank 0 loads back into the shards of both ranks."""
    for later in (run / f"checkpoint-{STEPS}", run / "final"):
        shutil.rmtree(later)
    out = _run(2, config, "--resume")
    assert "checkpoint-2 at step 2" in out, out[-3000:]
    _assert_same_weights(run / "final", one_process / "final")


# -- size-based units: FSDP1's decisions


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)  # 272
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16))  # 1088 + 1040


class _Model(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(100, 16)  # 1600
        self.layers = nn.ModuleList(_Block() for _ in range(3))  # 2400 each
        self.norm = nn.LayerNorm(16)  # 32
        self.head = nn.Linear(16, 100, bias=False)  # 1600
        if tied:
            self.head.weight = self.embed.weight


def _fsdp1_units(model: nn.Module, min_num_params: int) -> list[str]:
    """The modules FSDP1's auto wrap wraps under `size_based_auto_wrap_policy`."""
    from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

    names = {id(m): n for n, m in model.named_modules()}
    wrapped = []

    def record(module, **kwargs):
        wrapped.append(names[id(module)])
        return module

    _recursive_wrap(
        model,
        functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params),
        record,
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    return wrapped


@pytest.mark.parametrize(
    "min_num_params, want",
    [
        (2000, ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]),
        (
            1000,
            ["embed"] + [f"layers.{i}.mlp.{j}" for i in range(3) for j in range(2)] + ["head"],
        ),
        (5000, []),  # a block is below it: everything stays with the root
        (int(1e8), []),  # the default
    ],
)
def test_size_based_units_are_fsdp1s(min_num_params, want):
    model = _Model()
    assert size_based_units(model, min_num_params) == want
    assert size_based_units(model, min_num_params) == _fsdp1_units(model, min_num_params)


def test_size_based_units_keep_tied_weights_together():
    units = size_based_units(_Model(tied=True), 1000)
    assert "embed" not in units and "head" not in units
    assert "layers.0.mlp.0" in units


# -- config errors


def _error(tmp_path: Path, **keys) -> str:
    cfg = tiny_config(tmp_path, **keys)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_config_errors(tmp_path):
    m = _error(tmp_path, fsdp_version=2, fsdp_config={"min_num_param": 10})
    assert "unknown key 'fsdp_config.min_num_param'" in m and "'min_num_params'" in m
    m = _error(tmp_path, fsdp_version=2, memory={"n_persist": 1, "n_buffer": 2})
    assert "memory.n_persist = 1, memory.n_buffer = 2 is not allowed" in m
    m = _error(tmp_path, fsdp_version=1)
    assert "fsdp_version = 1 is not allowed" in m
    m = _error(tmp_path, fsdp_version=2, fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"})
    assert "FULL_STATE_DICT" in m
    m = _error(tmp_path, fsdp_config={"offload_params": True})
    assert "fsdp_config needs fsdp_version = 2" in m
    m = _error(
        tmp_path,
        fsdp_version=2,
        gradient_checkpointing=True,
        fsdp_config={"activation_checkpointing": True},
    )
    assert "use one" in m


def test_axolotl_spellings(tmp_path):
    cfg = tiny_config(
        tmp_path,
        fsdp_version=2,
        fsdp_config={
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_offload_params": True,
        },
    )
    fsdp = validate_config(cfg).fsdp
    assert fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert fsdp.offload_params
