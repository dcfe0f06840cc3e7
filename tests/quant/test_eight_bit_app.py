"""`adapter.bits: 8` through the app: the tiny model quantized in process to bitsandbytes'
int8 layers, trained by `protrain train` in chunks that are offloaded and gathered."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file
from tests.train.helpers import tiny_config, write_config
from tests.train.test_cli_errors import run_cli

from protrain.train.config import validate_config
from protrain.train.metrics import read_metrics

pytest.importorskip("bitsandbytes")

ADAPTER = {"type": "qlora", "bits": 8, "r": 4}


def test_8bit_qlora_is_a_config_the_planner_and_the_knobs_accept(tmp_path):
    auto = validate_config(
        tiny_config(tmp_path, adapter=ADAPTER, memory={"auto": True, "gpu_budget": "24GiB"})
    )
    assert auto.adapter.bits == 8 and auto.memory.engine_enabled
    fixed = validate_config(tiny_config(tmp_path, adapter=ADAPTER, memory={"n_persist": 0}))
    assert fixed.memory.engine_enabled


def test_protrain_train_runs_a_tiny_8bit_qlora_step_with_chunks_offloaded(tmp_path):
    memory = {"n_persist": 0, "n_buffer": 2, "chunk_size": "256KiB"}
    raw = tiny_config(
        tmp_path, sequence_len=32, micro_batch_size=2, max_steps=1, adapter=ADAPTER, memory=memory
    )
    proc = run_cli("train", str(write_config(tmp_path, raw)))
    assert proc.returncode == 0, proc.stderr
    # the layout: int8 weights and their scales in chunks, none persistent
    chunks = [line for line in proc.stderr.splitlines() if line.lstrip().startswith("chunk ")]
    assert chunks and not any("persistent" in line for line in chunks)
    assert any("base_layer.quant_scb" in line for line in chunks)
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(steps) == 1 and math.isfinite(steps[0]["loss"])
    adapter = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    assert adapter and all(v.isfinite().all() for v in adapter.values())
