"""Vision-language rows: images through a processor, masks on the expanded tokens."""

from __future__ import annotations

import logging

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
from protrain.train.data.vision import processor_from_pretrained_kwargs

from .helpers import expected_labels, write_jsonl
from .vision_helpers import (
    Qwen2_5_VLImageOnlyProcessor,
    Qwen2VLImageOnlyProcessor,
    Qwen3VLImageOnlyProcessor,
    ToyProcessor,
    gemma3_processor,
    pixtral_processor,
    qwen2_vl_processor,
    write_image,
)

QWEN_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
QWEN_IMAGE = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>"


def _row(image_ref, question="What?", answer="A cat."):
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ],
        "images": [image_ref],
    }


def _build(tmp_path, processor, rows, **settings):
    path = write_jsonl(tmp_path / "vl.jsonl", rows)
    s = DataSettings(datasets=[{"path": str(path)}], **settings)
    return build_train_dataset(
        s, processor.tokenizer, sequence_len=512, seed=0, processor=processor
    )


@pytest.mark.parametrize(
    "processor_cls",
    [Qwen2VLImageOnlyProcessor, Qwen2_5_VLImageOnlyProcessor, Qwen3VLImageOnlyProcessor],
)
def test_qwen_vl_assistant_only(tmp_path, processor_cls):
    write_image(tmp_path / "cat.png")
    proc = qwen2_vl_processor(processor_cls)
    item = _build(tmp_path, proc, [_row("cat.png")])[0]
    pieces = [
        (
            QWEN_SYSTEM
            + "<|im_start|>user\n"
            + QWEN_IMAGE
            + "What?<|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        ("A cat.<|im_end|>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["pixel_values"].shape == (16, 1176)
    assert item["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert item["mm_token_type_ids"] == [1 if t == proc.image_token_id else 0 for t in ids]


def test_qwen2_vl_train_on_inputs_never_trains_media_tokens(tmp_path):
    write_image(tmp_path / "cat.png")
    proc = qwen2_vl_processor()
    item = _build(tmp_path, proc, [_row("cat.png")], train_on_inputs=True)[0]
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\n", True),
        (QWEN_IMAGE, False),
        ("What?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n", True),
    ]
    assert item["labels"] == expected_labels(proc.tokenizer, pieces)[2]


def test_vl_tool_calls_follow_the_template(tmp_path):
    """With a vision-language model's role boundaries: a template that does not write a
    tool call refuses the row (Qwen2-VL's own; it trained the empty turn), and one that
    does honours train_on_tool_calls."""
    write_image(tmp_path / "cat.png")
    proc = qwen2_vl_processor()
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    row = _row("cat.png", "Weather here?", "Sunny.")
    row["messages"][1:] = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    with pytest.raises(DataError, match=r"messages\[1\].*does not render this message's tool"):
        _build(tmp_path, proc, [row])
    with_tools = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
        "{{ m.content }}{% elif m.content %}{% for p in m.content %}{% if p.type == 'image' %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}{% endfor %}"
        "{% endif %}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
        "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    )
    for on in (True, False):
        item = _build(tmp_path, proc, [row], chat_template=with_tools, train_on_tool_calls=on)[0]
        trained = proc.tokenizer.decode([t for t in item["labels"] if t != -100])
        assert ("get_weather" in trained) is on and "Sunny." in trained, trained


def test_qwen2_vl_roles_to_train_user_and_eos_none(tmp_path):
    write_image(tmp_path / "cat.png")
    proc = qwen2_vl_processor()
    item = _build(
        tmp_path, proc, [_row("cat.png")], roles_to_train=["user", "assistant"], train_on_eos="none"
    )[0]
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\n" + QWEN_IMAGE, False),
        ("What?", True),
        ("<|im_end|>\n<|im_start|>assistant\n", False),
        ("A cat.", True),
        ("<|im_end|>\n", False),
    ]
    assert item["labels"] == expected_labels(proc.tokenizer, pieces)[2]


def test_gemma3_processor_expansion(tmp_path):
    write_image(tmp_path / "cat.png")
    proc = gemma3_processor()
    row = _row("cat.png")
    row["messages"].insert(0, {"role": "system", "content": "Look closely."})
    item = _build(tmp_path, proc, [row])[0]
    image = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    pieces = [
        ("<bos><start_of_turn>user\nLook closely.\n\n" + image + "What?<end_of_turn>\n", False),
        ("<start_of_turn>model\n", False),
        ("A cat.<end_of_turn>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["pixel_values"].shape == (1, 3, 28, 28)
    assert len(item["token_type_ids"]) == len(ids)


def test_pixtral_shared_inst_marker_and_two_images(tmp_path):
    write_image(tmp_path / "a.png", (32, 32))
    write_image(tmp_path / "b.png", (32, 16))
    proc = pixtral_processor()
    row = {
        "messages": [
            {"role": "system", "content": "Sys"},
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": "Diff?"},
                    {"type": "image"},
                ],
            },
            {"role": "assistant", "content": "Sizes."},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes."},
        ],
        "images": ["a.png", "b.png"],
    }
    item = _build(tmp_path, proc, [row], train_on_eos="last")[0]
    img_a = "[IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]"
    img_b = "[IMG][IMG][IMG_END]"
    pieces = [
        (
            "<s>[SYSTEM_PROMPT]Sys[/SYSTEM_PROMPT][INST]" + img_a + "Diff?" + img_b + "[/INST]",
            False,
        ),
        ("Sizes.", True),
        ("</s>[INST]Sure?[/INST]", False),
        ("Yes.</s>", True),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["image_sizes"].tolist() == [[32, 32], [16, 32]]


def test_unknown_family_warns_once_and_aligns_text_masks(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(role_boundaries, "_warned", set())
    proc = ToyProcessor()
    write_image(tmp_path / "x.png")
    rows = [_row("x.png"), _row("x.png", answer="Dog.")]
    with caplog.at_level(logging.WARNING, logger="protrain.train.data"):
        ds = _build(tmp_path, proc, rows)
    warnings = [r for r in caplog.records if "no verified role boundaries" in r.getMessage()]
    assert len(warnings) == 1 and "role_boundaries:" in warnings[0].getMessage()
    pieces = [
        ("<|im_start|>user\n" + "<img>" * 3 + "What?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Dog.<|im_end|>", True),
        ("\n", False),
    ]
    assert ds[1]["labels"] == expected_labels(proc.tokenizer, pieces)[2]


def test_yaml_role_boundaries_override(tmp_path):
    proc = ToyProcessor()
    write_image(tmp_path / "x.png")
    boundaries = [
        {"role": "user", "start": "<|im_start|>user\n", "end": "<|im_end|>"},
        {
            "role": "assistant",
            "start": "<|im_start|>assistant\n",
            "end": "eos_token",
            "include_start": True,
        },
    ]
    item = _build(tmp_path, proc, [_row("x.png")], role_boundaries=boundaries)[0]
    pieces = [
        ("<|im_start|>user\n" + "<img>" * 3 + "What?<|im_end|>\n", False),
        ("<|im_start|>assistant\nA cat.<|im_end|>", True),
        ("\n", False),
    ]
    assert item["labels"] == expected_labels(proc.tokenizer, pieces)[2]
    # end: null runs to the end of the sequence
    boundaries[1] = {"role": "assistant", "start": "<|im_start|>assistant\n", "end": None}
    item = _build(tmp_path, proc, [_row("x.png")], role_boundaries=boundaries)[0]
    pieces[1:] = [("<|im_start|>assistant\n", False), ("A cat.<|im_end|>\n", True)]
    assert item["labels"] == expected_labels(proc.tokenizer, pieces)[2]


def test_empty_role_boundaries_is_an_override(tmp_path):
    proc = qwen2_vl_processor()
    write_image(tmp_path / "x.png")
    with pytest.raises(DataError, match="no usable sample"):
        _build(tmp_path, proc, [_row("x.png")], role_boundaries=[])


def test_role_boundary_marker_the_tokenizer_cannot_encode(tmp_path):
    proc = ToyProcessor()
    write_image(tmp_path / "x.png")
    bad = [{"role": "assistant", "start": "<start_of_turn>model\n", "end": "<end_of_turn>"}]
    with pytest.raises(
        DataError, match=r"role_boundaries\[0\].*'<start_of_turn>model\\n'.*does not have"
    ):
        _build(tmp_path, proc, [_row("x.png")], role_boundaries=bad)


# --- bad rows ---------------------------------------------------------------------------------


def test_missing_image_is_a_data_error(tmp_path):
    proc = qwen2_vl_processor()
    write_image(tmp_path / "cat.png")
    rows = [_row("cat.png"), _row("missing.png")]
    with pytest.raises(DataError) as e:
        _build(tmp_path, proc, rows)
    msg = str(e.value)
    assert (
        "row 1" in msg
        and "field 'images[0]'" in msg
        and "missing.png" in msg
        and "does not exist" in msg
    )


def test_missing_image_skipped_with_skip_bad_rows(tmp_path, caplog):
    proc = qwen2_vl_processor()
    write_image(tmp_path / "cat.png")
    rows = [_row("cat.png"), _row("missing.png"), _row("cat.png")]
    with caplog.at_level(logging.WARNING, logger="protrain.train.data"):
        ds = _build(tmp_path, proc, rows, skip_bad_rows=True)
    assert len(ds) == 2
    (warning,) = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert (
        "skipped 1 bad row(s) of 3" in warning.getMessage()
        and "missing.png" in warning.getMessage()
    )


def test_more_image_parts_than_images(tmp_path):
    proc = qwen2_vl_processor()
    row = _row("cat.png")
    row["images"] = []
    with pytest.raises(DataError, match=r"row 0, field 'images': message 0 has more image parts"):
        _build(tmp_path, proc, [row])


def test_images_without_parts_go_to_the_first_user_turn(tmp_path):
    proc = qwen2_vl_processor()
    write_image(tmp_path / "cat.png")
    row = {
        "messages": [
            {"role": "user", "content": "What?"},
            {"role": "assistant", "content": "A cat."},
        ],
        "images": ["cat.png"],
    }
    assert (
        _build(tmp_path, proc, [row])[0]["input_ids"]
        == _build(tmp_path, proc, [_row("cat.png")])[0]["input_ids"]
    )


# --- collation and processor kwargs -------------------------------------------------------------


def test_collate_and_pack_vision_items(tmp_path):
    proc = qwen2_vl_processor()
    write_image(tmp_path / "cat.png")
    ds = _build(tmp_path, proc, [_row("cat.png"), _row("cat.png", question="And?")])
    batch = build_collator(proc.tokenizer, sequence_len=512, packing=False)([ds[0], ds[1]])
    assert batch["pixel_values"].shape == (32, 1176)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    packed = _build(
        tmp_path, proc, [_row("cat.png"), _row("cat.png", question="And?")], sample_packing=True
    )
    assert len(packed) == 1
    flat = build_collator(proc.tokenizer, sequence_len=512, packing=True)([packed[0]])
    assert flat["pixel_values"].shape == (32, 1176)
    assert flat["mm_token_type_ids"].shape == flat["input_ids"].shape
    assert (flat["labels"] != IGNORE_INDEX).sum() == (batch["labels"] != IGNORE_INDEX).sum()


def test_pixel_values_of_different_sizes_are_padded(tmp_path):
    proc = pixtral_processor()
    write_image(tmp_path / "a.png", (32, 32))
    write_image(tmp_path / "b.png", (16, 32))
    rows = [
        {
            "messages": [
                {"role": "user", "content": "<image>Q"},
                {"role": "assistant", "content": "A"},
            ],
            "images": [name],
        }
        for name in ("a.png", "b.png")
    ]
    ds = _build(tmp_path, proc, rows)
    batch = build_collator(proc.tokenizer, sequence_len=512, packing=False)([ds[0], ds[1]])
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    assert torch.equal(batch["image_sizes"], torch.tensor([[32, 32], [32, 16]]))


def test_managed_processor_kwargs_are_warned_and_ignored(caplog):
    settings = DataSettings(
        processor_kwargs={"revision": "x", "trust_remote_code": True, "min_pixels": 1}
    )
    with caplog.at_level(logging.WARNING, logger="protrain.train.data"):
        assert processor_from_pretrained_kwargs(settings) == {"min_pixels": 1}
    assert sum("is ignored" in r.getMessage() for r in caplog.records) == 2


def test_llama3_2_vision_processor(tmp_path):
    from .vision_helpers import mllama_processor

    write_image(tmp_path / "cat.png")
    proc = mllama_processor()
    item = _build(tmp_path, proc, [_row("cat.png")])[0]
    pieces = [
        (
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>What?<|eot_id|>",
            False,
        ),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", False),
        ("A cat.<|eot_id|>", True),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["pixel_values"].shape == (1, 1, 1, 3, 28, 28)
    assert item["cross_attention_mask"].shape == (1, len(ids), 1, 1)
    batch = build_collator(proc.tokenizer, sequence_len=512, packing=False)([item, item])
    assert batch["cross_attention_mask"].shape == (2, len(ids), 1, 1)


def test_load_processor_from_a_folder(tmp_path, caplog):
    from pydantic import ValidationError

    from protrain.train.data import load_processor

    gemma3_processor().save_pretrained(str(tmp_path))
    settings = DataSettings(
        processor_type="Gemma3Processor", processor_kwargs={"image_seq_length": 2, "revision": "x"}
    )
    with caplog.at_level(logging.WARNING, logger="protrain.train.data"):
        processor = load_processor(settings, str(tmp_path))
    assert type(processor).__name__ == "Gemma3Processor" and processor.image_seq_length == 2
    assert any("processor_kwargs.revision" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValidationError, match="processor_type: 'NopeProcessor'"):
        DataSettings(processor_type="NopeProcessor")


def test_llama3_2_vision_rows_cannot_be_packed(tmp_path):
    from .vision_helpers import mllama_processor

    write_image(tmp_path / "cat.png")
    with pytest.raises(DataError, match="field 'sample_packing'.*cross_attention_mask"):
        _build(tmp_path, mllama_processor(), [_row("cat.png")], sample_packing=True)
