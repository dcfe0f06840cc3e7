"""Video rows through transformers' own Qwen-VL video processors (they need torchvision):
frames expanded into `<|video_pad|>` tokens, masks on the expanded tokens, collation, packing."""

from __future__ import annotations

import pytest

pytest.importorskip("torchvision")

from transformers import (  # noqa: E402
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from protrain.train.data import IGNORE_INDEX, DataError, build_collator  # noqa: E402
from protrain.train.data import video as video_module  # noqa: E402

from .helpers import expected_labels  # noqa: E402
from .test_video_frames import (  # noqa: E402
    QWEN_SYSTEM,
    build,
    qwen_video,
    video_row,
    write_frames,
)
from .vision_helpers import qwen2_vl_processor, write_image  # noqa: E402

QWEN_IMAGE = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>"


def video_processor_for(processor_cls):
    """56x56 frames into a 4x4 patch grid (2x2 merged: 4 tokens per temporal step of 2 frames)."""
    if processor_cls is Qwen3VLProcessor:
        # 16-pixel patches, so frames are resized to 64x64; the limits are over all frames.
        return Qwen3VLVideoProcessor(
            size={"shortest_edge": 32 * 32, "longest_edge": 4 * 64 * 64},
            patch_size=16,
            merge_size=2,
            temporal_patch_size=2,
            cap_pixels_per_frame=False,
        )
    return Qwen2VLVideoProcessor(
        min_pixels=28 * 28,
        max_pixels=56 * 56,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        cap_pixels_per_frame=False,
    )


def video_processor(processor_cls):
    """A real Qwen-VL processor with the tests' tokenizer and image processor and a small
    video processor of its family."""
    base = qwen2_vl_processor()
    return processor_cls(
        image_processor=base.image_processor,
        tokenizer=base.tokenizer,
        video_processor=video_processor_for(processor_cls),
        chat_template=base.chat_template,
    )


PROCESSORS = [Qwen2VLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor]
PATCH_DIM = {Qwen2VLProcessor: 1176, Qwen2_5_VLProcessor: 1176, Qwen3VLProcessor: 1536}


@pytest.mark.parametrize("processor_cls", PROCESSORS)
def test_video_assistant_only(tmp_path, processor_cls):
    frames = write_frames(tmp_path / "clip")
    proc = video_processor(processor_cls)
    item = build(tmp_path, proc, [video_row(frames)])[0]
    assert item["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert item["pixel_values_videos"].shape == (32, PATCH_DIM[processor_cls])
    video = qwen_video(processor_cls, (2, 4, 4))
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\n" + video + "What?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("A cat.<|im_end|>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["mm_token_type_ids"] == [2 if t == proc.video_token_id else 0 for t in ids]
    if processor_cls is Qwen2_5_VLProcessor:
        # two frames per temporal step at the row's 1 frame per second
        assert item["second_per_grid_ts"].tolist() == [2.0]


@pytest.mark.parametrize("processor_cls", PROCESSORS)
def test_video_train_on_inputs_never_trains_video_tokens(tmp_path, processor_cls):
    frames = write_frames(tmp_path / "clip")
    proc = video_processor(processor_cls)
    item = build(tmp_path, proc, [video_row(frames)], train_on_inputs=True)[0]
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\n", True),
        (qwen_video(processor_cls, (2, 4, 4)), False),  # Qwen3-VL's timestamps included
        ("What?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n", True),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels


@pytest.mark.parametrize("processor_cls", PROCESSORS)
def test_video_roles_to_train_user_and_eos_none(tmp_path, processor_cls):
    frames = write_frames(tmp_path / "clip")
    proc = video_processor(processor_cls)
    item = build(
        tmp_path,
        proc,
        [video_row(frames)],
        roles_to_train=["user", "assistant"],
        train_on_eos="none",
    )[0]
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\n" + qwen_video(processor_cls, (2, 4, 4)), False),
        ("What?", True),
        ("<|im_end|>\n<|im_start|>assistant\n", False),
        ("A cat.", True),
        ("<|im_end|>\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels


@pytest.mark.parametrize("processor_cls", PROCESSORS)
def test_image_and_video_in_one_row(tmp_path, processor_cls):
    write_frames(tmp_path / "clip", n=2)
    write_image(tmp_path / "cat.png")
    proc = video_processor(processor_cls)
    row = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "cat.png"},
                    {"type": "video", "video": "clip", "fps": 1},  # a folder of frames
                    {"type": "text", "text": "Same?"},
                ],
            },
            {"role": "assistant", "content": "Yes."},
        ]
    }
    item = build(tmp_path, proc, [row])[0]
    assert item["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert item["video_grid_thw"].tolist() == [[1, 4, 4]]
    video = qwen_video(processor_cls, (1, 4, 4))
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\n" + QWEN_IMAGE + video + "Same?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("Yes.<|im_end|>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    types = {proc.image_token_id: 1, proc.video_token_id: 2}
    assert item["mm_token_type_ids"] == [types.get(t, 0) for t in ids]


@pytest.mark.parametrize("processor_cls", PROCESSORS)
def test_collate_and_pack_video_items(tmp_path, processor_cls):
    frames = write_frames(tmp_path / "clip")
    proc = video_processor(processor_cls)
    rows = [video_row(frames), video_row(frames[:2], question="And?")]
    ds = build(tmp_path, proc, rows)
    dim = PATCH_DIM[processor_cls]
    batch = build_collator(proc.tokenizer, sequence_len=1024, packing=False)([ds[0], ds[1]])
    assert batch["pixel_values_videos"].shape == (32 + 16, dim)
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4], [1, 4, 4]]
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    packed = build(tmp_path, proc, rows, sample_packing=True)
    assert len(packed) == 1
    flat = build_collator(proc.tokenizer, sequence_len=1024, packing=True)([packed[0]])
    assert flat["pixel_values_videos"].shape == (48, dim)
    assert flat["video_grid_thw"].tolist() == [[2, 4, 4], [1, 4, 4]]
    assert flat["mm_token_type_ids"].shape == flat["input_ids"].shape
    assert (flat["labels"] != IGNORE_INDEX).sum() == (batch["labels"] != IGNORE_INDEX).sum()
    if processor_cls is Qwen2_5_VLProcessor:
        assert flat["second_per_grid_ts"].tolist() == [2.0, 2.0]


def test_missing_frame_is_a_data_error(tmp_path):
    frames = write_frames(tmp_path / "clip")
    proc = video_processor(Qwen2VLProcessor)
    with pytest.raises(DataError) as e:
        build(tmp_path, proc, [video_row(frames), video_row([frames[0], "clip/gone.png"])])
    msg = str(e.value)
    assert "row 1" in msg and "field 'messages[0].content[0]'" in msg
    assert "video frame 1 'clip/gone.png' does not exist" in msg


def test_video_file_without_a_decoder_is_a_data_error(tmp_path, monkeypatch):
    monkeypatch.setattr(video_module, "video_decoder", lambda: None)
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    proc = video_processor(Qwen3VLProcessor)
    with pytest.raises(DataError) as e:
        build(tmp_path, proc, [video_row("clip.mp4", fps=None)])
    msg = str(e.value)
    assert "row 0" in msg and "field 'messages[0].content[0]'" in msg
    assert "no video decoder is installed" in msg
    assert "list of frame images or a folder of frame images" in msg
