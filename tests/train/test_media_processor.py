"""`protrain train` reads a vision-language model's images through its processor; a VLM
checkpoint without one is refused in one line (its images would be dropped)."""

from __future__ import annotations

import shutil

import pytest

from protrain.train.config import QUICKSTART_DIR, validate_config
from protrain.train.errors import ConfigError
from protrain.train.modeling import load_media_processor, model_auto_class

from .helpers import tiny_config


def _dir_with(tmp_path, model_type: str):
    from transformers import AutoConfig

    model_dir = tmp_path / model_type
    shutil.copytree(QUICKSTART_DIR / "tokenizer", model_dir)
    AutoConfig.for_model(model_type).save_pretrained(model_dir)
    return model_dir


def _cfg(tmp_path, model_dir):
    return validate_config(tiny_config(tmp_path, model={"name_or_path": str(model_dir)}))


def test_a_vision_language_model_without_a_processor_is_refused(tmp_path):
    cfg = _cfg(tmp_path, _dir_with(tmp_path, "llava"))
    with pytest.raises(ConfigError) as err:
        load_media_processor(cfg, model_auto_class(cfg))
    message = str(err.value)
    assert "cannot load the processor of this vision-language model" in message
    assert "preprocessor_config.json" in message
    assert "\n" not in message


def test_a_vision_language_model_gets_its_processor(tmp_path):
    from tests.families.processors import llava_processor
    from transformers import LlavaProcessor

    model_dir = _dir_with(tmp_path, "llava")
    llava_processor().save_pretrained(model_dir)
    cfg = _cfg(tmp_path, model_dir)
    assert isinstance(load_media_processor(cfg, model_auto_class(cfg)), LlavaProcessor)


def test_a_causal_model_needs_none(tmp_path):
    cfg = _cfg(tmp_path, _dir_with(tmp_path, "llama"))
    assert load_media_processor(cfg, model_auto_class(cfg)) is None
