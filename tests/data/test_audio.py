"""Audio rows: WAV files through an audio processor, masks on the expanded tokens."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from protrain.train.data import (
    IGNORE_INDEX,
    DataError,
    DataSettings,
    build_collator,
    build_train_dataset,
    role_boundaries,
)
from protrain.train.data.audio import AudioReader, read_wav
from protrain.train.data.inspect import render_inspection

from .audio_helpers import gemma3n_processor, qwen2_audio_processor, write_wav
from .helpers import expected_labels, write_jsonl
from .vision_helpers import qwen2_vl_processor

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def audio_tokens(n: int, k: int = 1) -> str:
    return f"Audio {k}: <|audio_bos|>" + "<|AUDIO|>" * n + "<|audio_eos|>\n"


def _row(audio_ref, question="What?", answer="A bell."):
    return {
        "messages": [
            {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ],
        "audios": [audio_ref],
    }


def _settings(tmp_path, rows, **settings):
    path = write_jsonl(tmp_path / "audio.jsonl", rows)
    return DataSettings(datasets=[{"path": str(path)}], **settings)


def _build(tmp_path, processor, rows, **settings):
    s = _settings(tmp_path, rows, **settings)
    return build_train_dataset(
        s, processor.tokenizer, sequence_len=512, seed=0, processor=processor
    )


# --- masks --------------------------------------------------------------------------------------


def test_qwen2_audio_assistant_only(tmp_path):
    write_wav(tmp_path / "bell.wav", seconds=0.5)
    proc = qwen2_audio_processor()
    item = _build(tmp_path, proc, [_row("bell.wav")])[0]
    pieces = [
        (
            SYSTEM
            + "<|im_start|>user\n"
            + audio_tokens(12)
            + "What?<|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        ("A bell.<|im_end|>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["input_features"].shape == (1, 8, 100)
    assert item["feature_attention_mask"].shape == (1, 100)
    assert item["feature_attention_mask"].sum().item() == 50


def test_qwen2_audio_train_on_inputs_never_trains_audio_tokens(tmp_path):
    write_wav(tmp_path / "bell.wav", seconds=0.5)
    proc = qwen2_audio_processor()
    item = _build(tmp_path, proc, [_row("bell.wav")], train_on_inputs=True)[0]
    pieces = [
        (SYSTEM + "<|im_start|>user\nAudio 1: ", True),
        ("<|audio_bos|>" + "<|AUDIO|>" * 12 + "<|audio_eos|>", False),
        ("\nWhat?<|im_end|>\n<|im_start|>assistant\nA bell.<|im_end|>\n", True),
    ]
    assert item["labels"] == expected_labels(proc.tokenizer, pieces)[2]


def test_qwen2_audio_roles_to_train_user_and_eos_none(tmp_path):
    write_wav(tmp_path / "bell.wav", seconds=0.5)
    proc = qwen2_audio_processor()
    item = _build(
        tmp_path,
        proc,
        [_row("bell.wav")],
        roles_to_train=["user", "assistant"],
        train_on_eos="none",
    )[0]
    pieces = [
        (SYSTEM + "<|im_start|>user\n", False),
        ("Audio 1: ", True),
        ("<|audio_bos|>" + "<|AUDIO|>" * 12 + "<|audio_eos|>", False),
        ("\nWhat?", True),
        ("<|im_end|>\n<|im_start|>assistant\n", False),
        ("A bell.", True),
        ("<|im_end|>\n", False),
    ]
    assert item["labels"] == expected_labels(proc.tokenizer, pieces)[2]


def test_two_audios_of_different_lengths_multi_turn_eos_last(tmp_path):
    (tmp_path / "clips").mkdir()
    write_wav(tmp_path / "clips" / "a.wav", seconds=0.5)
    write_wav(tmp_path / "b.wav", seconds=0.3)
    proc = qwen2_audio_processor()
    row = {
        "messages": [
            {"role": "system", "content": "Listen."},
            {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "This?"}]},
            {"role": "assistant", "content": "A tone."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "And "}, {"type": "audio", "path": "b.wav"}],
            },
            {"role": "assistant", "content": "Shorter."},
        ],
        "audios": ["clips/a.wav"],
    }
    item = _build(tmp_path, proc, [row], train_on_eos="last")[0]
    pieces = [
        (
            "<|im_start|>system\nListen.<|im_end|>\n<|im_start|>user\n"
            + audio_tokens(12)
            + "This?<|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        ("A tone.", True),
        ("<|im_end|>\n<|im_start|>user\nAnd " + audio_tokens(7, 2), False),
        ("<|im_end|>\n<|im_start|>assistant\n", False),
        ("Shorter.<|im_end|>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["input_features"].shape == (2, 8, 100)
    assert item["feature_attention_mask"].sum(-1).tolist() == [50, 30]


def test_audio_placeholder_in_text_and_column_without_parts(tmp_path):
    write_wav(tmp_path / "bell.wav", seconds=0.5)
    proc = qwen2_audio_processor()
    reference = _build(tmp_path, proc, [_row("bell.wav")])[0]
    in_text = {
        "messages": [
            {"role": "user", "content": "<audio>What?"},
            {"role": "assistant", "content": "A bell."},
        ],
        "audios": "bell.wav",  # a single value is taken as a list of one
    }
    no_parts = {
        "messages": [
            {"role": "user", "content": "What?"},
            {"role": "assistant", "content": "A bell."},
        ],
        "audios": ["bell.wav"],
    }
    for row in (in_text, no_parts):
        item = _build(tmp_path, proc, [row])[0]
        assert item["input_ids"] == reference["input_ids"]
        assert item["labels"] == reference["labels"]


GEMMA3N_AUDIO = "<start_of_audio>" + "<audio_soft_token>" * 5 + "<end_of_audio>"


def test_gemma3n_audio_assistant_only_and_train_on_inputs(tmp_path):
    write_wav(tmp_path / "bell.wav", seconds=0.5)
    proc = gemma3n_processor()
    assert role_boundaries.detect_family(proc, None) == "gemma3n"
    row = _row("bell.wav")
    row["messages"].insert(0, {"role": "system", "content": "Listen."})
    item = _build(tmp_path, proc, [row])[0]
    pieces = [
        ("<bos><start_of_turn>user\nListen.\n\n\n\n" + GEMMA3N_AUDIO + "\n\nWhat?", False),
        ("<end_of_turn>\n<start_of_turn>model\n", False),
        ("A bell.<end_of_turn>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["input_features"].shape == (1, 48, 8)
    assert item["input_features_mask"].shape == (1, 48) and item["input_features_mask"].all()
    assert item["token_type_ids"] == [3 if t == proc.audio_token_id else 0 for t in ids]
    item = _build(tmp_path, proc, [row], train_on_inputs=True)[0]
    pieces = [
        ("<bos><start_of_turn>user\nListen.\n\n\n\n", True),
        (GEMMA3N_AUDIO, False),
        ("\n\nWhat?<end_of_turn>\n<start_of_turn>model\nA bell.<end_of_turn>\n", True),
    ]
    assert item["labels"] == expected_labels(proc.tokenizer, pieces)[2]


def test_gemma3n_collate_pads_features_and_mask(tmp_path):
    write_wav(tmp_path / "long.wav", seconds=0.5)
    write_wav(tmp_path / "short.wav", seconds=0.3)
    proc = gemma3n_processor()
    ds = _build(tmp_path, proc, [_row("long.wav"), _row("short.wav")])
    assert ds[1]["input_features"].shape == (1, 28, 8)
    batch = build_collator(proc.tokenizer, sequence_len=512, packing=False)([ds[0], ds[1]])
    assert batch["input_features"].shape == (2, 48, 8)
    assert batch["input_features_mask"].dtype == torch.bool
    assert batch["input_features_mask"].sum(-1).tolist() == [48, 28]
    assert batch["input_features"][1, 28:].eq(0).all()
    assert batch["token_type_ids"].shape == batch["input_ids"].shape


def test_qwen2_audio_family_boundaries():
    proc = qwen2_audio_processor()
    assert role_boundaries.detect_family(proc, None) == "qwen2_audio"
    assert role_boundaries.detect_family(None, proc.chat_template) == "qwen2_audio"
    never = role_boundaries.media_token_ids(proc.tokenizer, proc)
    vocab = proc.tokenizer.get_vocab()
    assert {vocab[t] for t in ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")} <= never


# --- bad rows -------------------------------------------------------------------------------------


def test_missing_audio_is_a_data_error(tmp_path):
    write_wav(tmp_path / "bell.wav")
    proc = qwen2_audio_processor()
    with pytest.raises(DataError) as e:
        _build(tmp_path, proc, [_row("bell.wav"), _row("missing.wav")])
    msg = str(e.value)
    assert "audio.jsonl" in msg and "row 1" in msg and "field 'audios[0]'" in msg
    assert "missing.wav" in msg and "does not exist" in msg
    part_row = {
        "messages": [
            {"role": "user", "content": [{"type": "audio", "audio": "nope.wav"}]},
            {"role": "assistant", "content": "A bell."},
        ]
    }
    with pytest.raises(DataError, match=r"row 0, field 'messages\[0\].content\[0\]'.*nope.wav"):
        _build(tmp_path, proc, [part_row])


def test_missing_audio_skipped_with_skip_bad_rows(tmp_path, caplog):
    write_wav(tmp_path / "bell.wav")
    proc = qwen2_audio_processor()
    rows = [_row("bell.wav"), _row("missing.wav"), _row("gone.wav"), _row("bell.wav")]
    with caplog.at_level(logging.WARNING, logger="protrain.train.data"):
        ds = _build(tmp_path, proc, rows, skip_bad_rows=True)
    assert len(ds) == 2
    (warning,) = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert "skipped 2 bad row(s) of 4" in warning.getMessage()
    assert "missing.wav" in warning.getMessage()


def test_wrong_sampling_rate_is_not_resampled(tmp_path):
    write_wav(tmp_path / "low.wav", rate=8000)
    with pytest.raises(
        DataError, match=r"row 0, field 'audios\[0\]'.*8000 Hz; the processor requires 16000 Hz"
    ):
        _build(tmp_path, qwen2_audio_processor(), [_row("low.wav")])


def test_audio_longer_than_the_processor_window(tmp_path):
    write_wav(tmp_path / "long.wav", seconds=1.5)
    with pytest.raises(DataError, match=r"field 'audios\[0\]'.*1.50 s long.*window is 1.00 s"):
        _build(tmp_path, qwen2_audio_processor(), [_row("long.wav")])


def test_audio_from_path_dicts_arrays_and_bytes(tmp_path):
    write_wav(tmp_path / "bell.wav", seconds=0.5)
    proc = qwen2_audio_processor()
    reference = _build(tmp_path, proc, [_row("bell.wav")])[0]
    samples, _ = read_wav(tmp_path / "bell.wav")
    for source in ({"path": "bell.wav"}, {"array": samples.tolist(), "sampling_rate": 16000}):
        row = {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "audio", "audio": source},
                        {"type": "text", "text": "What?"},
                    ],
                },
                {"role": "assistant", "content": "A bell."},
            ]
        }
        item = _build(tmp_path, proc, [row])[0]
        assert item["input_ids"] == reference["input_ids"]
        torch.testing.assert_close(item["input_features"], reference["input_features"])
    reader = AudioReader("d", tmp_path, 16000)
    from_bytes = reader.load({"bytes": (tmp_path / "bell.wav").read_bytes()}, 0, "audios[0]")
    np.testing.assert_array_equal(from_bytes, samples)
    with pytest.raises(DataError, match="needs an integer 'sampling_rate'"):
        reader.load({"array": [0.0]}, 0, "audios[0]")


def test_unreadable_audio_and_url(tmp_path):
    (tmp_path / "clip.wav").write_bytes(b"fLaC not a wav file")
    proc = qwen2_audio_processor()
    with pytest.raises(DataError, match=r"field 'audios\[0\]'.*cannot read.*PCM WAV"):
        _build(tmp_path, proc, [_row("clip.wav")])
    with pytest.raises(DataError, match=r"field 'audios\[0\]'.*audio URL"):
        _build(tmp_path, proc, [_row("https://example.com/a.wav")])


def test_more_audio_parts_than_audios(tmp_path):
    row = _row("x.wav")
    row["audios"] = []
    with pytest.raises(DataError, match=r"row 0, field 'audios': message 0 has more audio parts"):
        _build(tmp_path, qwen2_audio_processor(), [row])


def test_audio_with_a_processor_that_takes_no_audio(tmp_path):
    write_wav(tmp_path / "bell.wav")
    with pytest.raises(DataError, match=r"field 'audios\[0\]'.*no feature extractor"):
        _build(tmp_path, qwen2_vl_processor(), [_row("bell.wav")])


def test_video_parts_need_a_video_processor(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "video"}]},
            {"role": "assistant", "content": "A"},
        ]
    }
    with pytest.raises(DataError, match=r"content\[0\]'.*has no video processor"):
        _build(tmp_path, qwen2_audio_processor(), [row])


# --- reading WAV --------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_read_wav_widths_and_stereo(tmp_path, width):
    left = np.array([0.0, 0.5, -0.5, 0.25])
    right = np.array([0.5, 0.5, -0.25, -0.25])
    write_wav(
        tmp_path / "s.wav", rate=22050, width=width, channels=2, samples=np.stack([left, right], 1)
    )
    samples, rate = read_wav(tmp_path / "s.wav")
    assert rate == 22050 and samples.dtype == np.float32
    np.testing.assert_allclose(samples, (left + right) / 2, atol=2 / 2 ** (8 * width - 1) + 1e-7)


# --- collation, packing, inspection ---------------------------------------------------------------


def test_collate_pads_audio_features(tmp_path):
    write_wav(tmp_path / "long.wav", seconds=0.5)
    write_wav(tmp_path / "short.wav", seconds=0.3)
    proc = qwen2_audio_processor()
    ds = _build(tmp_path, proc, [_row("long.wav"), _row("short.wav", answer="Beep.")])
    batch = build_collator(proc.tokenizer, sequence_len=512, packing=False)([ds[0], ds[1]])
    assert batch["input_features"].shape == (2, 8, 100)
    assert batch["feature_attention_mask"].shape == (2, 100)
    assert batch["feature_attention_mask"].sum(-1).tolist() == [50, 30]
    n0, n1 = len(ds[0]["input_ids"]), len(ds[1]["input_ids"])
    assert batch["input_ids"].shape == (2, max(n0, n1))
    assert batch["attention_mask"].sum(-1).tolist() == [n0, n1]
    assert batch["labels"][1, n1:].eq(IGNORE_INDEX).all()


def test_pack_audio_rows(tmp_path):
    write_wav(tmp_path / "long.wav", seconds=0.5)
    write_wav(tmp_path / "short.wav", seconds=0.3)
    proc = qwen2_audio_processor()
    rows = [_row("long.wav"), _row("short.wav", answer="Beep.")]
    ds = _build(tmp_path, proc, rows)
    packed = _build(tmp_path, proc, rows, sample_packing=True)
    assert len(packed) == 1
    pack = packed[0]
    assert pack["input_ids"] == ds[0]["input_ids"] + ds[1]["input_ids"]
    assert pack["labels"] == ds[0]["labels"] + ds[1]["labels"]
    assert pack["feature_attention_mask"].sum(-1).tolist() == [50, 30]
    flat = build_collator(proc.tokenizer, sequence_len=512, packing=True)([pack])
    assert flat["input_features"].shape == (2, 8, 100)
    n0 = len(ds[0]["input_ids"])
    assert flat["position_ids"][0, n0].item() == 0
    audio_id = proc.audio_token_id
    assert (flat["input_ids"] == audio_id).sum().item() == 12 + 7


def test_inspect_data_shows_audio_placeholders_compactly(tmp_path):
    write_wav(tmp_path / "bell.wav", seconds=0.5)
    proc = qwen2_audio_processor()
    text = render_inspection(
        _settings(tmp_path, [_row("bell.wav")]), proc.tokenizer, sequence_len=512, processor=proc
    )
    assert "Audio 1: <|audio_bos|><|AUDIO|>×12<|audio_eos|>\nWhat?" in text
    assert "[[A bell.<|im_end|>]]" in text
    assert "<|AUDIO|><|AUDIO|>" not in text


def test_packed_audio_batch_matches_unpacked_in_a_model(tmp_path):
    """A tiny Qwen2-Audio model sees the same logits for each sample packed as alone."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    write_wav(tmp_path / "long.wav", seconds=0.5)
    write_wav(tmp_path / "short.wav", seconds=0.3)
    proc = qwen2_audio_processor()
    rows = [_row("long.wav"), _row("short.wav", answer="Beep.")]
    ds = _build(tmp_path, proc, rows)
    packed = _build(tmp_path, proc, rows, sample_packing=True)
    cfg = Qwen2AudioConfig(
        audio_config=dict(
            num_mel_bins=8,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            d_model=16,
            max_source_positions=50,
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(proc.tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        audio_token_id=proc.audio_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(cfg).eval()
    alone = build_collator(proc.tokenizer, sequence_len=512, packing=False)
    flat = build_collator(proc.tokenizer, sequence_len=512, packing=True)([packed[0]])
    with torch.no_grad():
        expected = [model(**alone([item]), use_cache=False).logits[0] for item in (ds[0], ds[1])]
        got = model(**flat, use_cache=False).logits[0]
    n0 = len(ds[0]["input_ids"])
    torch.testing.assert_close(got[:n0], expected[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[n0:], expected[1], atol=1e-5, rtol=1e-4)
