"""Encoder-decoder models in the app: rows split into encoder input and decoder labels, the
model's own loss to 1e-6, trained and exported as the same sequence-to-sequence class."""

from __future__ import annotations

import shutil

import pytest
import torch

from protrain.train.config import QUICKSTART_DIR, validate_config
from protrain.train.errors import ConfigError
from protrain.train.loss import count_trained_tokens, loss_sum
from protrain.train.modeling import model_auto_class
from protrain.train.seq2seq import encoder_decoder_batch

from .helpers import tiny_config

VOCAB = 512  # the quickstart tokenizer's


def _t5(**overrides):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
        **overrides,
    )
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config)


def _bart():
    from tests.families.configs import _SEQ2SEQ  # the family matrix's tiny encoder-decoder
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(**dict(_SEQ2SEQ, vocab_size=VOCAB, encoder_layers=1, decoder_layers=1))
    torch.manual_seed(0)
    return BartForConditionalGeneration(config)


def _causal_batch():
    """Right-padded rows: a prompt, trained tokens, an untrained turn, trained tokens again."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    labels = torch.full_like(ids, -100)
    mask = torch.ones_like(ids)
    labels[0, 4:7] = ids[0, 4:7]
    labels[0, 9:12] = ids[0, 9:12]
    labels[1, 2:8] = ids[1, 2:8]
    mask[1, 8:] = 0
    ids[1, 8:] = 0
    labels[2, 0:5] = ids[2, 0:5]  # trained from position 0: the encoder keeps one token
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_rows_split_at_their_first_trained_token():
    batch = _causal_batch()
    out = encoder_decoder_batch(batch, start_id=0)
    assert out["attention_mask"].sum(1).tolist() == [4, 2, 1]
    assert out["decoder_attention_mask"].sum(1).tolist() == [1 + 8, 1 + 6, 1 + 11]
    assert out["decoder_input_ids"][:, 0].tolist() == [0, 0, 0]
    torch.testing.assert_close(out["decoder_input_ids"][0, 1:9], batch["input_ids"][0, 4:])
    torch.testing.assert_close(out["labels"][0, 1:9], batch["labels"][0, 4:])
    assert out["labels"][:, 0].tolist() == [-100] * 3
    # the trained tokens the loop counts on the causal batch are the decoder's
    assert count_trained_tokens(out["labels"]) == count_trained_tokens(batch["labels"])


def test_packed_batches_are_refused():
    batch = dict(_causal_batch(), position_ids=torch.zeros(3, 12, dtype=torch.long))
    with pytest.raises(ValueError, match=r"holds \['position_ids'\]"):
        encoder_decoder_batch(batch, start_id=0)


@pytest.mark.parametrize("build", [_t5, _bart], ids=["t5", "bart"])
def test_loss_is_the_models_own(build):
    """The model's own loss on each row's tokens from its first trained one, teacher-forced
    on those tokens (the untrained ones included, which its labels= path would replace by
    padding)."""
    model = build().eval()
    batch = _causal_batch()
    split = encoder_decoder_batch(batch, start_id=model.config.decoder_start_token_id)
    own = model(
        input_ids=split["input_ids"],
        attention_mask=split["attention_mask"],
        decoder_input_ids=split["decoder_input_ids"][:, :-1],
        decoder_attention_mask=split["decoder_attention_mask"][:, :-1],
        labels=split["labels"][:, 1:].contiguous(),
    ).loss
    own_grads = torch.autograd.grad(own, list(model.parameters()))
    ours = loss_sum(model, batch, torch.device("cpu")) / count_trained_tokens(batch["labels"])
    grads = torch.autograd.grad(ours, list(model.parameters()))
    torch.testing.assert_close(ours, own, rtol=1e-6, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), grads, own_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def _saved(tmp_path, model):
    model_dir = tmp_path / "model"
    shutil.copytree(QUICKSTART_DIR / "tokenizer", model_dir)
    model.save_pretrained(model_dir)
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
    raw = tiny_config(
        tmp_path,
        model={"name_or_path": str(model_dir)},
        max_steps=3,
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        **overrides,
    )
    return validate_config(raw)


def test_t5_trains_on_the_engine_as_in_plain_pytorch_and_reloads(tmp_path):
    """3 steps from a saved local checkpoint, plain and with every chunk offloaded: the same
    losses and weights; the export reloads as the same sequence-to-sequence class."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM, T5ForConditionalGeneration

    from protrain.train.loop import train

    model_dir = _saved(tmp_path, _t5())
    plain = train(_cfg(tmp_path / "plain", model_dir))
    memory = {"n_persist": 0, "n_buffer": 2, "chunk_size": "64KiB"}
    engine = train(_cfg(tmp_path / "engine", model_dir, memory=memory))
    assert engine.losses == pytest.approx(plain.losses, rel=1e-6, abs=1e-6)
    a = load_file(plain.final_dir / "model.safetensors")
    b = load_file(engine.final_dir / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(engine.final_dir)
    assert isinstance(reloaded, T5ForConditionalGeneration)


def test_t5_lora_exports_a_seq2seq_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM

    from protrain.train.loop import train

    model_dir = _saved(tmp_path, _t5())
    run = train(_cfg(tmp_path, model_dir, adapter={"type": "lora", "r": 4}))
    base = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(base, run.final_dir)
    assert model.peft_config["default"].task_type == "SEQ_2_SEQ_LM"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sample_packing": True}, "sample_packing = true is not allowed with an encoder-decoder"),
        (
            {"datasets": [{"path": str(QUICKSTART_DIR / "data" / "chat.jsonl"), "type": "text"}]},
            "datasets[0].type = 'text' is not allowed with an encoder-decoder model ('t5')",
        ),
        ({"train_on_inputs": True}, "train_on_inputs = true is not allowed with an encoder-"),
    ],
    ids=["packing", "text", "train_on_inputs"],
)
def test_what_a_seq2seq_run_cannot_take(tmp_path, overrides, message):
    model_dir = tmp_path / "t5"
    shutil.copytree(QUICKSTART_DIR / "tokenizer", model_dir)
    _t5().config.save_pretrained(model_dir)
    with pytest.raises(ConfigError) as info:
        model_auto_class(_cfg(tmp_path, model_dir, **overrides))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_chunked_loss_refuses_t5_s_scaled_head():
    from protrain.train.trainable import check_chunked_loss_supported

    with pytest.raises(ConfigError, match="chunked_loss_tokens is not allowed for model type 't5'"):
        check_chunked_loss_supported(_t5())
