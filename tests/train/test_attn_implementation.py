"""`model.attn_implementation` left unset: SDPA where the model's class supports it, else
eager, decided from the config before loading and logged in one line; set, it is kept (an
unsupported 'sdpa' is refused by transformers, named in one line)."""

from __future__ import annotations

import importlib.util

import pytest

from protrain.train.config import TrainConfig, validate_config
from protrain.train.errors import ConfigError
from protrain.train.modeling import build_model

from .helpers import save_families, tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny saved checkpoints: Llama (SDPA) and Gemma 2 (no SDPA in transformers 5.24)."""
    return save_families(tmp_path_factory.mktemp("models"), "llama", "gemma2")


def _cfg(tmp_path, model_dir, **model):
    return validate_config(tiny_config(tmp_path, model={"name_or_path": str(model_dir), **model}))


def test_the_default_is_unset():
    assert TrainConfig().model.attn_implementation is None


@pytest.mark.parametrize(
    ("name", "expected", "line"),
    [
        ("llama", "sdpa", "attention: sdpa (model.attn_implementation unset; supported by "
                          "LlamaForCausalLM)"),
        ("gemma2", "eager", "attention: eager (model.attn_implementation unset; "
                            "Gemma2ForCausalLM does not support sdpa in transformers"),
    ],
)  # fmt: skip
def test_unset_loads_sdpa_where_supported_else_eager_and_says_so(
    name, expected, line, saved, tmp_path, protrain_log
):
    model = build_model(_cfg(tmp_path, saved / name), tokenizer=None).model
    assert model.config._attn_implementation == expected
    said = [r for r in protrain_log if r.startswith("attention: ")]
    assert len(said) == 1 and said[0].startswith(line), said


def test_the_tiny_model_takes_sdpa(tmp_path, protrain_log):
    model = build_model(validate_config(tiny_config(tmp_path)), tokenizer=None).model
    assert model.config._attn_implementation == "sdpa"
    assert any(r.startswith("attention: sdpa") for r in protrain_log)


def test_an_explicit_sdpa_stays_strict(saved, tmp_path):
    with pytest.raises(ConfigError) as err:
        build_model(_cfg(tmp_path, saved / "gemma2", attn_implementation="sdpa"), None)
    assert "cannot load it (Gemma2ForCausalLM does not support" in str(err.value)


def test_a_forced_sdpa_kernel_needs_sdpa_support(saved, tmp_path):
    """Unset with `sdpa_backend` forced: SDPA is needed, refused before any weight loads."""
    with pytest.raises(ConfigError) as err:
        build_model(_cfg(tmp_path, saved / "gemma2", sdpa_backend="math"), None)
    assert (
        "model.sdpa_backend = 'math' needs SDPA attention, which Gemma2ForCausalLM does "
        "not support in transformers" in str(err.value)
    )
    model = build_model(_cfg(tmp_path, saved / "llama", sdpa_backend="math"), None).model
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("attn", "needle"),
    [
        ("flex_attention", "model.attn_implementation = 'flex_attention' needs a CUDA GPU: "
                           "torch has no flex_attention backward on cpu"),
        ("flash_attention_2", "model.attn_implementation = 'flash_attention_2' needs the "
                              "flash_attn package, which is not installed"),
    ],
)  # fmt: skip
def test_an_explicit_kernel_that_cannot_train_here_is_one_line(saved, tmp_path, attn, needle):
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ConfigError) as err:
        build_model(_cfg(tmp_path, saved / "llama", attn_implementation=attn), None)
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)
