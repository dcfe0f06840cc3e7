"""A model the host cannot hold once per rank is refused before loading, in one line."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from protrain.train.errors import ConfigError
from protrain.train.host_memory import check_host_memory_for_loading, checkpoint_numel
from protrain.train.modeling import TINY_MODEL_CONFIG, TINY_TOKENIZER_DIR

from .helpers import tiny_config, write_config
from .test_cli_errors import assert_one_line_error, run_cli

GIB = 2**30


def test_numel_from_headers_alone(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, tmp_path / "model-1.safetensors")
    save_file({"c": torch.zeros(2, 2, 2, dtype=torch.bfloat16)}, tmp_path / "model-2.safetensors")
    assert checkpoint_numel(tmp_path) == 12 + 5 + 8
    assert checkpoint_numel(tmp_path / "nothing") is None
    (tmp_path / "model-3.safetensors").write_bytes(b"\xff" * 16)  # not safetensors
    assert checkpoint_numel(tmp_path) is None


def test_refused_when_the_ranks_copies_exceed_the_host(tmp_path):
    save_file({"w": torch.zeros(1024, 1024)}, tmp_path / "model.safetensors")  # 1 Mi params
    check_host_memory_for_loading(str(tmp_path), 4, "float32", 4, available=16 * 2**20)
    with pytest.raises(ConfigError) as err:
        check_host_memory_for_loading(str(tmp_path), 4, "float32", 4, available=15 * 2**20)
    text = str(err.value)
    assert "each of this host's 4 ranks" in text and "model.dtype = 'float32'" in text
    assert "fewer ranks on this host" in text
    with pytest.raises(ConfigError, match="on the host"):
        check_host_memory_for_loading(str(tmp_path), 4, "float32", 1, available=2**20)
    check_host_memory_for_loading("some/hub-id", 4, "float32", 8, available=1)  # not read


def _huge_checkpoint(directory, rows: int, cols: int) -> None:
    """A model directory whose safetensors header declares a rows x cols fp32 tensor, in a
    sparse file of that size (no block of it is written: the checks read headers only and
    refuse before the load; the file is whole, so the weights check passes it)."""
    directory.mkdir()
    config = json.loads(TINY_MODEL_CONFIG.read_text())
    (directory / "config.json").write_text(json.dumps(config))
    header = json.dumps(
        {
            "model.embed_tokens.weight": {
                "dtype": "F32",
                "shape": [rows, cols],
                "data_offsets": [0, rows * cols * 4],
            }
        }  # fmt: skip
    ).encode()
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + rows * cols * 4)  # sparse: the data reads as zeros


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_app_refuses_before_loading(tmp_path, adapter):
    """Full fine-tuning: the disk check (12 bytes a parameter) refuses first; an adapter's
    checkpoints are small, and the host-memory check refuses the load."""
    model = tmp_path / "huge"
    _huge_checkpoint(model, 2**20, 2**20)  # 2**40 parameters: 4 TiB in fp32
    cfg = tiny_config(tmp_path, model={"name_or_path": str(model),
                                       "tokenizer": str(TINY_TOKENIZER_DIR)},
                      adapter={"type": adapter})  # fmt: skip
    proc = run_cli("train", str(write_config(tmp_path, cfg)))
    if adapter == "none":
        assert_one_line_error(proc, "a checkpoint needs about 12288.06 GiB")
    else:
        assert_one_line_error(proc, "loading it needs 4096.0 GiB of host memory", "Allowed:")
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_disk_estimate_reads_the_headers_whatever_the_class(tmp_path):
    """The disk check before a run counts a local model's parameters from its safetensors
    headers (an encoder-decoder or a vision-language model as much as a causal LM)."""
    from protrain.train.config import validate_config
    from protrain.train.loop import _estimate_checkpoint_bytes

    model = tmp_path / "model"
    model.mkdir()
    save_file(
        {"encoder.w": torch.zeros(8, 4), "decoder.w": torch.zeros(4)}, model / "m.safetensors"
    )
    cfg = validate_config(tiny_config(tmp_path, model={"name_or_path": str(model)}))
    assert _estimate_checkpoint_bytes(cfg, None) == 12 * (32 + 4)
