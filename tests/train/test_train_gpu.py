"""The training loop on a CUDA GPU: bf16 autocast, plain and through the chunked engine."""

import math

import pytest

from protrain.train.config import validate_config
from protrain.train.loop import train

from .helpers import tiny_config


@pytest.mark.gpu
@pytest.mark.parametrize("memory", [{}, {"n_persist": 1, "n_buffer": 2}], ids=["plain", "engine"])
def test_tiny_trains_on_gpu_in_bf16(tmp_path, memory):
    cfg = validate_config(
        tiny_config(
            tmp_path,
            max_steps=20,
            learning_rate=3e-3,
            device="cuda",
            mixed_precision="bf16",
            memory=memory,
        )
    )
    result = train(cfg)
    assert all(math.isfinite(x) for x in result.losses)
    assert sum(result.losses[-5:]) < 0.8 * sum(result.losses[:5])
    assert (result.final_dir / "model.safetensors").exists()
