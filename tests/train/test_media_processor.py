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


def test_inspect_data_reads_rows_through_the_processor(tmp_path):
    """`protrain inspect-data` shows what `train` trains on: the image expanded into the
    processor's 4 image tokens, not the template's one placeholder."""
    import json

    from tests.data.vision_helpers import write_image
    from tests.families.processors import IMAGE_SIZE, llava_processor
    from transformers import AutoConfig

    from .helpers import write_config
    from .test_cli_errors import run_cli

    model_dir = tmp_path / "llava"
    llava_processor().save_pretrained(model_dir)
    AutoConfig.for_model("llava").save_pretrained(model_dir)
    write_image(tmp_path / "cat.png", (IMAGE_SIZE, IMAGE_SIZE))
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A cat."},
        ],
        "images": ["cat.png"],
    }
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    raw = tiny_config(
        tmp_path,
        model={"name_or_path": str(model_dir)},
        datasets=[{"path": str(tmp_path / "rows.jsonl"), "type": "chat"}],
    )
    proc = run_cli("inspect-data", str(write_config(tmp_path, raw)), "-n", "1")
    assert proc.returncode == 0, proc.stderr
    assert "<image>" * 4 + "What?" in proc.stdout, proc.stdout


def test_a_processor_class_transformers_cannot_rebuild_is_refused(tmp_path):
    """AutoProcessor falls back to the tokenizer for a processor class it does not know
    (here the tests' image-only Qwen2-VL processor): refused, never trained image-blind."""
    from tests.data.vision_helpers import qwen2_vl_processor

    model_dir = _dir_with(tmp_path, "qwen2_vl")
    qwen2_vl_processor().save_pretrained(model_dir)
    cfg = _cfg(tmp_path, model_dir)
    with pytest.raises(ConfigError) as err:
        load_media_processor(cfg, model_auto_class(cfg))
    assert "is a vision-language model but AutoProcessor gave a " in str(err.value)
    assert "not a processor: its images could not be read" in str(err.value)
