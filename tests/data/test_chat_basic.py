"""The minimal chat path: JSONL rows, the tokenizer's ChatML template, assistant-only masks."""

from __future__ import annotations

import json

import pytest

from protrain.train.data import (
    IGNORE_INDEX,
    DataError,
    DataSettings,
    build_collator,
    build_eval_dataset,
    build_train_dataset,
    describe_masking,
    render_inspection,
)
from protrain.train.data.templates import CHATML

from .helpers import byte_tokenizer, expected_labels, write_jsonl

CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture
def chatml_tok():
    return byte_tokenizer(
        CHATML_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", chat_template=CHATML
    )


def _settings(path, **kw) -> DataSettings:
    return DataSettings(datasets=[{"path": str(path), **kw.pop("ds", {})}], **kw)


CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you."},
]


def _chatml_pieces(eos_trained=(True, True)):
    return [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("Hello!", True),
        ("<|im_end|>", eos_trained[0]),
        ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", False),
        ("See you.", True),
        ("<|im_end|>", eos_trained[1]),
        ("\n", False),
    ]


def test_messages_assistant_only(tmp_path, chatml_tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    ds = build_train_dataset(_settings(path), chatml_tok, sequence_len=512, seed=0)
    _, ids, labels = expected_labels(chatml_tok, _chatml_pieces())
    assert len(ds) == 1
    assert ds[0]["input_ids"] == ids
    assert ds[0]["labels"] == labels


def test_legacy_conversations(tmp_path, chatml_tok):
    legacy = [
        {
            "from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
            "value": m["content"],
        }
        for m in CONVO
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": legacy}])
    ds = build_train_dataset(_settings(path), chatml_tok, sequence_len=512, seed=0)
    _, ids, labels = expected_labels(chatml_tok, _chatml_pieces())
    assert ds[0]["input_ids"] == ids and ds[0]["labels"] == labels


@pytest.mark.parametrize(
    "mode,eos",
    [("turn", (True, True)), ("last", (False, True)), ("none", (False, False))],
)
def test_train_on_eos(tmp_path, chatml_tok, mode, eos):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    ds = build_train_dataset(
        _settings(path, train_on_eos=mode), chatml_tok, sequence_len=512, seed=0
    )
    assert ds[0]["labels"] == expected_labels(chatml_tok, _chatml_pieces(eos))[2]


def test_train_on_eos_all_trains_untrained_turn_ends(tmp_path, chatml_tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO[1:3]}])
    ds = build_train_dataset(
        _settings(path, train_on_eos="all"), chatml_tok, sequence_len=512, seed=0
    )
    pieces = [
        ("<|im_start|>user\nHi", False),
        ("<|im_end|>", True),
        ("\n<|im_start|>assistant\n", False),
        ("Hello!<|im_end|>", True),
        ("\n", False),
    ]
    assert ds[0]["labels"] == expected_labels(chatml_tok, pieces)[2]


def test_roles_to_train_and_train_on_inputs(tmp_path, chatml_tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO[1:3]}])
    ds = build_train_dataset(
        _settings(path, roles_to_train=["user", "assistant"]), chatml_tok, sequence_len=512, seed=0
    )
    pieces = [
        ("<|im_start|>user\n", False),
        ("Hi<|im_end|>", True),
        ("\n<|im_start|>assistant\n", False),
        ("Hello!<|im_end|>", True),
        ("\n", False),
    ]
    assert ds[0]["labels"] == expected_labels(chatml_tok, pieces)[2]
    ds = build_train_dataset(
        _settings(path, train_on_inputs=True), chatml_tok, sequence_len=512, seed=0
    )
    assert ds[0]["labels"] == ds[0]["input_ids"]


def test_per_dataset_override(tmp_path, chatml_tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO[1:3]}])
    settings = _settings(path, ds={"train_on_eos": "none"}, train_on_eos="turn")
    ds = build_train_dataset(settings, chatml_tok, sequence_len=512, seed=0)
    pieces = [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        ("Hello!", True),
        ("<|im_end|>\n", False),
    ]
    assert ds[0]["labels"] == expected_labels(chatml_tok, pieces)[2]
    (line,) = describe_masking(settings)
    assert "train_on_eos=none" in line and "assistant" in line and str(path) in line


# --- bad data -----------------------------------------------------------------------------


def _build(path, tok, **kw):
    return build_train_dataset(_settings(path, **kw), tok, sequence_len=512, seed=0)


def test_missing_file(tmp_path, chatml_tok):
    with pytest.raises(DataError) as e:
        _build(tmp_path / "nope.jsonl", chatml_tok)
    assert "nope.jsonl" in str(e.value) and "does not exist" in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_relative_file_names_the_folder_it_was_looked_for_in(
    tmp_path, chatml_tok, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        _build("nope.jsonl", chatml_tok)
    assert f"does not exist (looked in the working folder {tmp_path})" in str(e.value)


@pytest.mark.parametrize(
    "row,field,words",
    [
        ({"text": "hi"}, "messages", "needs 'messages' or 'conversations'"),
        ({"messages": []}, "messages", "empty conversation"),
        (
            {"messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
            "unknown role 'wizard'",
        ),
        ({"messages": [{"role": "user"}]}, "messages[0]", "missing content key"),
        (
            {"conversations": [{"from": "human", "value": "a"}, {"from": "alien", "value": "b"}]},
            "conversations[1].from",
            "unknown role",
        ),
    ],
)
def test_bad_rows(tmp_path, chatml_tok, row, field, words):
    good = {"messages": CONVO}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, row])
    with pytest.raises(DataError) as e:
        _build(path, chatml_tok)
    msg = str(e.value)
    assert "row 2" in msg and f"field {field!r}" in msg and words in msg and str(path) in msg


def test_skip_bad_rows_counts_and_warns_once(tmp_path, chatml_tok, caplog):
    good = {"messages": CONVO}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, {"messages": []}, good, {"x": 1}])
    with caplog.at_level("WARNING", logger="protrain.train.data"):
        ds = _build(path, chatml_tok, skip_bad_rows=True)
    assert len(ds) == 2
    warnings = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1 and "skipped 2 bad row(s) of 4" in warnings[0].getMessage()


def test_skip_bad_rows_skips_unreadable_lines(tmp_path, chatml_tok, caplog):
    """A line that is not JSON, or not a JSON object, is a bad row like the others: named
    by its row without skip_bad_rows, counted and skipped with it."""
    good = json.dumps({"messages": CONVO})
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join([good, "{not json", good, "[1, 2]", '"text"', good]) + "\n")
    with pytest.raises(DataError, match=r"row 1: line 2 of .* is not valid JSON"):
        _build(path, chatml_tok)
    with caplog.at_level("WARNING", logger="protrain.train.data"):
        ds = _build(path, chatml_tok, skip_bad_rows=True)
    assert len(ds) == 3
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1 and "skipped 3 bad row(s) of 6" in warnings[0], warnings
    path.write_text(good + "\n[1, 2]\n")
    with pytest.raises(DataError, match="row 1: expected a JSON object, got list"):
        _build(path, chatml_tok)


def test_text_only_model_joins_text_parts_and_refuses_media(tmp_path, chatml_tok):
    """Content given as parts trains as its text (a template without parts support would
    write the list's repr); media parts or columns are refused for a model without a
    processor, naming the field."""
    parts = [
        {**m, "content": [{"type": "text", "text": m["content"][:3]},
                          {"type": "text", "text": m["content"][3:]}]}
        for m in CONVO
    ]  # fmt: skip
    plain = _build(write_jsonl(tmp_path / "plain.jsonl", [{"messages": CONVO}]), chatml_tok)
    split = _build(write_jsonl(tmp_path / "parts.jsonl", [{"messages": parts}]), chatml_tok)
    assert split[0]["input_ids"] == plain[0]["input_ids"]
    assert split[0]["labels"] == plain[0]["labels"]
    image = [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"}]
    media = [
        ({"messages": [{"role": "user", "content": image}, *CONVO[2:]]},
         "field 'messages[0].content[0]': an image part, but the model reads text only"),
        ({"messages": CONVO, "images": ["cat.png"]},
         "field 'images': 1 item(s) here, but the model reads text only"),
    ]  # fmt: skip
    for row, words in media:
        with pytest.raises(DataError) as e:
            _build(write_jsonl(tmp_path / "media.jsonl", [row]), chatml_tok)
        assert words in str(e.value), str(e.value)
    ds = _build(write_jsonl(tmp_path / "mixed.jsonl", [media[1][0], {"messages": CONVO}]),
                chatml_tok, skip_bad_rows=True)  # fmt: skip
    assert len(ds) == 1


def test_no_chat_template(tmp_path):
    tok = byte_tokenizer(CHATML_SPECIALS, eos="<|im_end|>")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    with pytest.raises(DataError, match="chat_template"):
        _build(path, tok)
    ds = _build(path, tok, chat_template="chatml")
    assert ds[0]["labels"] == expected_labels(tok, _chatml_pieces())[2]


# --- collation, eval split, inspection ------------------------------------------------------


def test_collator_pads_and_masks(tmp_path, chatml_tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}, {"messages": CONVO[1:3]}])
    ds = _build(path, chatml_tok)
    batch = build_collator(chatml_tok, sequence_len=512, packing=False, pad_to_multiple_of=8)(
        [ds[0], ds[1]]
    )
    n0, n1 = len(ds[0]["input_ids"]), len(ds[1]["input_ids"])
    width = batch["input_ids"].shape[1]
    assert width % 8 == 0 and width >= max(n0, n1)
    assert batch["attention_mask"][1].tolist() == [1] * n1 + [0] * (width - n1)
    assert batch["labels"][1, n1:].eq(IGNORE_INDEX).all()
    assert batch["input_ids"][1, n1:].eq(chatml_tok.pad_token_id).all()
    assert batch["labels"][0].tolist()[:n0] == ds[0]["labels"]


def test_val_set_size_is_deterministic(tmp_path, chatml_tok):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i in range(10)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    settings = _settings(path, val_set_size=0.2)
    train = build_train_dataset(settings, chatml_tok, sequence_len=512, seed=3)
    val = build_eval_dataset(settings, chatml_tok, sequence_len=512, seed=3)
    assert len(train) == 8 and len(val) == 2
    train_ids = {tuple(x["input_ids"]) for x in train}
    assert not any(tuple(x["input_ids"]) in train_ids for x in val)
    again = build_eval_dataset(settings, chatml_tok, sequence_len=512, seed=3)
    assert [x["input_ids"] for x in again] == [x["input_ids"] for x in val]
    assert build_eval_dataset(_settings(path), chatml_tok, sequence_len=512, seed=3) is None


def test_inspection_marks_trained_spans(tmp_path, chatml_tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    text = render_inspection(_settings(path), chatml_tok, sequence_len=512, n_samples=1)
    assert "[[Hello!<|im_end|>]]" in text and "[[See you.<|im_end|>]]" in text
    assert "<|im_start|>user\nHi<|im_end|>" in text
    colored = render_inspection(_settings(path), chatml_tok, sequence_len=512, color=True)
    assert "\x1b[32mHello!<|im_end|>\x1b[0m" in colored


def test_answer_equal_to_a_header_word(tmp_path, chatml_tok):
    messages = [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "assistant"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    item = _build(path, chatml_tok)[0]
    pieces = [
        ("<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n", False),
        ("assistant<|im_end|>", True),
        ("\n", False),
    ]
    assert item["labels"] == expected_labels(chatml_tok, pieces)[2]


@pytest.mark.parametrize("body", ["user", "er", "tool"])
def test_a_trained_body_equal_to_its_header_word_trains_the_body(tmp_path, chatml_tok, body):
    # the role name is plain text in the header: a user or tool body that is (part of) it
    # is the text that closes the turn, not the header's
    messages = [
        {"role": "user", "content": body},
        {"role": "assistant", "content": "Yo", "tool_calls": None},
        {"role": "tool", "content": "o"},
        {"role": "assistant", "content": "ok"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    roles = ["user", "tool", "assistant"]
    ds = build_train_dataset(
        _settings(path, roles_to_train=roles), chatml_tok, sequence_len=512, seed=0
    )
    pieces = [
        ("<|im_start|>user\n", False),
        (f"{body}<|im_end|>", True),
        ("\n<|im_start|>assistant\n", False),
        ("Yo<|im_end|>", True),
        ("\n<|im_start|>tool\n", False),
        ("o<|im_end|>", True),
        ("\n<|im_start|>assistant\n", False),
        ("ok<|im_end|>", True),
        ("\n", False),
    ]
    assert ds[0]["labels"] == expected_labels(chatml_tok, pieces)[2]


def test_template_that_rewrites_content_is_a_data_error(tmp_path, chatml_tok):
    upper = CHATML.replace("message['content']", "message['content'] | upper")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO[1:3]}])
    with pytest.raises(
        DataError, match=r"row 0, field 'messages\[0\]': the chat template does not render"
    ):
        _build(path, chatml_tok, chat_template=upper)


class _NoOffsets:
    """A tokenizer without character offsets (as Python tokenizers are)."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, **kwargs):
        if kwargs.get("return_offsets_mapping"):
            raise NotImplementedError("return_offset_mapping is not available")
        return self._tok(text, **kwargs)

    def __len__(self):
        return len(self._tok)


def test_tokenizer_without_offsets_tokenizes_by_pieces(tmp_path, chatml_tok, caplog):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    with caplog.at_level("WARNING", logger="protrain.train.data"):
        item = _build(path, _NoOffsets(chatml_tok))[0]
    _, ids, labels = expected_labels(chatml_tok, _chatml_pieces())
    assert item["input_ids"] == ids and item["labels"] == labels
    assert any("gives no character offsets" in r.getMessage() for r in caplog.records)


def test_yaml_role_boundaries_on_text_chat(tmp_path, chatml_tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}])
    boundaries = [
        {
            "role": "assistant",
            "start": "<|im_start|>assistant\n",
            "end": "<|im_end|>",
            "include_end": False,
        },
    ]
    item = _build(path, chatml_tok, role_boundaries=boundaries)[0]
    assert item["labels"] == expected_labels(chatml_tok, _chatml_pieces((False, False)))[2]
    with pytest.raises(DataError, match="no usable sample"):
        _build(path, chatml_tok, role_boundaries=[])
    bad = [{"role": "assistant", "start": "<start_of_turn>model\n", "end": "eos_token"}]
    with pytest.raises(DataError, match=r"field 'role_boundaries'.*does not have"):
        _build(path, chatml_tok, role_boundaries=bad)
