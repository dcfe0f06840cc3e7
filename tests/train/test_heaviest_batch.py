"""The planner's micro-batch is the heaviest the training data can produce: for a
vision-language model the rows with the most media input after the processor (Qwen2-VL's
real image processor: more and larger images give more patches), for text the longest rows,
each collated by the run's collator and padded to the widest width. Choosing it moves
neither the data order nor any random state, and a resumed auto run stays bitwise."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tests.data.helpers import byte_tokenizer, write_jsonl
from tests.data.vision_helpers import QWEN_SPECIALS, Qwen2VLImageOnlyProcessor, write_image

from protrain.knobs import Knobs, OptimizerSettings
from protrain.plan import PlanRequest
from protrain.train.config import validate_config
from protrain.train.data import build_collator, build_train_dataset
from protrain.train.data.config import DataSettings
from protrain.train.heaviest_batch import heaviest_batch, pad_tokens, row_sizes
from protrain.train.modeling import load_tokenizer
from protrain.train.planning import PlanSettings, plan_memory, planner_loss, sample_batch
from protrain.train.sampling import MicroBatchStream, StreamPosition

from .helpers import tiny_config


def _rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _epoch(n_rows: int, micro_batch_size: int, seed: int) -> list[list[int]]:
    stream = MicroBatchStream(n_rows, micro_batch_size, seed)
    return [rows for _, rows in itertools.islice(stream.iterate(StreamPosition()),
                                                 stream.micro_batches_per_epoch)]  # fmt: skip


# -- text ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    cfg = validate_config(tiny_config(tmp_path_factory.mktemp("text"), sequence_len=512,
                                      micro_batch_size=3))  # fmt: skip
    tokenizer = load_tokenizer(cfg)
    data = build_train_dataset(cfg, tokenizer, sequence_len=512, seed=cfg.seed)
    return cfg, tokenizer, data


def test_a_text_dataset_plans_its_longest_rows(text_data, protrain_log):
    cfg, tokenizer, data = text_data
    collate = build_collator(tokenizer, sequence_len=512, packing=False)
    lengths = [len(data[i]["input_ids"]) for i in range(len(data))]
    longest = sorted(range(len(data)), key=lambda i: (-lengths[i], i))[:3]
    assert len(set(lengths)) > 3  # the rows differ in length: the choice means something
    before = _rng_states()
    batch = sample_batch(cfg, data, collate)
    after = _rng_states()
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert np.array_equal(before[2], after[2])
    want = collate([data[i] for i in longest])
    assert batch.keys() == want.keys()
    for key in want:
        assert torch.equal(batch[key], want[key]), key
    assert batch["input_ids"].shape == (3, max(lengths))
    line = next(m for m in protrain_log if m.startswith("planning micro-batch:"))
    assert f"rows {longest} of {len(data)}, the longest (" in line
    assert f"{max(lengths)} tokens wide" in line


def test_packed_micro_batches_are_planned_at_full_width(text_data, protrain_log):
    cfg, tokenizer, _ = text_data
    cfg = cfg.model_copy(update={"sample_packing": True, "sequence_len": 128})
    packs = build_train_dataset(cfg, tokenizer, sequence_len=128, seed=cfg.seed)
    collate = build_collator(tokenizer, sequence_len=128, packing=True)
    batch = sample_batch(cfg, packs, collate)
    assert batch["input_ids"].shape == (1, 3 * 128)
    assert "every padding-free micro-batch is planned at that width" in protrain_log[-1]
    positions = batch["position_ids"][0]
    n_real = sum(sorted(len(packs[i]["input_ids"]) for i in range(len(packs)))[-3:])
    assert torch.equal(positions[n_real:], torch.arange(3 * 128 - n_real))  # padding: its own
    assert (batch["labels"][0, n_real:] == -100).all()


def test_row_sizes_of_a_prepared_arrow_dataset_match_its_rows():
    import datasets

    from protrain.train.data.items import ArrowItems

    items = [{"input_ids": [1] * n, "labels": [1] * n} for n in (5, 9, 2)]
    arrow = ArrowItems(datasets.Dataset.from_list(items))
    assert [s.tokens for s in row_sizes(arrow)] == [5, 9, 2]
    assert row_sizes(arrow) == row_sizes([arrow[i] for i in range(3)])  # item by item


def test_padding_keeps_media_and_pads_per_token_tensors():
    """Llama 3.2 Vision's cross-attention mask is a media tensor laid out per token: padded
    with zeros; pixel values are kept as they are, though their leading dims match."""
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long),
             "labels": torch.ones(2, 3, dtype=torch.long),
             "attention_mask": torch.ones(2, 3, dtype=torch.long),
             "cross_attention_mask": torch.ones(2, 3, 1, 4, dtype=torch.long),
             "pixel_values": torch.ones(2, 3, 8, 8)}  # fmt: skip
    out = pad_tokens(batch, 5, pad_id=7, media_keys={"cross_attention_mask", "pixel_values"})
    assert out["input_ids"][:, 3:].eq(7).all() and out["labels"][:, 3:].eq(-100).all()
    assert out["attention_mask"].sum().item() == 6
    assert out["cross_attention_mask"].shape == (2, 5, 1, 4)
    assert out["cross_attention_mask"][:, 3:].eq(0).all()
    assert out["pixel_values"] is batch["pixel_values"]


def test_bad_micro_batch_size_and_empty_data_are_named():
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        heaviest_batch([], None, micro_batch_size=0, sequence_len=8, packing=False)
    with pytest.raises(ValueError, match="the training dataset is empty"):
        heaviest_batch([], None, micro_batch_size=1, sequence_len=8, packing=False)


# -- vision-language -------------------------------------------------------------------------

PATCH_VALUES = 3 * 2 * 14 * 14  # a Qwen2-VL patch: 3 channels, 2 frames, 14 x 14 pixels


def _qwen2_vl(tmp_path):
    """A tiny Qwen2-VL and its real image processor (PIL): images of 28 to 224 pixels a
    side are resized to multiples of 28, i.e. 2x2 to 16x16 patches of 14, merged 2x2."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from protrain.train.data.templates import BUILTIN_TEMPLATES

    tok = byte_tokenizer(QWEN_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>")
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=224 * 224, patch_size=14,
                                      merge_size=2, temporal_patch_size=2)  # fmt: skip
    processor = Qwen2VLImageOnlyProcessor(image_processor=images, tokenizer=tok,
                                          chat_template=BUILTIN_TEMPLATES["qwen2_vl"])  # fmt: skip
    text = dict(model_type="qwen2_vl_text", vocab_size=len(tok), hidden_size=32,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                rope_scaling=dict(type="mrope", mrope_section=[1, 1, 2]))  # fmt: skip
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2)  # fmt: skip
    tokens = dict(
        image_token_id="<|image_pad|>",
        video_token_id="<|video_pad|>",
        vision_start_token_id="<|vision_start|>",
        vision_end_token_id="<|vision_end|>",
    )
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in tokens.items()}
    config = AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).train()
    return model, processor


def _row(images, answer="A cat."):
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": "What?"}]
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": answer}], "images": images}  # fmt: skip


def test_a_vision_language_model_is_planned_at_its_heaviest_micro_batch(tmp_path, protrain_log):
    """The first row: one small image (2x2 patches); later: one 56-pixel image (4x4), two
    224-pixel images (16x16 each), a long answer with a small image. The plan is made at
    the two heaviest rows, padded to the long row's width; its predicted peak covers the
    measured peak of every micro-batch of an epoch run under it (a plan made at the stream's
    first micro-batch padded to sequence_len predicts 7.37 MB against 8.49 MB measured), and
    the trace has the vision tower's blocks."""
    from protrain import close
    from protrain.planned_wrap import apply_plan
    from protrain.profile.measure import measure_steps

    model, processor = _qwen2_vl(tmp_path)
    for name, side in (("small", 28), ("mid", 56), ("big", 224)):
        write_image(tmp_path / f"{name}.png", (side, side))
    rows = [_row(["small.png"]), _row(["mid.png"]), _row(["big.png", "big.png"]),
            _row(["small.png"], "Long. " * 25)]  # fmt: skip
    settings = DataSettings(datasets=[{"path": str(write_jsonl(tmp_path / "vl.jsonl", rows))}])
    data = build_train_dataset(settings, processor.tokenizer, sequence_len=256, seed=0,
                               processor=processor)  # fmt: skip
    collate = build_collator(processor.tokenizer, sequence_len=256, packing=False)
    # seed 23: the stream starts with the light rows (small image, long answer)
    cfg = SimpleNamespace(micro_batch_size=2, sequence_len=256, sample_packing=False, seed=23)

    batch = sample_batch(cfg, data, collate)
    grids = [data[i]["image_grid_thw"].tolist() for i in range(len(data))]
    heavy, mid = grids.index([[1, 16, 16], [1, 16, 16]]), grids.index([[1, 4, 4]])
    assert heavy > 0 and mid > 0  # later rows, not the first
    assert batch["pixel_values"].shape == (256 + 256 + 16, PATCH_VALUES)
    assert batch["image_grid_thw"].tolist() == [[1, 16, 16], [1, 16, 16], [1, 4, 4]]
    image_token = processor.image_token_id
    assert (batch["input_ids"] == image_token).sum(1).tolist() == [64 + 64, 4]  # merged 2x2
    widest = max(len(data[i]["input_ids"]) for i in range(len(data)))
    assert batch["input_ids"].shape == (2, widest)
    assert widest > max(len(data[i]["input_ids"]) for i in (heavy, mid))  # padded to it
    line = next(m for m in protrain_log if m.startswith("planning micro-batch:"))
    assert f"rows {[heavy, mid]} of {len(data)}, the most media input (" in line
    assert f"pixel_values 528x{PATCH_VALUES}" in line and f"{widest} tokens wide" in line
    epoch = [collate([data[i] for i in r]) for r in _epoch(len(data), 2, cfg.seed)]
    assert epoch[0]["pixel_values"].shape[0] == 4 + 4  # the first micro-batch: 2 small images
    assert all(b["pixel_values"].shape[0] <= 528 for b in epoch)

    request = PlanRequest(64 << 20, knobs=Knobs(chunk_size_bytes=256 << 10))
    plan_settings = PlanSettings(torch.device("cpu"), torch.float32, request)
    plan, problem = plan_memory(model, batch, plan_settings)
    names = [b.name for b in problem.profile.blocks]
    vision_blocks = [b for b in problem.profile.blocks if ".visual.blocks." in b.name]
    assert len(vision_blocks) == 2 and len(names) == 4, names
    assert all(b.saved_bytes > 0 and b.fwd_s > 0 for b in vision_blocks)

    wrapped, optimizer, _, _ = apply_plan(model, plan, device="cpu",
                                          optim=OptimizerSettings(lr=1e-3))  # fmt: skip
    loss_fn = planner_loss(torch.device("cpu"), None)
    batches = iter(epoch)

    def step():
        loss_fn(wrapped, next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()

    try:
        measured = measure_steps(wrapped, step, steps=len(epoch), warmup=0, device="cpu")
    finally:
        close(wrapped)
    assert measured.peak_allocated_bytes <= plan.predicted_peak_bytes, (measured, plan)
