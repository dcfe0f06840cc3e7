"""`adapter.bits: 8` through the app: the tiny model quantized in process to bitsandbytes'
int8 layers, trained by `protrain train` in chunks that are offloaded and gathered."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file
from tests.train.helpers import tiny_config, write_config
from tests.train.test_cli_errors import run_cli

from protrain.train.config import validate_config
from protrain.train.errors import ConfigError
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


@pytest.mark.parametrize("threshold", [None, 2.5])
def test_in_process_and_transformers_8bit_layers_share_the_threshold(tmp_path, threshold):
    """The engine's path (quantized in process) and a pretrained model loaded by transformers
    (its BitsAndBytesConfig builds the layers) give the layers one outlier threshold."""
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    from protrain.quant import is_8bit_linear
    from protrain.train.modeling import bnb_quantization_config, build_model, build_tiny_base

    adapter = dict(ADAPTER) if threshold is None else {**ADAPTER, "int8_threshold": threshold}
    cfg = validate_config(tiny_config(tmp_path, adapter=adapter, memory={"n_persist": 0}))
    expected = 6.0 if threshold is None else threshold  # transformers' default when unset
    assert cfg.adapter.int8_threshold == expected
    ours = [m for m in build_model(cfg, None).model.modules() if is_8bit_linear(m)]
    hf_config = bnb_quantization_config(cfg.adapter)
    theirs = replace_with_bnb_linear(build_tiny_base(cfg), quantization_config=hf_config)
    theirs = [m for m in theirs.modules() if is_8bit_linear(m)]
    assert ours and theirs
    assert {(m.state.threshold, m.state.has_fp16_weights) for m in ours} == {(expected, False)}
    assert {(m.state.threshold, m.state.has_fp16_weights) for m in theirs} == {(expected, False)}


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        (
            {**ADAPTER, "int8_threshold": -1.0},
            r"adapter.int8_threshold = -1.0 is not allowed: use a finite number >= 0",
        ),
        ({**ADAPTER, "int8_threshold": float("nan")}, r"int8_threshold = nan is not allowed"),
        ({**ADAPTER, "int8_threshold": "high"}, r"int8_threshold = 'high' is not allowed"),
        (
            {"type": "qlora", "int8_threshold": 5.0},
            "type = 'qlora' and adapter.bits = 4: it is LLM.int8's",
        ),
        (
            {"type": "lora", "int8_threshold": 0.0},
            "type = 'lora' and adapter.bits = 4: it is LLM.int8's",
        ),
    ],
)
def test_int8_threshold_refusals(tmp_path, adapter, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(tmp_path, adapter=adapter))


def test_int8_threshold_at_its_default_says_nothing(tmp_path):
    """The default written out (as every run's recorded config.yaml has it) is not a
    setting: accepted beside 4-bit QLoRA, as without it."""
    cfg = validate_config(tiny_config(tmp_path, adapter={"type": "qlora", "int8_threshold": 6.0}))
    assert cfg.adapter.bits == 4
