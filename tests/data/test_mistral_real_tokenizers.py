"""Mistral's own tokenizers (SentencePiece and Tekken, shipped inside `mistral-common`).

The oracle is `mistral-common` itself: for the same conversation, our rendering must give
exactly its token ids, and the trained positions must be exactly the answers (the tokens
after each `[/INST]`, up to and including `</s>`): `[/INST]` both closes the user turn and
opens the answer, and is never trained.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

# The dev extra installs these; a missing one is a failure, not a skip. transformers reads
# SentencePiece models through protobuf.
import google.protobuf  # noqa: F401
import mistral_common
import pytest
import sentencepiece  # noqa: F401
from mistral_common.protocol.instruct.messages import (
    AssistantMessage,
    SystemMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from protrain.train.data import IGNORE_INDEX, DataSettings, build_train_dataset

from .helpers import write_jsonl

DATA = Path(mistral_common.__file__).parent / "data"

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello friend"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ciao"},
]


@functools.cache
def _hf_sentencepiece(file_name: str, tmp_root: str):
    from transformers import LlamaTokenizer

    folder = Path(tmp_root) / file_name
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA / file_name, folder / "tokenizer.model")
    return LlamaTokenizer.from_pretrained(str(folder))


@functools.cache
def _hf_tekken(file_name: str):
    from transformers.integrations.mistral import convert_tekken_tokenizer

    return convert_tekken_tokenizer(str(DATA / file_name))


def _reference_tokens(file_name: str) -> list[int]:
    mt = MistralTokenizer.from_file(str(DATA / file_name), mode=ValidationMode.finetuning)
    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    request = ChatCompletionRequest(
        messages=[kinds[m["role"]](content=m["content"]) for m in CONVO]
    )
    return mt.encode_chat_completion(request).tokens


def _answer_labels(tokens: list[int], inst_end: int, eos: int) -> list[int]:
    """Trained = after `[/INST]` up to and including `</s>`."""
    labels, in_answer = [], False
    for t in tokens:
        if t == inst_end:
            labels.append(IGNORE_INDEX)
            in_answer = True
            continue
        labels.append(t if in_answer else IGNORE_INDEX)
        if t == eos:
            in_answer = False
    return labels


CASES = [
    ("mistral_instruct_tokenizer_240323.model.v3", "sentencepiece", "mistral"),
    ("mistral_instruct_tokenizer_241114.model.v7", "sentencepiece", "mistral_v7"),
    ("tekken_240911.json", "tekken", "mistral_tekken"),
]


@pytest.mark.parametrize("file_name,kind,template", CASES)
def test_matches_mistral_common_and_trains_answers(
    tmp_path, tmp_path_factory, file_name, kind, template
):
    if kind == "sentencepiece":
        tok = _hf_sentencepiece(file_name, str(tmp_path_factory.getbasetemp() / "sp"))
    else:
        tok = _hf_tekken(file_name)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    settings = DataSettings(datasets=[{"path": str(path)}], chat_template=template)
    item = build_train_dataset(settings, tok, sequence_len=256, seed=0)[0]

    reference = _reference_tokens(file_name)
    assert item["input_ids"] == reference
    inst_end = tok.convert_tokens_to_ids("[/INST]")
    assert item["labels"] == _answer_labels(reference, inst_end, tok.eos_token_id)
    trained = tok.convert_ids_to_tokens([t for t in item["labels"] if t != IGNORE_INDEX])
    if kind == "sentencepiece":
        assert trained == ["▁Hello", "▁friend", "</s>", "▁C", "iao", "</s>"]
    else:
        assert trained == ["Hello", "Ġfriend", "</s>", "C", "iao", "</s>"]


def test_sentencepiece_train_on_eos_last_and_none(tmp_path, tmp_path_factory):
    file_name = CASES[0][0]
    tok = _hf_sentencepiece(file_name, str(tmp_path_factory.getbasetemp() / "sp"))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    reference = _reference_tokens(file_name)
    eos = tok.eos_token_id
    eos_positions = [k for k, t in enumerate(reference) if t == eos]
    for mode, kept in (("last", eos_positions[-1:]), ("none", [])):
        settings = DataSettings(
            datasets=[{"path": str(path)}], chat_template="mistral", train_on_eos=mode
        )
        item = build_train_dataset(settings, tok, sequence_len=256, seed=0)[0]
        expected = _answer_labels(reference, tok.convert_tokens_to_ids("[/INST]"), eos)
        expected = [
            IGNORE_INDEX if (k in eos_positions and k not in kept) else lab
            for k, lab in enumerate(expected)
        ]
        assert item["labels"] == expected


class _PixtralByMistralCommon:
    """A processor built in the test: the rendered text is tokenized by the Tekken tokenizer
    and each `[IMG]` placeholder is replaced by mistral-common's own image tokens (rows of
    `[IMG]` closed by `[IMG_BREAK]`, the last by `[IMG_END]`)."""

    def __init__(self, tokenizer, image_encoder):
        self.tokenizer = tokenizer
        self.image_encoder = image_encoder
        self.chat_template = None

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text, images=None, return_tensors="pt", add_special_tokens=False):
        import torch
        from mistral_common.protocol.instruct.messages import ImageChunk
        from transformers import BatchFeature

        (text,) = text
        pieces = text.split("[IMG]")
        ids = list(self.tokenizer(pieces[0], add_special_tokens=False)["input_ids"])
        pixels = []
        for image, piece in zip(images or [], pieces[1:]):
            encoding = self.image_encoder(ImageChunk(image=image))
            ids += encoding.tokens
            pixels.append(torch.as_tensor(encoding.image))
            ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        data = {"input_ids": torch.tensor([ids])}
        if pixels:
            data["pixel_values"] = torch.stack(pixels)
        return BatchFeature(data)


def test_pixtral_images_on_real_tekken_ids(tmp_path, monkeypatch):
    """Pixtral's `[/INST]` shared marker on the real Tekken tokenizer, with an image: our ids
    equal mistral-common's, and exactly the answers are trained."""
    import numpy as np
    from mistral_common.protocol.instruct.messages import ImageChunk, TextChunk
    from mistral_common.tokens.tokenizers import image as mc_image
    from PIL import Image

    # Resizing needs OpenCV; the pixels are not what is tested here, the tokens are.
    monkeypatch.setattr(
        mc_image, "transform_image", lambda im, size: np.zeros((3, size[1], size[0]), np.float32)
    )
    file_name = "tekken_240911.json"
    tok = _hf_tekken(file_name)
    mt = MistralTokenizer.from_file(str(DATA / file_name), mode=ValidationMode.finetuning)
    image = Image.new("RGB", (40, 20), (10, 20, 30))
    image.save(tmp_path / "img.png")
    reference = mt.encode_chat_completion(
        ChatCompletionRequest(
            messages=[
                UserMessage(content=[ImageChunk(image=image), TextChunk(text="What is it?")]),
                AssistantMessage(content="A box."),
                UserMessage(content="Sure?"),
                AssistantMessage(content="Yes."),
            ]
        )
    ).tokens
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}],
            },
            {"role": "assistant", "content": "A box."},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes."},
        ],
        "images": ["img.png"],
    }
    path = write_jsonl(tmp_path / "vl.jsonl", [row])
    processor = _PixtralByMistralCommon(tok, mt.instruct_tokenizer.image_encoder)
    settings = DataSettings(datasets=[{"path": str(path)}], chat_template="pixtral")
    item = build_train_dataset(settings, tok, sequence_len=512, seed=0, processor=processor)[0]
    assert item["input_ids"] == reference
    assert tok.convert_ids_to_tokens(reference).count("[IMG]") == 6  # 3 x 2 patches of 16 px
    assert item["labels"] == _answer_labels(
        reference, tok.convert_tokens_to_ids("[/INST]"), tok.eos_token_id
    )
