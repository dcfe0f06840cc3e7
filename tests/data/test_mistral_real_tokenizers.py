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

import pytest

pytest.importorskip("mistral_common")
pytest.importorskip("sentencepiece")

import mistral_common  # noqa: E402
from mistral_common.protocol.instruct.messages import (  # noqa: E402
    AssistantMessage,
    SystemMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.protocol.instruct.validator import ValidationMode  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402

from protrain.train.data import IGNORE_INDEX, DataSettings, build_train_dataset  # noqa: E402

from .helpers import write_jsonl  # noqa: E402

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
