"""`sample_packing` with a model family that would mix packed samples is refused in one line
before any weight loads; the families that keep them apart train as before. The family is
probed on a tiny random model (`protrain.train.packing_check`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from protrain.train.config import validate_config
from protrain.train.errors import ConfigError
from protrain.train.modeling import build_model
from protrain.train.packing_check import packing_problem

from .helpers import save_families, tiny_config


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "gpt2"])
def test_families_that_keep_packed_samples_apart_pass(model_type):
    assert packing_problem(AutoConfig.for_model(model_type), "sdpa") is None


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("opt", "'opt' with sdpa attention lets a packed sample see the samples before it"),
        ("mamba", "'mamba' with eager attention lets a packed sample see the samples before"),
        ("bloom", "'bloom' with eager attention lets a packed sample see the samples before"),
        ("qwen2_vl", "'qwen2_vl' takes 3-D (mrope) positions"),
    ],
)
def test_families_that_mix_packed_samples_are_named(model_type, why):
    problem = packing_problem(AutoConfig.for_model(model_type), "sdpa")
    assert problem is not None and problem.startswith(why), problem


def test_the_probe_leaves_the_runs_random_numbers_alone():
    state = torch.get_rng_state()
    packing_problem(AutoConfig.for_model("stablelm"), "sdpa")
    assert torch.equal(torch.get_rng_state(), state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_families(tmp_path_factory.mktemp("models"), "llama", "mamba")


def _cfg(tmp_path, model_dir):
    return validate_config(
        tiny_config(tmp_path, model={"name_or_path": str(model_dir)}, sample_packing=True)
    )


def test_packing_a_model_that_mixes_samples_is_refused_before_loading(saved, tmp_path):
    with pytest.raises(ConfigError) as err:
        build_model(_cfg(tmp_path, saved / "mamba"), tokenizer=None)
    message = str(err.value)
    assert message.startswith("sample_packing = true is not allowed with model.name_or_path")
    assert "'mamba' with eager attention lets a packed sample see" in message
    assert message.endswith("set sample_packing: false") and "\n" not in message


def test_packing_a_model_that_keeps_samples_apart_builds(saved, tmp_path):
    model = build_model(_cfg(tmp_path, saved / "llama"), tokenizer=None).model
    assert model.config._attn_implementation == "sdpa"
