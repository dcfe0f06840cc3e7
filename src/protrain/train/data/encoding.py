"""Encoding a parsed text sample into `input_ids` and `labels`.

Chats are rendered with the chat template and tokenized in one piece (the template already
writes BOS and the markers), so the model trains on exactly the tokens it sees at inference.
Labels come from the character spans that `masks` marks as trained, through the tokenizer's
offsets. Completion and text samples are tokenized with the tokenizer's own special tokens
and closed with EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protrain.train.data.formats import ChatSample, CompletionSample, Sample, TextSample
from protrain.train.data.masks import (
    IGNORE_INDEX,
    MaskSettings,
    chat_trained_spans,
    labels_from_offsets,
)
from protrain.train.data.rendering import ChatRenderer


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    text: str = ""  # the rendered text, kept for inspection
    extras: dict[str, Any] = field(default_factory=dict)  # media tensors of VLM rows

    def item(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "labels": self.labels, **self.extras}


def _tokenize_with_offsets(tokenizer, text: str, add_special_tokens: bool):
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def encode_chat(
    sample: ChatSample, tokenizer, renderer: ChatRenderer, mask: MaskSettings
) -> Encoded:
    """Render, locate turns, tokenize; raises `TemplateMismatch` if a turn cannot be placed."""
    text = renderer.render(sample.messages)
    turns = renderer.locate(sample.messages, text)
    all_eot = renderer.all_markers(text) if mask.train_on_eos == "all" else ()
    spans = chat_trained_spans(turns, len(text), mask, all_eot)
    ids, offsets = _tokenize_with_offsets(tokenizer, text, add_special_tokens=False)
    return Encoded(ids, labels_from_offsets(ids, offsets, text, spans), text)


def _eos_id(tokenizer) -> int | None:
    return tokenizer.eos_token_id


def encode_completion(sample: CompletionSample, tokenizer, mask: MaskSettings) -> Encoded:
    prompt = sample.prompt if sample.system is None else f"{sample.system}\n\n{sample.prompt}"
    text = prompt + sample.completion
    ids, offsets = _tokenize_with_offsets(tokenizer, text, add_special_tokens=True)
    spans = [(0, len(text))] if mask.train_on_inputs else [(len(prompt), len(text))]
    labels = labels_from_offsets(ids, offsets, text, spans)
    return _close_with_eos(Encoded(ids, labels, text), tokenizer, mask)


def encode_text(sample: TextSample, tokenizer, mask: MaskSettings) -> Encoded:
    text = sample.text
    ids, offsets = _tokenize_with_offsets(tokenizer, text, add_special_tokens=True)
    labels = labels_from_offsets(ids, offsets, text, [(0, len(text))])
    return _close_with_eos(Encoded(ids, labels, text), tokenizer, mask)


def _close_with_eos(enc: Encoded, tokenizer, mask: MaskSettings) -> Encoded:
    eos = _eos_id(tokenizer)
    if eos is None or (enc.input_ids and enc.input_ids[-1] == eos):
        return enc
    enc.input_ids.append(eos)
    trained = mask.train_on_inputs or mask.train_on_eos != "none"
    enc.labels.append(eos if trained else IGNORE_INDEX)
    enc.text += tokenizer.eos_token
    return enc


def encode_sample(
    sample: Sample, tokenizer, renderer: ChatRenderer | None, mask: MaskSettings
) -> Encoded:
    if isinstance(sample, ChatSample):
        assert renderer is not None
        return encode_chat(sample, tokenizer, renderer, mask)
    if isinstance(sample, CompletionSample):
        return encode_completion(sample, tokenizer, mask)
    return encode_text(sample, tokenizer, mask)
