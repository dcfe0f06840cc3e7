"""Tokenizers and data files built in the tests (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from protrain.train.data.masks import IGNORE_INDEX


def byte_tokenizer(
    special_tokens: list[str],
    *,
    bos: str | None = None,
    eos: str | None = None,
    pad: str | None = None,
    chat_template: str | None = None,
    extra_special_tokens: dict[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """One token per byte, plus the given special tokens as single tokens.

    Without merges, tokenizing a text is the same as tokenizing its pieces one after the
    other, so the expected labels of a sample can be written piece by piece.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, extra_special_tokens=extra_special_tokens or {}
    )
    specials = [t for t in special_tokens]
    for t in (bos, eos, pad):
        if t and t not in specials:
            specials.append(t)
    fast.add_special_tokens({"additional_special_tokens": specials})
    if bos:
        fast.bos_token = bos
    if eos:
        fast.eos_token = eos
    if pad:
        fast.pad_token = pad
    if chat_template:
        fast.chat_template = chat_template
    return fast


def expected_labels(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[str, list[int], list[int]]:
    """Text, ids and labels of a sample written as (text, trained) pieces."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in pieces:
        piece_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        labels += piece_ids if trained else [IGNORE_INDEX] * len(piece_ids)
    return "".join(t for t, _ in pieces), ids, labels


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def bpe_tokenizer(
    special_tokens: list[str],
    corpus: list[str],
    *,
    bos: str | None = None,
    eos: str | None = None,
    vocab_size: int = 400,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE with merges learnt from `corpus` (offline, in milliseconds), so that
    words are single tokens and a trained span's edges fall between merged tokens."""
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[t for t in (*special_tokens, bos, eos) if t],
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens(
        {"additional_special_tokens": [t for t in (*special_tokens, bos, eos) if t]}
    )
    if bos:
        fast.bos_token = bos
    if eos:
        fast.eos_token = eos
    return fast


def marked_pieces(marked: str) -> list[tuple[str, bool]]:
    """`a⟦b⟧c` as pieces [(a, False), (b, True), (c, False)]: trained text between ⟦ and ⟧."""
    pieces = []
    for k, part in enumerate(marked.replace("⟧", "⟦").split("⟦")):
        if part:
            pieces.append((part, k % 2 == 1))
    return pieces
