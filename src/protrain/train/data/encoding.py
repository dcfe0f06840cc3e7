"""Encoding a parsed text sample into `input_ids` and `labels`.

Chats are rendered with the chat template and tokenized in one piece (the template already
writes BOS and the markers), so the model trains on exactly the tokens it sees at inference.
Labels come from the character spans that `masks` marks as trained, through the tokenizer's
offsets (piece by piece for tokenizers without offsets). Completion and text samples are tokenized with the tokenizer's own special tokens
and closed with EOS.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from protrain.train.data.formats import ChatSample, CompletionSample, Sample, TextSample
from protrain.train.data.masks import (
    IGNORE_INDEX,
    MaskSettings,
    chat_trained_spans,
    labels_from_offsets,
    widen_to_tokens,
)
from protrain.train.data.rendering import ChatRenderer, Turn, with_generation_spans

logger = logging.getLogger("protrain.train.data")


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    text: str = ""  # the rendered text, kept for inspection
    extras: dict[str, Any] = field(default_factory=dict)  # media tensors of VLM rows
    notes: list[str] = field(default_factory=list)  # one line per message, for inspection

    def item(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "labels": self.labels, **self.extras}


_warned_no_offsets: set[str] = set()


def tokenize_labelled(
    tokenizer,
    text: str,
    spans: list[tuple[int, int]],
    add_special_tokens: bool,
    whole_tokens: bool = False,
) -> tuple[list[int], list[int]]:
    """Ids and labels of `text`, trained where its characters fall in `spans`.

    Fast tokenizers tokenize the whole text and map tokens to characters by their offsets
    (`whole_tokens`: every token a span touches, as transformers' assistant masks count them).
    Tokenizers without offsets tokenize the text piece by piece between span edges, which
    can split a word differently from whole-text tokenization at a span edge (warned once).
    """
    # verbose=False: transformers' line about rows longer than the tokenizer's
    # model_max_length ("will result in indexing errors"); rows are cut at sequence_len and
    # counted in the dataset's report, and a sequence_len past the model's positions is
    # warned once at start (`modeling.beyond_positions_note`)
    try:
        enc = tokenizer(
            text,
            add_special_tokens=add_special_tokens,
            return_offsets_mapping=True,
            verbose=False,
        )
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        return _tokenize_by_pieces(tokenizer, text, spans, add_special_tokens)
    ids = list(enc["input_ids"])
    if whole_tokens:
        spans = widen_to_tokens(spans, offsets)
    return ids, labels_from_offsets(ids, offsets, text, spans)


def _tokenize_by_pieces(tokenizer, text, spans, add_special_tokens):
    name = type(tokenizer).__name__
    if name not in _warned_no_offsets:
        _warned_no_offsets.add(name)
        logger.warning(
            "%s gives no character offsets; tokenizing each masked piece on its own, which can "
            "differ from whole-text tokenization at piece edges (use a fast tokenizer to avoid it)",
            name,
        )
    edges = sorted({0, len(text), *(e for span in spans for e in span)})
    ids: list[int] = []
    labels: list[int] = []
    if add_special_tokens and getattr(tokenizer, "bos_token_id", None) is not None:
        ids.append(tokenizer.bos_token_id)
        labels.append(IGNORE_INDEX)
    for a, b in zip(edges, edges[1:]):
        if a == b:
            continue
        piece = list(tokenizer(text[a:b], add_special_tokens=False, verbose=False)["input_ids"])
        trained = any(s <= a and b <= e for s, e in spans)
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    return ids, labels


def encode_chat(
    sample: ChatSample, tokenizer, renderer: ChatRenderer, mask: MaskSettings
) -> Encoded:
    """Render, locate turns, tokenize; raises `TemplateMismatch` if a turn cannot be placed."""
    kwargs = sample.template_kwargs
    messages, text = renderer.prepare(sample.messages, kwargs)
    turns = renderer.locate(messages, text, kwargs)
    tagged = renderer.has_generation_tags and renderer.renders_with_tokenizer
    if tagged:
        turns = with_generation_spans(turns, renderer.generation_spans(messages, kwargs))
    all_eot = renderer.all_markers(text) if mask.train_on_eos == "all" else ()
    spans = chat_trained_spans(turns, len(text), mask, all_eot)
    ids, labels = tokenize_labelled(
        tokenizer, text, spans, add_special_tokens=False, whole_tokens=tagged
    )
    return Encoded(ids, labels, text, notes=_notes(messages, turns, mask))


def _notes(messages: list[dict[str, Any]], turns: list[Turn], mask: MaskSettings) -> list[str]:
    """`[2] assistant, calls get_weather: trained` for each message."""
    notes = []
    for i, (message, turn) in enumerate(zip(messages, turns)):
        what = f"[{i}] {message['role']}"
        if turn.tool_calls:
            what += f", calls {', '.join(turn.tool_calls)}"
        if message["role"] == "tool":
            source = message.get("name") or message.get("tool_call_id")
            what += f", result of {source}" if source else ", tool result"
        trained = mask.train_on_inputs or mask.trains(turn)
        notes.append(f"{what}: {'trained' if trained else 'masked'}")
    return notes


def _eos_id(tokenizer) -> int | None:
    return tokenizer.eos_token_id


def encode_completion(sample: CompletionSample, tokenizer, mask: MaskSettings) -> Encoded:
    prompt = sample.prompt if sample.system is None else f"{sample.system}\n\n{sample.prompt}"
    text = prompt + sample.completion
    spans = [(0, len(text))] if mask.train_on_inputs else [(len(prompt), len(text))]
    ids, labels = tokenize_labelled(tokenizer, text, spans, add_special_tokens=True)
    return _close_with_eos(Encoded(ids, labels, text), tokenizer, mask)


def encode_text(sample: TextSample, tokenizer, mask: MaskSettings) -> Encoded:
    text = sample.text
    ids, labels = tokenize_labelled(tokenizer, text, [(0, len(text))], add_special_tokens=True)
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
