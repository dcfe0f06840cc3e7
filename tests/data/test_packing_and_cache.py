"""Packing, padding-free collation, the preprocess cache, and config validation."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from protrain.train.data import (
    IGNORE_INDEX,
    DataSettings,
    build_collator,
    build_train_dataset,
    preprocess,
)
from protrain.train.data.packing import plan_bins
from protrain.train.data.prepared import load_prepared

from .helpers import byte_tokenizer, write_jsonl

CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture
def tok():
    return byte_tokenizer(CHATML_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>")


def _rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": "q" * (1 + i % 7)},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i in range(n)
    ]


def _settings(path, **kw) -> DataSettings:
    return DataSettings(datasets=[{"path": str(path)}], chat_template="chatml", **kw)


def test_plan_bins_fits_and_is_seeded():
    lengths = [5, 9, 3, 7, 2, 8, 4, 6, 1, 10]
    bins = plan_bins(lengths, 12, seed=0)
    assert sorted(i for b in bins for i in b) == list(range(10))
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert bins == plan_bins(lengths, 12, seed=0)
    assert len(bins) == 5  # 55 tokens in bins of 12: the best possible


def test_packed_items_restart_positions(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", _rows(12))
    plain = build_train_dataset(_settings(path), tok, sequence_len=128, seed=0)
    packed = build_train_dataset(
        _settings(path, sample_packing=True), tok, sequence_len=128, seed=0
    )
    assert len(packed) < len(plain)
    assert sum(len(p["input_ids"]) for p in packed) == sum(len(x["input_ids"]) for x in plain)
    originals = {tuple(x["input_ids"]): x["labels"] for x in plain}
    for pack in packed:
        assert len(pack["input_ids"]) <= 128
        starts = [k for k, p in enumerate(pack["position_ids"]) if p == 0] + [
            len(pack["input_ids"])
        ]
        assert starts[0] == 0
        for a, b in zip(starts, starts[1:]):
            assert pack["position_ids"][a:b] == list(range(b - a))
            assert originals[tuple(pack["input_ids"][a:b])] == pack["labels"][a:b]
    again = build_train_dataset(_settings(path, sample_packing=True), tok, sequence_len=128, seed=0)
    assert [p["input_ids"] for p in again] == [p["input_ids"] for p in packed]


def test_padding_free_collation(tok):
    items = [
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "position_ids": [0, 1, 2]},
        {
            "input_ids": [8, 9, 10, 11],
            "labels": [IGNORE_INDEX, 9, 10, 11],
            "position_ids": [0, 1, 0, 1],
        },
    ]
    batch = build_collator(tok, sequence_len=16, packing=True, pad_to_multiple_of=4)(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, tok.pad_token_id]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 0]]
    # the first token of each sample is never a target: nothing before it belongs to its sample
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, IGNORE_INDEX, 11, IGNORE_INDEX]
    ]
    assert "attention_mask" not in batch
    unpacked = [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3], "labels": [3]}]
    flat = build_collator(tok, sequence_len=16, packing=True)(unpacked)
    assert flat["position_ids"].tolist() == [[0, 1, 0]]
    assert flat["labels"].tolist() == [[IGNORE_INDEX, 2, IGNORE_INDEX]]


def test_padded_collation_accepts_tensors(tok):
    items = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([IGNORE_INDEX, 2, 3])}]
    batch = build_collator(tok, sequence_len=8, packing=False)(items)
    assert batch["input_ids"].tolist() == [[1, 2, 3]] and batch["attention_mask"].tolist() == [
        [1, 1, 1]
    ]


def test_preprocess_then_reuse(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", _rows(6))
    settings = _settings(path, dataset_prepared_path=str(tmp_path / "prepared"), val_set_size=2)
    folder = preprocess(settings, tok, sequence_len=64, seed=1, output_path=None)
    assert (folder / "train").exists() and (folder / "eval").exists()
    cached = load_prepared(settings, tok, sequence_len=64, seed=1, split="train")
    fresh = build_train_dataset(_settings(path, val_set_size=2), tok, sequence_len=64, seed=1)
    assert [cached[i]["input_ids"] for i in range(len(cached))] == [
        fresh[i]["input_ids"] for i in range(len(fresh))
    ]
    assert len(build_train_dataset(settings, tok, sequence_len=64, seed=1)) == len(fresh)
    # another sequence_len or seed is another cache entry
    assert load_prepared(settings, tok, sequence_len=32, seed=1, split="train") is None
    assert load_prepared(settings, tok, sequence_len=64, seed=2, split="train") is None


# --- config validation: the message names the key, the value and what is allowed ------------


@pytest.mark.parametrize(
    "raw,words",
    [
        (
            {"train_on_eos": "sometimes"},
            ["train_on_eos", "sometimes", "'turn'", "'last'", "'all'", "'none'"],
        ),
        (
            {"roles_to_train": ["assistant", "narrator"]},
            ["roles_to_train", "narrator", "allowed roles"],
        ),
        ({"chat_template": "chatmlx"}, ["chat_template", "chatmlx", "chatml", "Jinja"]),
        ({"datasets": [{"path": "x", "type": "dialog"}]}, ["datasets.0.type", "dialog", "'chat'"]),
        (
            {"datasets": [{"path": "x", "fields": 1}]},
            ["datasets.0.fields", "Extra inputs are not permitted"],
        ),
        (
            {"role_boundaries": [{"role": "assistant", "end": None}]},
            ["role_boundaries.0.start", "Field required"],
        ),
        (
            {"role_boundaries": [{"role": "bot", "start": "x", "end": None}]},
            ["role_boundaries.0.role", "bot"],
        ),
        ({"val_set_size": 2.5}, ["val_set_size", "2.5"]),
    ],
)
def test_config_errors_name_key_value_and_allowed(raw, words):
    with pytest.raises(ValidationError) as e:
        DataSettings(**raw)
    msg = str(e.value)
    for w in words:
        assert w in msg, (w, msg)


def test_empty_role_boundaries_stays_an_explicit_list():
    assert DataSettings(role_boundaries=[]).role_boundaries == []
    assert DataSettings().role_boundaries is None


def test_hold_out_is_not_encoded_twice(tmp_path, tok, monkeypatch):
    from protrain.train.data import build_eval_dataset, dataset

    reads = []
    real = dataset.read_rows
    monkeypatch.setattr(dataset, "read_rows", lambda cfg: reads.append(cfg) or real(cfg))
    path = write_jsonl(tmp_path / "c.jsonl", _rows(10))
    settings = _settings(path, val_set_size=0.3)
    train = build_train_dataset(settings, tok, sequence_len=64, seed=0)
    val = build_eval_dataset(settings, tok, sequence_len=64, seed=0)
    assert len(train) == 7 and len(val) == 3 and len(reads) == 1


def test_settings_checked_before_any_file_is_read(tmp_path, tok):
    from protrain.train.data import DataError

    settings = DataSettings(
        datasets=[{"path": str(tmp_path / "missing.jsonl")}],
        chat_template="chatml",
        role_boundaries=[{"role": "assistant", "start": "<|turn>model\n", "end": None}],
    )
    with pytest.raises(DataError, match="role_boundaries"):
        build_train_dataset(settings, tok, sequence_len=64, seed=0)


def test_packed_batch_keeps_samples_apart_in_a_model(tmp_path, tok):
    """transformers builds a per-sample causal mask from restarting `position_ids` when no
    attention mask and no KV cache are given (sdpa and eager alike)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = write_jsonl(tmp_path / "c.jsonl", _rows(3))
    packed = build_train_dataset(
        _settings(path, sample_packing=True), tok, sequence_len=128, seed=0
    )
    assert len(packed) == 1
    batch = build_collator(tok, sequence_len=128, packing=True)([packed[0]])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    positions = batch["position_ids"][0].tolist()
    starts = [k for k, p in enumerate(positions) if p == 0]
    assert len(starts) == 3
    with torch.no_grad():
        ids = batch["input_ids"]
        logits = model(input_ids=ids, position_ids=batch["position_ids"], use_cache=False).logits[0]
        for start, end in zip(starts, [*starts[1:], len(positions)]):
            alone = model(input_ids=ids[:, start:end], use_cache=False).logits[0]
            assert torch.allclose(logits[start:end], alone, atol=1e-5)


def test_a_cache_is_keyed_by_the_media_processor(tmp_path, tok):
    """Rows of a vision-language model depend on its processor (tokens per image, pixel
    sizes): a cache written without it, or with another image processor, is not reused."""
    from protrain.train.data.prepared import fingerprint

    from .vision_helpers import gemma3_processor

    path = write_jsonl(tmp_path / "c.jsonl", _rows(2))
    settings = _settings(path)
    first, second = gemma3_processor(), gemma3_processor()
    second.image_processor.size = {"height": 56, "width": 56}

    def fp(processor):
        return fingerprint(settings, tok, sequence_len=64, seed=1, processor=processor)

    assert fp(None) != fp(first) != fp(second)
    assert fp(first) == fp(gemma3_processor())


def test_a_cache_is_keyed_by_the_contents_of_a_template_file(tmp_path, tok):
    """A chat template named by its file renders every row: editing the file (same path)
    makes a new cache, not a stale one."""
    from protrain.train.data.prepared import fingerprint
    from protrain.train.data.templates import BUILTIN_TEMPLATES

    path = write_jsonl(tmp_path / "c.jsonl", _rows(2))
    template = tmp_path / "t.jinja"
    template.write_text(BUILTIN_TEMPLATES["chatml"])
    settings = DataSettings(datasets=[{"path": str(path)}], chat_template=str(template))

    def fp():
        return fingerprint(settings, tok, sequence_len=64, seed=1)

    before = fp()
    assert fp() == before
    template.write_text("{{ 'Be terse.' }}" + BUILTIN_TEMPLATES["chatml"])
    assert fp() != before
