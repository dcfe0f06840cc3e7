"""Tool calls given to each template in the form it wants (`tool_call_form.py`), bad arguments,
`chat_template_kwargs`, and tool calls with a null content in processor (vision) rows."""

from __future__ import annotations

import pytest

from protrain.train.data import DataError, DataSettings, build_train_dataset
from protrain.train.data.prepared import fingerprint
from protrain.train.data.rendering import ChatRenderer
from protrain.train.data.tool_call_form import ArgumentsForm, ToolCallForm

from .helpers import byte_tokenizer, expected_labels, marked_pieces, write_jsonl
from .test_tool_calling import SPECIALS, TEMPLATES, WEATHER, _encode, call
from .vision_helpers import qwen2_vl_processor, write_image

FAMILY = {
    "qwen2_5": "qwen",
    "qwen3": "qwen",
    "llama3_1": "llama3",
    "llama3_2": "llama3",
    "mistral_nemo": "mistral",
    "mistral_v0_3": "mistral",
    "deepseek_r1": "deepseek",
    "deepseek_v3": "deepseek",
    "deepseek_v3_1": "deepseek",
    "phi3_5": "phi",
}
OBJECT, TEXT, AS_GIVEN = ArgumentsForm.OBJECT, ArgumentsForm.TEXT, ArgumentsForm.AS_GIVEN


@pytest.mark.parametrize(
    "template, form",
    [
        ("qwen2_5", ToolCallForm(OBJECT)),  # `arguments | tojson`
        ("qwen3", ToolCallForm(AS_GIVEN)),  # a string as it is, else `tojson`
        ("llama3_1", ToolCallForm(OBJECT)),
        ("llama3_2", ToolCallForm(OBJECT)),
        ("mistral_nemo", ToolCallForm(OBJECT)),  # `function | tojson`
        ("mistral_v0_3", ToolCallForm(OBJECT)),
        ("deepseek_r1", ToolCallForm(TEXT, empty_content_as_null=True)),  # `'...' + arguments`
        ("deepseek_v3", ToolCallForm(TEXT, empty_content_as_null=True)),
        ("deepseek_v3_1", ToolCallForm(OBJECT)),
        ("phi3_5", ToolCallForm(AS_GIVEN)),  # writes no tool calls
    ],
)
def test_probe_finds_each_official_templates_form(template, form):
    tok = byte_tokenizer(**SPECIALS[FAMILY[template]])
    renderer = ChatRenderer(tok, (TEMPLATES / f"{template}.jinja").read_text(), (tok.eos_token,))
    assert renderer.tool_call_form == form


def _oslo_row(arguments, content=None):
    return {
        "messages": [
            {"role": "user", "content": "Oslo?"},
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [call("get_weather", arguments, "a1b2c3d4e")],
            },
            {"role": "tool", "content": "snow", "tool_call_id": "a1b2c3d4e"},
            {"role": "assistant", "content": "Snow."},
        ],
        "tools": [WEATHER],
    }


@pytest.mark.parametrize(
    "template", ["qwen2_5", "llama3_1", "mistral_v0_3", "deepseek_r1", "deepseek_v3"]
)
def test_arguments_as_object_or_json_text_render_alike(tmp_path, template):
    tok = byte_tokenizer(**SPECIALS[FAMILY[template]])
    as_object, as_text = _encode(
        tmp_path,
        tok,
        [_oslo_row({"city": "Oslo"}), _oslo_row('{"city": "Oslo"}')],
        template,
    )
    assert as_object["input_ids"] == as_text["input_ids"]
    assert as_object["labels"] == as_text["labels"]
    trained = tok.decode([t for t in as_object["labels"] if t >= 0])
    assert '{"city": "Oslo"}' in trained and '\\"city\\"' not in trained


def test_empty_content_beside_calls_is_null_for_deepseek(tmp_path):
    tok = byte_tokenizer(**SPECIALS["deepseek"])
    null, empty = _encode(
        tmp_path,
        tok,
        [_oslo_row('{"city": "Oslo"}'), _oslo_row({"city": "Oslo"}, "")],
        "deepseek_r1",
    )
    assert null["input_ids"] == empty["input_ids"] and null["labels"] == empty["labels"]
    with pytest.raises(DataError, match=r"messages\[1\].*only beside a null content"):
        _encode(tmp_path, tok, [_oslo_row({"city": "Oslo"}, "Let me see.")], "deepseek_r1")


@pytest.mark.parametrize(
    "arguments, field, problem",
    [
        ('{"city": ', "function.arguments", r"arguments '\{\"city\": ' are not valid JSON"),
        ("[1, 2]", "function.arguments", r"arguments '\[1, 2\]' are JSON text of a list, not of"),
        (5, "function.arguments", r"arguments of type int \(5\)"),
        (None, "function.arguments", "arguments of type NoneType"),
    ],
)
def test_bad_arguments_are_one_data_error(tmp_path, arguments, field, problem):
    tok = byte_tokenizer(**SPECIALS["qwen"])
    where = rf"row 0, field 'messages\[1\].tool_calls\[0\].{field}': {problem}"
    with pytest.raises(DataError, match=where + ".*must be an object.*or JSON text of one"):
        _encode(tmp_path, tok, [_oslo_row(arguments)], "qwen2_5")


def test_a_call_without_arguments_is_a_data_error(tmp_path):
    tok = byte_tokenizer(**SPECIALS["qwen"])
    row = _oslo_row({})
    row["messages"][1]["tool_calls"] = [{"name": "get_weather"}]  # the flat form
    with pytest.raises(DataError, match=r"tool_calls\[0\].arguments': no arguments"):
        _encode(tmp_path, tok, [row], "qwen2_5")


# --- chat_template_kwargs ------------------------------------------------------------------


def _today(text: str) -> str:
    return text.split("Today Date: ")[1].split("\n")[0]


def test_chat_template_kwargs_reach_every_render_and_rows_win(tmp_path):
    tok = byte_tokenizer(**SPECIALS["llama3"])
    rows = [_oslo_row({"city": "Oslo"}), {**_oslo_row({"city": "Oslo"}), "date_string": "05 May"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    template = str(TEMPLATES / "llama3_2.jinja")

    def texts(**settings):
        s = DataSettings(chat_template=template, **settings)
        items = build_train_dataset(s, tok, sequence_len=4096, seed=0)
        return [_today(tok.decode(item["input_ids"])) for item in items]

    top = {"chat_template_kwargs": {"date_string": "01 Jan"}}
    assert texts(datasets=[{"path": str(path)}], **top) == ["01 Jan", "05 May"]
    per_dataset = {"path": str(path), "chat_template_kwargs": {"date_string": "02 Feb"}}
    assert texts(datasets=[per_dataset], **top) == ["02 Feb", "05 May"]


def test_chat_template_kwargs_change_the_cache_fingerprint():
    tok = byte_tokenizer(**SPECIALS["qwen"])

    def fp(**settings):
        s = DataSettings(datasets=[{"path": "x.jsonl", **settings.pop("ds", {})}], **settings)
        return fingerprint(s, tok, sequence_len=64, seed=0)

    base = fp()
    assert fp(chat_template_kwargs={"enable_thinking": False}) != base
    assert fp(ds={"chat_template_kwargs": {"enable_thinking": False}}) != base
    assert fp(chat_template_kwargs={}) == base


@pytest.mark.parametrize(
    "value, match",
    [
        ([("enable_thinking", False)], "must be a mapping of template variable names.*got list"),
        ("enable_thinking=false", "must be a mapping.*got str"),
        ({"add_generation_prompt": True}, r"\['add_generation_prompt'\] are set by protrain"),
        ({"not a name": 1}, r"\['not a name'\] are not template variable names"),
    ],
)
def test_bad_chat_template_kwargs(value, match):
    with pytest.raises(ValueError, match="chat_template_kwargs: " + match):
        DataSettings(chat_template_kwargs=value)
    with pytest.raises(ValueError, match="chat_template_kwargs: " + match):
        DataSettings(datasets=[{"path": "x.jsonl", "chat_template_kwargs": value}])


# --- processor rows: a null content stays null -------------------------------------------------

# Tool calls written only for a null content (as DeepSeek's templates do), images as Qwen2-VL.
VL_TOOLS = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is none %}{% for c in message['tool_calls'] %}"
    "<call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</call>"
    "{% endfor %}{% elif message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_processor_rows_keep_a_null_content_beside_tool_calls(tmp_path):
    write_image(tmp_path / "sky.png")
    proc = qwen2_vl_processor()
    row = _oslo_row('{"city": "Oslo"}')
    row["messages"][0]["content"] = [{"type": "image"}, {"type": "text", "text": "Oslo?"}]
    row["images"] = ["sky.png"]
    path = write_jsonl(tmp_path / "vl.jsonl", [row])
    s = DataSettings(datasets=[{"path": str(path)}], chat_template=VL_TOOLS)
    item = build_train_dataset(s, proc.tokenizer, sequence_len=512, seed=0, processor=proc)[0]
    image = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>"
    marked = (
        f"<|im_start|>user\n{image}Oslo?<|im_end|>\n<|im_start|>assistant\n"
        '⟦<call>get_weather {"city": "Oslo"}</call><|im_end|>⟧\n'
        "<|im_start|>tool\nsnow<|im_end|>\n<|im_start|>assistant\n⟦Snow.<|im_end|>⟧\n"
    )
    _, ids, labels = expected_labels(proc.tokenizer, marked_pieces(marked))
    assert item["input_ids"] == ids
    assert item["labels"] == labels


def test_parquet_arguments_and_tools_lose_the_nulls_of_the_struct_schema(tmp_path, caplog):
    """Arrow gives every call (and schema) of a column every key seen; the fill is not kept."""
    import datasets

    search = {"type": "function", "function": {"name": "search", "parameters": {"q": "str"}}}
    rows = [_oslo_row({"city": "Oslo"}), _oslo_row({"city": "Bergen", "days": 2})]
    rows[1]["tools"] = [search]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chat.parquet"))
    tok = byte_tokenizer(**SPECIALS["qwen"])
    template = str(TEMPLATES / "qwen2_5.jinja")
    with caplog.at_level("WARNING", logger="protrain.train.data"):
        from_parquet = build_train_dataset(
            DataSettings(
                datasets=[{"path": str(tmp_path / "chat.parquet")}], chat_template=template
            ),
            tok,
            sequence_len=4096,
            seed=0,
        )
    from_json = _encode(tmp_path, tok, rows, "qwen2_5")
    assert [i["input_ids"] for i in from_parquet] == [i["input_ids"] for i in from_json]
    assert '"arguments": {"city": "Oslo"}}' in tok.decode(from_parquet[0]["input_ids"])
    assert "null" not in tok.decode(from_parquet[0]["input_ids"] + from_parquet[1]["input_ids"])
    assert sum("read through Arrow had null fields" in r.getMessage() for r in caplog.records) == 1
