"""PaliGemma rows (a prefix LM): the app's labels, not the processor's, and token types that
make the answer causal (the processor marks a row all prefix without a `suffix`)."""

from __future__ import annotations

from tests.families.processors import IMAGE_SIZE, paligemma_processor

from protrain.train.data import DataSettings, build_train_dataset
from protrain.train.data.vision import prefix_lm_token_types

from .helpers import write_jsonl
from .vision_helpers import write_image


def test_paligemma_row_trains_its_answer_causally(tmp_path):
    write_image(tmp_path / "cat.png", (IMAGE_SIZE, IMAGE_SIZE))
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A cat."},
        ],
        "images": ["cat.png"],
    }
    processor = paligemma_processor()
    settings = DataSettings(datasets=[{"path": str(write_jsonl(tmp_path / "r.jsonl", [row]))}])
    item = build_train_dataset(
        settings, processor.tokenizer, sequence_len=128, seed=0, processor=processor
    )[0]
    tok = processor.tokenizer
    trained = [i for i, label in enumerate(item["labels"]) if label != -100]
    assert tok.decode([item["input_ids"][i] for i in trained]) == "A cat.<|im_end|>"
    first = trained[0]
    assert item["token_type_ids"] == [0] * first + [1] * (len(item["input_ids"]) - first)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert item["input_ids"].count(image_id) == 4 and item["pixel_values"].shape[0] == 1


def test_prefix_lm_token_types():
    assert prefix_lm_token_types([-100, -100, 5, -100, 6]) == [0, 0, 1, 1, 1]
    assert prefix_lm_token_types([-100, -100]) == [0, 0]
