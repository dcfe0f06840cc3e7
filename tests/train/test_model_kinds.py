"""The app loads the model named, whole, or refuses it in one line before any weight is read:
vision-language models as such (vision tower kept), causal LMs as causal LMs (text-to-text
encoder-decoders: tests/train/test_seq2seq.py), and encoder-only, speech and other models
refused, naming their type."""

from __future__ import annotations

import shutil

import pytest
import torch

from protrain.train.config import QUICKSTART_DIR, validate_config
from protrain.train.errors import ConfigError
from protrain.train.modeling import build_model, model_auto_class

from .helpers import tiny_config, write_config
from .test_cli_errors import assert_one_line_error, run_cli

SUPPORTED = (
    "protrain train fine-tunes causal (decoder-only) language models, vision-language models "
    "and text-to-text encoder-decoder models only"
)


def _config_only_dir(tmp_path, model_type: str, **kwargs):
    """A checkpoint folder holding a config and the quickstart tokenizer, and no weights: a
    refusal that came after reading weights would fail on their absence instead."""
    from transformers import AutoConfig

    model_dir = tmp_path / model_type
    shutil.copytree(QUICKSTART_DIR / "tokenizer", model_dir)
    AutoConfig.for_model(model_type, **kwargs).save_pretrained(model_dir)
    return model_dir


def _small_data(tmp_path):
    """The first 32 quickstart rows: the data is read before the model, and a test needs
    few of them."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "chat.jsonl"
    lines = (QUICKSTART_DIR / "data" / "chat.jsonl").read_text().splitlines()[:32]
    path.write_text("\n".join(lines) + "\n")
    return [{"path": str(path), "type": "chat"}]


def _cfg(tmp_path, model_dir, **overrides):
    overrides.setdefault("datasets", _small_data(tmp_path))
    return validate_config(
        tiny_config(tmp_path, model={"name_or_path": str(model_dir)}, **overrides)
    )


def test_a_speech_encoder_decoder_is_refused_by_the_cli_before_loading(tmp_path):
    """Whisper has a causal-LM class in transformers: its decoder alone."""
    model_dir = _config_only_dir(tmp_path, "whisper")
    raw = tiny_config(
        tmp_path, model={"name_or_path": str(model_dir)}, datasets=_small_data(tmp_path)
    )
    proc = run_cli("train", str(write_config(tmp_path, raw)))
    assert_one_line_error(
        proc,
        f"model.name_or_path = {str(model_dir)!r}: model type 'whisper' is an encoder-decoder "
        "model of images or speech, not supported yet",
        SUPPORTED,
    )
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize(
    ("model_type", "kwargs", "what"),
    [
        ("pix2struct", {}, "an encoder-decoder model of images or speech"),
        ("qwen2_audio", {}, "an audio-language model, not supported yet"),
        ("bert", {}, "an encoder-only model"),
        ("roberta", {}, "an encoder-only model"),
        ("vit", {}, "not a causal language model"),
    ],
)
def test_other_kinds_are_refused_in_one_line(tmp_path, model_type, kwargs, what):
    """BERT and RoBERTa have a causal-LM class in transformers (BertLMHeadModel, ...):
    loading through it trains another model."""
    model_dir = _config_only_dir(tmp_path, model_type, **kwargs)
    with pytest.raises(ConfigError) as info:
        model_auto_class(_cfg(tmp_path, model_dir))
    message = str(info.value)
    assert "\n" not in message
    assert f"model type {model_type!r} is {what}" in message
    assert SUPPORTED in message


def test_a_bert_trained_as_a_decoder_is_a_causal_lm(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = _config_only_dir(tmp_path, "bert", is_decoder=True)
    assert model_auto_class(_cfg(tmp_path, model_dir)) is AutoModelForCausalLM


def _save(model, tmp_path, name):
    model_dir = tmp_path / name
    shutil.copytree(QUICKSTART_DIR / "tokenizer", model_dir)
    model.save_pretrained(model_dir)
    return model_dir


def test_a_causal_lm_loads_as_one(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    model_dir = _save(GPT2LMHeadModel(config), tmp_path, "gpt2")
    built = build_model(_cfg(tmp_path, model_dir), tokenizer=None)
    assert type(built.model).__name__ == "GPT2LMHeadModel"


def test_a_vision_language_model_loads_whole(tmp_path):
    """Mllama's causal-LM class is its text model alone: the app loads the whole model, the
    vision tower's weights as saved."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    text = dict(
        vocab_size=300,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        cross_attention_layers=[1],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_global_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        intermediate_layers_indices=[0],
        vision_output_dim=32,
    )
    torch.manual_seed(0)
    saved = MllamaForConditionalGeneration(MllamaConfig(text_config=text, vision_config=vision))
    model_dir = _save(saved, tmp_path, "mllama")
    built = build_model(_cfg(tmp_path, model_dir), tokenizer=None)
    assert isinstance(built.model, MllamaForConditionalGeneration)
    loaded = dict(built.model.named_parameters())
    vision_names = [n for n, _ in saved.named_parameters() if "vision_model" in n]
    assert vision_names
    for name in vision_names:
        torch.testing.assert_close(loaded[name], dict(saved.named_parameters())[name])


def test_a_local_gpt_neox_trains_with_the_chunked_loss_and_reloads(tmp_path):
    """A family the chunked loss used to refuse: 3 steps from a saved local checkpoint give
    the losses of the unchunked run, and the export reloads as the same class."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

    from protrain.train.loop import train

    config = GPTNeoXConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model_dir = _save(GPTNeoXForCausalLM(config), tmp_path, "neox")
    runs = {}
    for name, memory in [("plain", {}), ("chunked", {"chunked_loss_tokens": 24})]:
        cfg = _cfg(
            tmp_path / name,
            model_dir,
            max_steps=3,
            micro_batch_size=2,
            gradient_accumulation_steps=1,
            memory=memory,
        )
        runs[name] = train(cfg)
    assert runs["chunked"].losses == pytest.approx(runs["plain"].losses, rel=1e-6, abs=1e-6)
    reloaded = AutoModelForCausalLM.from_pretrained(runs["chunked"].final_dir)
    assert isinstance(reloaded, GPTNeoXForCausalLM)
