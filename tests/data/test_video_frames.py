"""Video rows without torchvision: frames read from images, the errors, and the whole encode
path through the real Qwen-VL processors with a stand-in video processor (transformers' own
video processors need torchvision; `test_video_rows.py` runs them where it is installed)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import BatchFeature
from transformers.video_utils import make_batched_metadata, make_batched_videos

from protrain.train.data import (
    IGNORE_INDEX,
    DataError,
    DataSettings,
    build_collator,
    build_train_dataset,
)
from protrain.train.data import video as video_module
from protrain.train.data.video import VideoReader

from .helpers import expected_labels, write_jsonl
from .vision_helpers import (
    Qwen2_5_VLImageOnlyProcessor,
    Qwen2VLImageOnlyProcessor,
    Qwen3VLImageOnlyProcessor,
    qwen2_vl_processor,
    write_image,
)

QWEN_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def write_frames(folder, n=4, size=(56, 56)):
    """Frame images `f0.png` ... in a folder, frame k filled with red level 10 * k."""
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        Image.new("RGB", size, (10 * k, 0, 0)).save(folder / f"f{k}.png")
    return [f"{folder.name}/f{k}.png" for k in range(n)]


def video_row(video, question="What?", answer="A cat.", fps=1):
    part = {"type": "video", "video": video}
    if fps is not None:
        part["fps"] = fps
    return {
        "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ]
    }


def build(tmp_path, processor, rows, **settings):
    path = write_jsonl(tmp_path / "video.jsonl", rows)
    s = DataSettings(datasets=[{"path": str(path)}], **settings)
    return build_train_dataset(
        s, processor.tokenizer, sequence_len=1024, seed=0, processor=processor
    )


def qwen_video(processor_cls, grid_thw) -> str:
    """The text a Qwen-VL processor makes of `<|vision_start|><|video_pad|><|vision_end|>` for
    a video of this grid taken at 1 frame per second (2x2 merge)."""
    t, h, w = grid_thw
    per_step = "<|video_pad|>" * (h * w // 4)
    if processor_cls.__name__.startswith("Qwen3VL"):
        # Qwen3-VL: each temporal step (2 frames) behind the timestamp of its middle.
        steps = "".join(
            f"<{2 * k + 0.5:.1f} seconds><|vision_start|>{per_step}<|vision_end|>" for k in range(t)
        )
        return "<|vision_start|>" + steps + "<|vision_end|>"
    return "<|vision_start|>" + per_step * t + "<|vision_end|>"


class StandInVideoProcessor:
    """Qwen2-VL's video processor's outputs for 56x56 frames, without torchvision: 14-pixel
    patches, two frames per temporal step, metadata passed through. It checks that the frames
    arrive final (`do_sample_frames=False`) with one metadata entry per video."""

    merge_size = 2
    temporal_patch_size = 2
    do_sample_frames = True

    def sample_frames(self, metadata, **kwargs):
        return np.arange(0, metadata.total_num_frames, 2)

    def __call__(self, videos, do_sample_frames=None, video_metadata=None, **kwargs):
        assert do_sample_frames is False
        videos = make_batched_videos(videos)
        metadata = make_batched_metadata(videos, video_metadata)
        grids = [[-(-len(v) // 2), v.shape[1] // 14, v.shape[2] // 14] for v in videos]
        n_patches = sum(t * h * w for t, h, w in grids)
        data = {
            "pixel_values_videos": torch.zeros(n_patches, 3 * 2 * 14 * 14),
            "video_grid_thw": torch.tensor(grids),
        }
        if kwargs.get("return_metadata"):
            data["video_metadata"] = metadata
        return BatchFeature(data)


def stand_in_processor(processor_cls=Qwen2VLImageOnlyProcessor):
    proc = qwen2_vl_processor(processor_cls)
    proc.video_processor = StandInVideoProcessor()
    return proc


# --- frames ------------------------------------------------------------------------------------


def test_frames_from_a_list_and_from_a_folder_in_natural_order(tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    for k in (1, 2, 10):  # natural order: f1, f2, f10 (not f1, f10, f2)
        Image.new("RGB", (8, 6), (k, 0, 0)).save(folder / f"f{k}.png")
    (folder / "notes.txt").write_text("not a frame")
    reader = VideoReader("d.jsonl", tmp_path)
    video = reader.load("clip", row=0, field="f")
    assert video.frames.shape == (3, 6, 8, 3) and video.frames.dtype == np.uint8
    assert [int(f[0, 0, 0]) for f in video.frames] == [1, 2, 10]
    assert video.metadata == {
        "total_num_frames": 3,
        "fps": 2.0,  # the default rate of frame images
        "frames_indices": [0, 1, 2],
        "height": 6,
        "width": 8,
        "duration": 1.5,
    }
    listed = reader.load(["clip/f10.png", str(folder / "f1.png")], row=0, field="f", fps=5)
    assert [int(f[0, 0, 0]) for f in listed.frames] == [10, 1]
    assert listed.metadata["fps"] == 5.0


@pytest.mark.parametrize(
    ("source", "fps", "message"),
    [
        (["clip/f0.png", "clip/f9.png"], None, "video frame 1 'clip/f9.png' does not exist"),
        (["clip/f0.png", "small.png"], None, "video frames differ in size"),
        ("empty", None, "video folder 'empty' holds no frame images"),
        ([], None, "a video needs at least one frame"),
        (["clip/f0.png"], 0, "'fps' must be a positive number"),
        ("clip.mp4", None, "video 'clip.mp4' does not exist"),
        (3, None, "a video must be a list of frame images, a folder of frame images, or a video"),
        ("https://x/v.mp4", None, "download it first"),
    ],
)
def test_bad_video_sources(tmp_path, source, fps, message):
    write_frames(tmp_path / "clip", n=1)
    write_image(tmp_path / "small.png", (28, 28))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="dataset 'd.jsonl', row 3, field 'f': ") as e:
        VideoReader("d.jsonl", tmp_path).load(source, row=3, field="f", fps=fps)
    assert message in str(e.value)


def test_video_file_without_a_decoder_is_a_data_error(tmp_path, monkeypatch):
    monkeypatch.setattr(video_module, "video_decoder", lambda: None)
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    proc = stand_in_processor()
    with pytest.raises(DataError) as e:
        build(tmp_path, proc, [video_row("clip.mp4", fps=None)])
    msg = str(e.value)
    assert "video.jsonl" in msg and "row 0" in msg and "field 'messages[0].content[0]'" in msg
    assert "no video decoder is installed" in msg
    assert "give the video as a list of frame images or a folder of frame images" in msg


def test_fps_of_a_video_file_is_an_error(tmp_path):
    (tmp_path / "clip.mp4").write_bytes(b"")
    with pytest.raises(DataError, match="'fps' is for frame images"):
        VideoReader("d.jsonl", tmp_path).load("clip.mp4", row=0, field="f", fps=2)


# --- rows through the processor ----------------------------------------------------------------


def test_missing_frame_is_a_data_error_naming_dataset_row_and_field(tmp_path):
    frames = write_frames(tmp_path / "clip")
    proc = stand_in_processor()
    rows = [video_row(frames), video_row([*frames[:2], "clip/gone.png"])]
    with pytest.raises(DataError) as e:
        build(tmp_path, proc, rows)
    msg = str(e.value)
    assert "video.jsonl" in msg and "row 1" in msg and "field 'messages[0].content[0]'" in msg
    assert "video frame 2 'clip/gone.png' does not exist" in msg


def test_missing_frame_skipped_with_skip_bad_rows(tmp_path, caplog):
    frames = write_frames(tmp_path / "clip")
    proc = stand_in_processor()
    rows = [video_row(frames), video_row(["clip/gone.png"]), video_row(frames)]
    with caplog.at_level(logging.WARNING, logger="protrain.train.data"):
        ds = build(tmp_path, proc, rows, skip_bad_rows=True)
    assert len(ds) == 2
    (warning,) = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert "skipped 1 bad row(s) of 3" in warning.getMessage()
    assert "clip/gone.png" in warning.getMessage()


def test_video_part_without_a_source(tmp_path):
    row = video_row(None)
    row["messages"][0]["content"][0] = {"type": "video"}
    with pytest.raises(DataError, match=r"row 0, field 'messages\[0\].content\[0\]': a video part"):
        build(tmp_path, stand_in_processor(), [row])


def test_processor_without_a_video_processor(tmp_path):
    frames = write_frames(tmp_path / "clip")
    with pytest.raises(DataError, match="has no video processor"):
        build(tmp_path, qwen2_vl_processor(), [video_row(frames)])


@pytest.mark.parametrize(
    "processor_cls",
    [Qwen2VLImageOnlyProcessor, Qwen2_5_VLImageOnlyProcessor, Qwen3VLImageOnlyProcessor],
)
def test_video_tokens_and_timestamps_never_trained(tmp_path, processor_cls):
    frames = write_frames(tmp_path / "clip")
    proc = stand_in_processor(processor_cls)
    video = qwen_video(processor_cls, (2, 4, 4))
    item = build(tmp_path, proc, [video_row(frames)])[0]
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\n" + video + "What?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("A cat.<|im_end|>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(proc.tokenizer, pieces)
    assert item["input_ids"] == ids
    assert item["labels"] == labels
    assert item["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert item["mm_token_type_ids"] == [2 if t == proc.video_token_id else 0 for t in ids]

    item = build(tmp_path, proc, [video_row(frames)], train_on_inputs=True)[0]
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\n", True),
        (video, False),
        ("What?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n", True),
    ]
    assert item["labels"] == expected_labels(proc.tokenizer, pieces)[2]


def test_stand_in_video_rows_collate_and_pack(tmp_path):
    frames = write_frames(tmp_path / "clip")
    proc = stand_in_processor(Qwen3VLImageOnlyProcessor)
    rows = [video_row(frames), video_row(frames[:2], question="And?")]
    ds = build(tmp_path, proc, rows)
    batch = build_collator(proc.tokenizer, sequence_len=1024, packing=False)([ds[0], ds[1]])
    assert batch["pixel_values_videos"].shape == (32 + 16, 1176)
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4], [1, 4, 4]]
    packed = build(tmp_path, proc, rows, sample_packing=True)
    assert len(packed) == 1
    flat = build_collator(proc.tokenizer, sequence_len=1024, packing=True)([packed[0]])
    assert flat["pixel_values_videos"].shape == (48, 1176)
    assert flat["video_grid_thw"].tolist() == [[2, 4, 4], [1, 4, 4]]
    assert flat["mm_token_type_ids"].shape == flat["input_ids"].shape
    assert (flat["labels"] != IGNORE_INDEX).sum() == (batch["labels"] != IGNORE_INDEX).sum()
