"""Loading local files and folders, field mapping, completion and text formats, mixing."""

from __future__ import annotations

import json

import pytest

from protrain.train.data import (
    IGNORE_INDEX,
    DataError,
    DatasetConfig,
    DataSettings,
    build_train_dataset,
)
from protrain.train.data.loading import UnreadableRow, read_rows, select_rows

from .helpers import byte_tokenizer, expected_labels, write_jsonl

CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture
def tok():
    return byte_tokenizer(CHATML_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>")


def _chat(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}"},
        ]
    }


def test_json_parquet_csv_and_folder(tmp_path):
    import datasets

    rows = [_chat(i) for i in range(4)]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    write_jsonl(tmp_path / "b.jsonl", rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    (tmp_path / "d.csv").write_text("prompt,completion\nHi,there\n")
    for name in ("a.json", "b.jsonl", "c.parquet"):
        got = read_rows(DatasetConfig(path=str(tmp_path / name)))
        assert got == rows, name
    assert read_rows(DatasetConfig(path=str(tmp_path / "d.csv"), type="completion")) == [
        {"prompt": "Hi", "completion": "there"}
    ]
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "x.jsonl", rows[:2])
    write_jsonl(folder / "y.jsonl", rows[2:])
    assert read_rows(DatasetConfig(path=str(folder))) == rows
    assert read_rows(DatasetConfig(path=str(folder), data_files="y.jsonl")) == rows[2:]


def test_saved_dataset_folder(tmp_path):
    import datasets

    rows = [_chat(i) for i in range(3)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "saved")
    )
    assert read_rows(DatasetConfig(path=str(tmp_path / "saved"))) == rows
    with pytest.raises(DataError, match="split 'test' not found"):
        read_rows(DatasetConfig(path=str(tmp_path / "saved"), split="test"))


def test_broken_json_line_keeps_its_place(tmp_path):
    """Its row is an UnreadableRow saying why (encoding it raises, naming the row: see
    tests/data/test_chat_basic.py), so that skip_bad_rows can skip it."""
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(_chat(0)) + "\n{not json\n" + json.dumps(_chat(1)) + "\n")
    rows = read_rows(DatasetConfig(path=str(path)))
    assert rows[0] == _chat(0) and rows[2] == _chat(1)
    assert isinstance(rows[1], UnreadableRow)
    assert rows[1].problem.startswith(f"line 2 of {path} is not valid JSON")


def test_shuffle_and_max_samples_are_seeded(tmp_path):
    rows = [_chat(i) for i in range(20)]
    cfg = DatasetConfig(path="x.jsonl", shuffle=True, max_samples=5)
    a = select_rows(rows, cfg, seed=1)
    assert [i for i, _ in a] == [i for i, _ in select_rows(rows, cfg, seed=1)]
    assert [i for i, _ in a] != [i for i, _ in select_rows(rows, cfg, seed=2)]
    assert len(a) == 5
    assert [i for i, _ in select_rows(rows, DatasetConfig(path="x", max_samples=3), seed=1)] == [
        0,
        1,
        2,
    ]


def test_field_mapping(tmp_path, tok):
    row = {"dialog": [{"speaker": "human", "text": "Hi"}, {"speaker": "bot", "text": "Yo"}]}
    path = write_jsonl(tmp_path / "x.jsonl", [row])
    settings = DataSettings(
        datasets=[
            {
                "path": str(path),
                "field_messages": "dialog",
                "message_field_role": "speaker",
                "message_field_content": "text",
            }
        ],
        chat_template="chatml",
    )
    item = build_train_dataset(settings, tok, sequence_len=128, seed=0)[0]
    pieces = [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        ("Yo<|im_end|>", True),
        ("\n", False),
    ]
    assert item["labels"] == expected_labels(tok, pieces)[2]


def test_custom_role_names(tmp_path, tok):
    row = {"conversations": [{"from": "asker", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}
    path = write_jsonl(tmp_path / "x.jsonl", [row])
    base = {"path": str(path)}
    with pytest.raises(DataError, match="unknown role 'asker'"):
        build_train_dataset(
            DataSettings(datasets=[base], chat_template="chatml"), tok, sequence_len=128, seed=0
        )
    settings = DataSettings(datasets=[{**base, "roles": {"asker": "user"}}], chat_template="chatml")
    assert len(build_train_dataset(settings, tok, sequence_len=128, seed=0)) == 1


def test_completion_format(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    item = build_train_dataset(
        DataSettings(datasets=[{"path": str(path), "type": "completion"}]),
        tok,
        sequence_len=64,
        seed=0,
    )[0]
    assert item["labels"] == expected_labels(tok, [("2+2=", False), ("4<|im_end|>", True)])[2]
    item = build_train_dataset(
        DataSettings(datasets=[{"path": str(path), "type": "completion"}], train_on_eos="none"),
        tok,
        sequence_len=64,
        seed=0,
    )[0]
    assert (
        item["labels"]
        == expected_labels(tok, [("2+2=", False), ("4", True), ("<|im_end|>", False)])[2]
    )
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}])
    with pytest.raises(DataError, match=r"row 0, field 'completion': missing"):
        build_train_dataset(
            DataSettings(datasets=[{"path": str(bad), "type": "completion"}]),
            tok,
            sequence_len=64,
            seed=0,
        )


def test_text_format_and_truncation(tmp_path, tok, caplog):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "abcdefghij"}])
    settings = DataSettings(datasets=[{"path": str(path), "type": "text", "field_text": "body"}])
    item = build_train_dataset(settings, tok, sequence_len=64, seed=0)[0]
    assert (
        item["labels"]
        == item["input_ids"]
        == expected_labels(tok, [("abcdefghij<|im_end|>", True)])[1]
    )
    with caplog.at_level("WARNING", logger="protrain.train.data"):
        item = build_train_dataset(settings, tok, sequence_len=4, seed=0)[0]
    assert item["input_ids"] == expected_labels(tok, [("abcd", True)])[1]
    assert any("truncated" in r.getMessage() for r in caplog.records)


def test_several_datasets_mixed(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [_chat(i) for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "plain"}])
    settings = DataSettings(
        datasets=[{"path": str(a)}, {"path": str(b), "type": "text"}], chat_template="chatml"
    )
    ds = build_train_dataset(settings, tok, sequence_len=64, seed=0)
    assert len(ds) == 4
    assert ds[3]["labels"] == ds[3]["input_ids"]
    assert all(any(x != IGNORE_INDEX for x in ds[i]["labels"]) for i in range(4))


def test_unreadable_suffix_and_empty_file(tmp_path, tok):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="unknown suffix"):
        read_rows(DatasetConfig(path=str(tmp_path / "x.txt")))
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match="no rows"):
        read_rows(DatasetConfig(path=str(tmp_path / "e.jsonl")))


def test_hub_dataset_goes_through_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load(path, name=None, split=None, data_files=None):
        calls.append((path, name, split, data_files))
        if path == "org/missing":
            raise FileNotFoundError("Couldn't find 'org/missing' on the Hub\n(offline)")
        return datasets.Dataset.from_list([_chat(0)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert read_rows(DatasetConfig(path="org/chats", name="en", split="train[:10]")) == [_chat(0)]
    assert calls == [("org/chats", "en", "train[:10]", None)]
    with pytest.raises(DataError) as e:
        read_rows(DatasetConfig(path="org/missing"))
    assert "dataset 'org/missing', field 'path': cannot load hub dataset" in str(e.value)
    assert "\n" not in str(e.value)


def test_json_lines_end_at_newlines_only_and_a_byte_order_mark_is_not_data(tmp_path):
    # U+2028, U+2029 and U+0085 may stand raw inside JSON strings (json.dumps with
    # ensure_ascii=False writes them so); str.splitlines would cut a row there
    rows = [_chat(0), _chat(1)]
    rows[0]["messages"][1]["content"] = "a\u2028b\u2029c\x85d"
    path = tmp_path / "x.jsonl"
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_rows(DatasetConfig(path=str(path))) == rows
    array = tmp_path / "x.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    assert read_rows(DatasetConfig(path=str(array))) == rows
    bad = tmp_path / "bad.jsonl"  # the place of a bad byte counts from after the mark
    bad.write_bytes(b'\xef\xbb\xbf{"text": "ok"}\n\xff{"text": "x"}\n')
    with pytest.raises(DataError, match="line 2, column 1"):
        read_rows(DatasetConfig(path=str(bad)))


def test_rows_longer_than_sequence_len_are_dropped_or_refused_when_asked(tmp_path, tok):
    long_answer = {"role": "assistant", "content": "a" * 60}
    long_row = {"messages": [{"role": "user", "content": "q"}, long_answer]}
    path = write_jsonl(tmp_path / "d.jsonl", [_chat(0), long_row, _chat(2)])

    def build(strategy):
        settings = DataSettings(
            datasets=[{"path": str(path)}], chat_template="chatml", excess_length_strategy=strategy
        )
        return build_train_dataset(settings, tok, sequence_len=40, seed=0)

    assert len(build("truncate")) == 3
    assert len(build("drop")) == 2
    with pytest.raises(DataError, match=r"row 1.*longer than sequence_len = 40"):
        build("raise")
