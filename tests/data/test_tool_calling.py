"""Tool-calling conversations with the official chat templates of each family (fixtures in
`templates/`), and templates that do not render a conversation turn by turn.

Each case is written as the text the official template renders, trained text between ⟦ and ⟧,
and checked token by token with a byte tokenizer (one token per byte) and with a BPE whose merges
were learnt on the case (words are single tokens). Every case has parallel or single tool calls
without content, a tool result that repeats the call's text, an empty assistant turn and an answer
that is one of the template's marker words.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from protrain.train.data import DataError, DataSettings, build_train_dataset, render_inspection
from protrain.train.data.masks import IGNORE_INDEX, MaskSettings
from protrain.train.data.role_boundaries import family_boundaries, labels_by_boundaries

from .helpers import bpe_tokenizer, byte_tokenizer, expected_labels, marked_pieces, write_jsonl

TEMPLATES = Path(__file__).parent / "templates"

SPECIALS = {
    "qwen": dict(
        special_tokens=[
            "<|im_start|>",
            "<|im_end|>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ],
        eos="<|im_end|>",
    ),
    "llama3": dict(
        special_tokens=[
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "mistral": dict(
        special_tokens=[
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        bos="<s>",
        eos="</s>",
    ),
    "deepseek": dict(
        special_tokens=[
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
            "<think>",
            "</think>",
        ],
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
    ),
    "phi": dict(
        special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], eos="<|endoftext|>"
    ),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def call(name, arguments, call_id=None):
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id:
        out["id"] = call_id
    return out


# --- Qwen2.5 / Qwen3: Hermes-style <tool_call>, results in a user turn -------------------------

QWEN_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def qwen_call(city):
    return (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
    )


def qwen_turn(role, body):
    return f"<|im_start|>{role}\n{body}<|im_end|>\n"


def qwen_answer(body):
    return f"<|im_start|>assistant\n⟦{body}<|im_end|>⟧\n"


QWEN_CONVO = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("get_weather", {"city": "Paris"}),
            call("get_weather", {"city": "Rome"}),
        ],
    },
    {"role": "tool", "content": "Paris"},  # repeats the call's text
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "ok"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "who?"},
    {"role": "assistant", "content": "assistant"},  # a word of the template's markup
]


def _qwen_expected(last_answer: str) -> str:
    return (
        "<|im_start|>system\nUse tools.\n\n"
        + QWEN_TOOLS
        + qwen_turn("user", "Weather in Paris and Rome?")
        + qwen_answer(qwen_call("Paris") + "\n" + qwen_call("Rome"))
        + "<|im_start|>user\n<tool_response>\nParis\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        + qwen_answer("Paris")
        + qwen_turn("user", "ok")
        + qwen_answer("")
        + qwen_turn("user", "who?")
        + qwen_answer(last_answer)
    )


# Qwen3: after the last user query, tool-calling turns keep their reasoning; the final one gets
# a think block. Rendering `messages[:2]` alone would give the first call a think block too.
QWEN3_STEPS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"})]},
    {"role": "tool", "content": '{"city": "Paris"}'},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hm",
        "tool_calls": [call("get_weather", {"city": "Rome"})],
    },
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "Rain."},
]

QWEN3_STEPS_EXPECTED = (
    "<|im_start|>system\n"
    + QWEN_TOOLS
    + qwen_turn("user", "Weather in Paris?")
    + qwen_answer(qwen_call("Paris"))
    + qwen_turn("user", '<tool_response>\n{"city": "Paris"}\n</tool_response>')
    + qwen_answer("<think>\nhm\n</think>\n\n" + qwen_call("Rome"))
    + qwen_turn("user", "<tool_response>\nrain\n</tool_response>")
    + qwen_answer("<think>\n\n</think>\n\nRain.")
)

# --- Llama 3.1 / 3.2 / 3.3: JSON tool calls, ipython results, built-in tools end with eom ------


def llama_turn(role, body):
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{body}<|eot_id|>"


def llama_answer(body, end="<|eot_id|>"):
    return f"<|start_header_id|>assistant<|end_header_id|>\n\n⟦{body}{end}⟧"


LLAMA_TOOLS = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.Do not use variables.\n\n" + json.dumps(WEATHER, indent=4) + "\n\n"
)

LLAMA_CONVO = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Paris"})]},
    {"role": "tool", "content": '{"city": "Paris", "sky": "sunny"}'},
    {"role": "assistant", "content": "Sunny in Paris."},
    {"role": "user", "content": "ok"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "who?"},
    {"role": "assistant", "content": "assistant"},
]

LLAMA_EXPECTED = (
    "<|begin_of_text|>"
    + llama_turn(
        "system",
        "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n"
        "Use tools.",
    )
    + llama_turn("user", LLAMA_TOOLS + "Weather in Paris?")
    + llama_answer('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    + llama_turn("ipython", json.dumps('{"city": "Paris", "sky": "sunny"}'))
    + llama_answer("Sunny in Paris.")
    + llama_turn("user", "ok")
    + llama_answer("")
    + llama_turn("user", "who?")
    + llama_answer("assistant")
)

LLAMA_BUILTIN = [
    {"role": "user", "content": "Search the weather"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("brave_search", {"query": "weather"})],
    },
    {"role": "ipython", "content": "weather"},
    {"role": "assistant", "content": "It is sunny."},
]

LLAMA_BUILTIN_EXPECTED = (
    "<|begin_of_text|>"
    + llama_turn(
        "system",
        "Environment: ipython\nTools: brave_search, wolfram_alpha\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    )
    + llama_turn("user", "Search the weather")
    + llama_answer('<|python_tag|>brave_search.call(query="weather")', end="<|eom_id|>")
    + llama_turn("ipython", '"weather"')
    + llama_answer("It is sunny.")
)

# --- Mistral Nemo: [TOOL_CALLS], [TOOL_RESULTS], the tool list before the last user turn ------

NEMO_CONVO = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("get_weather", {"city": "Paris"}, "abcdefghi"),
            call("get_weather", {"city": "Rome"}, "123456789"),
        ],
    },
    {"role": "tool", "content": "Paris", "tool_call_id": "abcdefghi"},
    {"role": "tool", "content": "rain", "tool_call_id": "123456789"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "ok"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "[INST]"},
]

NEMO_EXPECTED = (
    "<s>[INST]Weather in Paris and Rome?[/INST]"
    '⟦[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}, '
    '{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "123456789"}]</s>⟧'
    '[TOOL_RESULTS]{"content": Paris, "call_id": "abcdefghi"}[/TOOL_RESULTS]'
    '[TOOL_RESULTS]{"content": rain, "call_id": "123456789"}[/TOOL_RESULTS]'
    "⟦Paris</s>⟧[INST]ok[/INST]⟦</s>⟧"
    "[AVAILABLE_TOOLS][" + json.dumps(WEATHER) + "][/AVAILABLE_TOOLS]"
    "[INST]and?[/INST]⟦[INST]</s>⟧"
)

# --- Mistral v0.3 (v3 template): spaced markers, trimmed answers after a space, the system
# prompt only in a final user turn (a conversation ending with an answer drops it) ---------------

MISTRAL_V3_CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("get_weather", '{"city": "Paris"}', "abcdefghi"),  # JSON text: made an object
            call("get_weather", {"city": "Rome"}, "123456789"),
        ],
    },
    {"role": "tool", "content": "Paris", "tool_call_id": "abcdefghi"},
    {"role": "tool", "content": "rain", "tool_call_id": "123456789"},
    {"role": "assistant", "content": "  Paris  "},
    {"role": "user", "content": "And Oslo?"},
    {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Oslo"}, "oslo00001")]},
    {"role": "tool", "content": '{"city": "Oslo"}', "tool_call_id": "oslo00001"},
    {"role": "assistant", "content": "Snow."},
    {"role": "user", "content": "ok"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "[INST]"},
]


def mistral_v3_calls(*cities_ids):
    calls = ", ".join(
        f'{{"name": "get_weather", "arguments": {{"city": "{city}"}}, "id": "{call_id}"}}'
        for city, call_id in cities_ids
    )
    return f"⟦[TOOL_CALLS] [{calls}]</s>⟧"


MISTRAL_V3_EXPECTED = (
    "<s>[INST] Weather in Paris and Rome?[/INST]"
    + mistral_v3_calls(("Paris", "abcdefghi"), ("Rome", "123456789"))
    + '[TOOL_RESULTS] {"content": Paris, "call_id": "abcdefghi"}[/TOOL_RESULTS]'
    '[TOOL_RESULTS] {"content": rain, "call_id": "123456789"}[/TOOL_RESULTS]'
    "⟦ Paris</s>⟧[INST] And Oslo?[/INST]"
    + mistral_v3_calls(("Oslo", "oslo00001"))
    + '[TOOL_RESULTS] {"content": {"city": "Oslo"}, "call_id": "oslo00001"}[/TOOL_RESULTS]'
    "⟦ Snow.</s>⟧[INST] ok[/INST]⟦ </s>⟧"
    "[AVAILABLE_TOOLS] [" + json.dumps(WEATHER) + "][/AVAILABLE_TOOLS]"
    "[INST] and?[/INST]⟦ [INST]</s>⟧"
)

# --- DeepSeek: R1 (tool calls only for content null, arguments as JSON text) and V3.1 --------

DEEPSEEK_CONVO = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [call("get_weather", '{"city": "Paris"}')],
    },
    {"role": "tool", "content": '{"city": "Paris"}'},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "ok"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "who?"},
    {"role": "assistant", "content": "<think>me</think>Assistant"},
]

# R1 prompts with `<｜Assistant｜><think>\n` but writes history as `<｜Assistant｜>` + answer.
R1_EXPECTED = (
    "<｜begin▁of▁sentence｜>Use tools.<｜User｜>Weather in Paris?<｜Assistant｜>"
    "⟦<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>⟧'
    '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"city": "Paris"}<｜tool▁output▁end｜>'
    "<｜tool▁outputs▁end｜>⟦Sunny.<｜end▁of▁sentence｜>⟧"
    "<｜User｜>ok<｜Assistant｜>⟦<｜end▁of▁sentence｜>⟧"
    "<｜User｜>who?<｜Assistant｜>⟦Assistant<｜end▁of▁sentence｜>⟧"
)

# DeepSeek-V3's first template: a single call is never closed, `is_first` and `is_output_first`
# are never reset (a later call turn and its results lose their opening markers), the answer
# after tool results follows `<｜tool▁outputs▁end｜>` without a header.
V3_CONVO = [
    *DEEPSEEK_CONVO[:2],
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("get_weather", {"city": "Paris"}),  # an object: written as JSON text
            call("get_weather", '{"city": "Rome"}'),
        ],
    },
    {"role": "tool", "content": '{"city": "Paris"}'},
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "And Oslo?"},
    {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
    {"role": "tool", "content": "snow"},
    {"role": "assistant", "content": "Snow."},
    *DEEPSEEK_CONVO[5:8],
    {"role": "assistant", "content": "<｜Assistant｜>"},
]


def v3_call(city, first=False):
    opening = "<｜tool▁calls▁begin｜>" if first else "\n"
    return (
        f"{opening}<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        f'```json\n{{"city": "{city}"}}\n```<｜tool▁call▁end｜>'
    )


V3_EXPECTED = (
    "<｜begin▁of▁sentence｜>Use tools.<｜User｜>Weather in Paris?<｜Assistant｜>"
    "⟦"
    + v3_call("Paris", first=True)
    + v3_call("Rome")
    + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>⟧"
    '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"city": "Paris"}<｜tool▁output▁end｜>'
    "\n<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    "⟦Sunny.<｜end▁of▁sentence｜>⟧<｜User｜>And Oslo?"
    "⟦" + v3_call("Oslo") + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>⟧"
    "\n<｜tool▁output▁begin｜>snow<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    "⟦Snow.<｜end▁of▁sentence｜>⟧"
    "<｜User｜>ok<｜Assistant｜>⟦<｜end▁of▁sentence｜>⟧"
    "<｜User｜>who?<｜Assistant｜>⟦<｜Assistant｜><｜end▁of▁sentence｜>⟧"
)

V3_1_CONVO = [
    *DEEPSEEK_CONVO[:2],
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            call("get_weather", {"city": "Paris"}),
            call("get_weather", {"city": "Rome"}),
        ],
    },
    {"role": "tool", "content": '{"city": "Paris"}'},
    {"role": "tool", "content": "rain"},
    *DEEPSEEK_CONVO[4:],
]

V3_1_EXPECTED = (
    "<｜begin▁of▁sentence｜>Use tools.<｜User｜>Weather in Paris?<｜Assistant｜><think></think>"
    "⟦<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
    '{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>⟧'
    '<｜tool▁output▁begin｜>{"city": "Paris"}<｜tool▁output▁end｜>'
    "<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜>⟦Sunny.<｜end▁of▁sentence｜>⟧"
    "<｜User｜>ok<｜Assistant｜><think></think>⟦<｜end▁of▁sentence｜>⟧"
    "<｜User｜>who?<｜Assistant｜><think></think>⟦Assistant<｜end▁of▁sentence｜>⟧"
)

# --- Phi-3.5: EOS appended after the last turn, no header in the rendered history -------------

PHI_CONVO = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "assistant"},
    {"role": "user", "content": "<|end|>"},
    {"role": "assistant", "content": ""},
]
PHI_EXPECTED = (
    "<|user|>\nHi<|end|>\n<|assistant|>\n⟦assistant<|end|>⟧\n"
    "<|user|>\n<|end|><|end|>\n<|assistant|>\n⟦<|end|>⟧\n<|endoftext|>"
)

# case: (template file, tokenizer family, row, expected)
CASES = {
    "qwen2_5": ("qwen2_5", "qwen", {"messages": QWEN_CONVO, "tools": [WEATHER]}, None),
    "qwen3": ("qwen3", "qwen", {"messages": QWEN_CONVO, "tools": [WEATHER]}, None),
    "qwen3_steps": (
        "qwen3",
        "qwen",
        {"messages": QWEN3_STEPS, "tools": [WEATHER]},
        QWEN3_STEPS_EXPECTED,
    ),
    "llama3_1": (
        "llama3_1",
        "llama3",
        {"messages": LLAMA_CONVO, "tools": [WEATHER], "date_string": "01 Jan 2025"},
        LLAMA_EXPECTED,
    ),
    "llama3_2": (
        "llama3_2",
        "llama3",
        {"messages": LLAMA_CONVO, "tools": json.dumps([WEATHER]), "date_string": "01 Jan 2025"},
        LLAMA_EXPECTED,
    ),
    "llama3_1_builtin": (
        "llama3_1",
        "llama3",
        {"messages": LLAMA_BUILTIN, "builtin_tools": ["brave_search", "wolfram_alpha"]},
        LLAMA_BUILTIN_EXPECTED,
    ),
    "mistral_nemo": (
        "mistral_nemo",
        "mistral",
        {"messages": NEMO_CONVO, "tools": [WEATHER]},
        NEMO_EXPECTED,
    ),
    "mistral_v0_3": (
        "mistral_v0_3",
        "mistral",
        {"messages": MISTRAL_V3_CONVO, "tools": [WEATHER]},
        MISTRAL_V3_EXPECTED,
    ),
    "deepseek_r1": ("deepseek_r1", "deepseek", {"messages": DEEPSEEK_CONVO}, R1_EXPECTED),
    "deepseek_v3": ("deepseek_v3", "deepseek", {"messages": V3_CONVO}, V3_EXPECTED),
    "deepseek_v3_1": ("deepseek_v3_1", "deepseek", {"messages": V3_1_CONVO}, V3_1_EXPECTED),
    "phi3_5": ("phi3_5", "phi", {"messages": PHI_CONVO}, PHI_EXPECTED),
}
EXPECTED = {
    "qwen2_5": _qwen_expected("assistant"),
    "qwen3": _qwen_expected("<think>\n\n</think>\n\nassistant"),
}


def _case(name):
    template, family, row, expected = CASES[name]
    return template, family, row, expected if expected is not None else EXPECTED[name]


def _tokenizer(family: str, kind: str, text: str):
    if kind == "bytes":
        return byte_tokenizer(**SPECIALS[family])
    return bpe_tokenizer(corpus=[text] * 4, **SPECIALS[family])


def _encode(tmp_path, tok, rows, template, **settings):
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    s = DataSettings(
        datasets=[{"path": str(path)}],
        chat_template=str(TEMPLATES / f"{template}.jinja"),
        **settings,
    )
    return build_train_dataset(s, tok, sequence_len=4096, seed=0)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_family_tool_conversation_trained_spans(tmp_path, case, kind):
    template, family, row, expected = _case(case)
    pieces = marked_pieces(expected)
    tok = _tokenizer(family, kind, "".join(p for p, _ in pieces))
    item = _encode(tmp_path, tok, [row], template)[0]
    text, ids, labels = expected_labels(tok, pieces)
    assert item["input_ids"] == tok(text, add_special_tokens=False)["input_ids"] == ids
    assert item["labels"] == labels


@pytest.mark.parametrize(
    "case", ["qwen2_5", "llama3_1", "mistral_nemo", "mistral_v0_3", "deepseek_v3", "deepseek_v3_1"]
)
def test_tool_calls_can_be_kept_as_context(tmp_path, case):
    """`train_on_tool_calls: false`: only the answers are trained."""
    template, family, row, expected = _case(case)
    tok = byte_tokenizer(**SPECIALS[family])
    item = _encode(tmp_path, tok, [row], template, train_on_tool_calls=False)[0]
    # The trained pieces that hold a call are the tool-calling turns; the first trained piece is one.
    pieces = marked_pieces(expected)
    assert "get_weather" in next(text for text, trained in pieces if trained)
    pieces = [(text, trained and "get_weather" not in text) for text, trained in pieces]
    assert item["labels"] == expected_labels(tok, pieces)[2]


def test_tool_results_trained_with_the_tool_role(tmp_path):
    template, family, row, _ = _case("llama3_1")
    tok = byte_tokenizer(**SPECIALS[family])
    item = _encode(tmp_path, tok, [row], template, roles_to_train=["assistant", "tool"])[0]
    result = json.dumps(row["messages"][3]["content"])
    trained = tok.decode([t for t in item["labels"] if t != IGNORE_INDEX])
    assert result + "<|eot_id|>" in trained
    assert "Weather in Paris?" not in trained


@pytest.mark.parametrize("result,call_id", [("20", "id2000001"), ("1", "abcdefgh1")])
def test_a_tool_result_is_trained_where_the_template_writes_it(tmp_path, result, call_id):
    # Mistral writes the call id after the result: text equal to the result there is not it
    tok = byte_tokenizer(**SPECIALS["mistral"])
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("get_weather", {"city": "Paris"}, call_id)]},
        {"role": "tool", "content": result, "tool_call_id": call_id},
        {"role": "assistant", "content": "Fine."},
    ]  # fmt: skip
    row = {"messages": messages, "tools": []}
    item = _encode(tmp_path, tok, [row], "mistral_v0_3", roles_to_train=["tool"])[0]
    ids, labels = item["input_ids"], item["labels"]
    first = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
    before = tok.decode(ids[:first])
    assert before.endswith('[TOOL_RESULTS] {"content": '), before[-40:]
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]).startswith(result)


@pytest.mark.parametrize(
    "template,body,tools,system",
    [
        ("qwen2_5", "Weather", [WEATHER], None),  # also in the tool list written first
        ("llama3_1", "Weather", [WEATHER], None),  # the tool list folded into the user turn
        ("llama3_1", "December", None, None),  # the date header before the first user turn
        ("qwen2_5", "s", None, None),  # the default system prompt written before it
        ("deepseek_v3", "er", None, None),  # a piece of the special token <｜User｜> before it
        ("phi3_5", "user", None, None),  # the header's role word
        # Mistral writes the system prompt into the last user turn only: a rendering that
        # ends at this message would differ from the row before the body
        ("mistral_v0_3", "Weather", [WEATHER], "Weather first."),
    ],
)
def test_a_trained_user_body_is_the_body_whatever_the_template_writes_before_it(
    tmp_path, template, body, tools, system
):
    family = {"qwen2_5": "qwen", "llama3_1": "llama3", "deepseek_v3": "deepseek",
              "phi3_5": "phi", "mistral_v0_3": "mistral"}  # fmt: skip
    tok = byte_tokenizer(**SPECIALS[family[template]])
    row = {"messages": [{"role": "user", "content": body}, {"role": "assistant", "content": "ok"}]}
    if system is not None:
        row["messages"].insert(0, {"role": "system", "content": system})
    if tools is not None:
        row["tools"] = tools
    item = _encode(tmp_path, tok, [row], template, roles_to_train=["user"])[0]
    ids, labels = item["input_ids"], item["labels"]
    first = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
    trained = tok.decode([t for t in labels if t != IGNORE_INDEX])
    assert trained.startswith(body) and body not in trained[len(body) :], trained
    assert tok.decode(ids[first : first + len(tok.encode(body, add_special_tokens=False))]) == body


def test_bad_train_on_tool_calls_value():
    with pytest.raises(ValueError, match="train_on_tool_calls"):
        DataSettings(train_on_tool_calls="sometimes")


def test_llama_parallel_calls_refused_by_the_template(tmp_path):
    tok = byte_tokenizer(**SPECIALS["llama3"])
    messages = [*LLAMA_CONVO[1:2], QWEN_CONVO[2]]
    with pytest.raises(DataError, match="row 0, field 'messages'.*single tool-calls"):
        _encode(tmp_path, tok, [{"messages": messages, "tools": [WEATHER]}], "llama3_1")


def test_null_content_falls_back_once_for_templates_that_need_a_string(tmp_path, caplog):
    """Qwen3 tests `'</think>' in content`: a null content is rendered as '' (said once)."""
    template, family, row, expected = _case("qwen3")
    tok = byte_tokenizer(**SPECIALS[family])
    with caplog.at_level(logging.WARNING, logger="protrain.train.data"):
        items = _encode(tmp_path, tok, [row, row], template)
    assert len(items) == 2
    assert sum("content is null" in r.getMessage() for r in caplog.records) == 1


def test_template_without_tool_support_is_a_data_error(tmp_path):
    tok = byte_tokenizer(**SPECIALS["qwen"])
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": QWEN_CONVO[1:]}])
    s = DataSettings(datasets=[{"path": str(path)}], chat_template="chatml")
    with pytest.raises(DataError, match=r"messages\[1\].*tool call\(s\) \['get_weather'"):
        build_train_dataset(s, tok, sequence_len=4096, seed=0)


@pytest.mark.parametrize(
    "row, match",
    [
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "tool_calls": [{"function": {}}]},
                ]
            },
            r"field 'messages\[1\].tool_calls\[0\]': a tool call must be an object",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "tool_calls": "f()"},
                ]
            },
            r"field 'messages\[1\].tool_calls': must be a list of tool calls, got str",
        ),
        (
            {"messages": QWEN_CONVO[1:3], "tools": {"name": "f"}},
            r"field 'tools': must be a list of tool schemas",
        ),
        (
            {"messages": QWEN_CONVO[1:3], "tools": "[{"},
            r"field 'tools': a string here must be a JSON list",
        ),
        (
            {"messages": [{"role": "user", "content": "a", "tool_calls": [call("f", {})]}]},
            r"only assistant messages make tool calls",
        ),
        (
            {"messages": [{"role": "tool", "content": "sunny"}, *QWEN_CONVO[1:3]]},
            r"field 'messages\[0\]': a tool result before any assistant message",
        ),
        (
            {"messages": [*QWEN_CONVO[1:3], *[{"role": "tool", "content": "x"}] * 3]},
            r"field 'messages\[4\]': more tool results than the calls",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [call("get_weather", {"city": "Oslo"}, "c1")],
                    },
                    {"role": "tool", "content": "x", "tool_call_id": "c2"},
                ]
            },  # fmt: skip
            r"field 'messages\[2\].tool_call_id': tool_call_id 'c2' is none of the calls.*\['c1'\]",
        ),
    ],
)
def test_bad_tool_rows(tmp_path, row, match):
    tok = byte_tokenizer(**SPECIALS["qwen"])
    with pytest.raises(DataError, match=match):
        _encode(tmp_path, tok, [row], "qwen2_5")


def test_skip_bad_rows_counts_an_unplaceable_row(tmp_path):
    tok = byte_tokenizer(**SPECIALS["llama3"])
    bad = {"messages": [*LLAMA_CONVO[1:2], QWEN_CONVO[2]], "tools": [WEATHER]}
    good = {"messages": LLAMA_CONVO, "tools": [WEATHER], "date_string": "01 Jan 2025"}
    items = _encode(tmp_path, tok, [bad, good], "llama3_1", skip_bad_rows=True)
    assert len(items) == 1


# --- {% generation %}: the masks are transformers' assistant masks ------------------------------

QWEN2_5_GENERATION = (
    (TEMPLATES / "qwen2_5.jinja")
    .read_text()
    .replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
        '    {%- elif message.role == "assistant" %}',
        "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
        "{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
        "{%- endif %}\n"
        '    {%- elif message.role == "assistant" %}',
    )
    .replace(
        "        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}",
        "        {{- '<|im_start|>' + message.role }}{% generation %}\n        {%- if message.content %}",
    )
    .replace(
        "        {%- endfor %}\n        {{- '<|im_end|>\\n' }}",
        "        {%- endfor %}\n        {{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}",
    )
)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_generation_tags_match_transformers_assistant_masks(tmp_path, kind):
    assert QWEN2_5_GENERATION.count("{% generation %}") == 2
    messages = [{**m, "content": m["content"] or ""} for m in QWEN_CONVO]
    row = {"messages": messages, "tools": [WEATHER]}
    text = "".join(p for p, _ in marked_pieces(_qwen_expected("assistant")))
    tok = _tokenizer("qwen", kind, text)
    path = write_jsonl(tmp_path / "chat.jsonl", [row])
    s = DataSettings(datasets=[{"path": str(path)}], chat_template=QWEN2_5_GENERATION)
    item = build_train_dataset(s, tok, sequence_len=4096, seed=0)[0]
    ref = tok.apply_chat_template(
        messages,
        tools=[WEATHER],
        chat_template=QWEN2_5_GENERATION,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert item["input_ids"] == ref["input_ids"]
    want = [t if m else IGNORE_INDEX for t, m in zip(ref["input_ids"], ref["assistant_masks"])]
    assert item["labels"] == want
    assert sum(m for m in ref["assistant_masks"]) > 10


# --- role boundaries: <|eom_id|> ends a Llama assistant turn -----------------------------------


def test_llama_role_boundaries_end_a_tool_call_at_eom(tmp_path):
    template, family, row, expected = _case("llama3_1_builtin")
    tok = byte_tokenizer(**SPECIALS[family])
    item = _encode(tmp_path, tok, [row], template)[0]
    boundaries = family_boundaries("llama3_2_vision", tok)
    mask = MaskSettings(False, ("assistant",), "turn")
    assert labels_by_boundaries(item["input_ids"], boundaries, mask, set()) == item["labels"]


QWEN_BOUNDARIES = [
    {"role": "assistant", "start": "<|im_start|>assistant\n", "end": "<|im_end|>"},
    {"role": "user", "start": "<|im_start|>user\n", "end": "<|im_end|>"},
]


@pytest.mark.parametrize("train_on_tool_calls", [True, False])
def test_role_boundaries_follow_train_on_tool_calls(tmp_path, train_on_tool_calls):
    """Masks from role boundaries train what the template-placed masks train, with
    train_on_tool_calls off too (it trained the calling turns regardless)."""
    tok = byte_tokenizer(**SPECIALS["qwen"])
    row = {"messages": QWEN_CONVO, "tools": [WEATHER]}
    knobs = {"train_on_tool_calls": train_on_tool_calls}
    placed = _encode(tmp_path, tok, [row], "qwen2_5", **knobs)[0]
    by_bounds = _encode(tmp_path, tok, [row], "qwen2_5", role_boundaries=QWEN_BOUNDARIES, **knobs)
    assert by_bounds[0]["input_ids"] == placed["input_ids"]
    assert by_bounds[0]["labels"] == placed["labels"]
    calls = tok.decode([t for t in placed["labels"] if t != IGNORE_INDEX]).count("<tool_call>")
    assert calls == (2 if train_on_tool_calls else 0)


def test_role_boundaries_refuse_a_template_that_drops_tool_calls(tmp_path):
    """A template that writes no tool call would leave the calling turn empty, and role
    boundaries would train it: the row is refused, naming the message, as the
    template-placed masks refuse it."""
    tok = byte_tokenizer(**SPECIALS["qwen"])
    no_calls = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n"
        "{% endfor %}"
    )
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": QWEN_CONVO}])
    for extra in ({}, {"role_boundaries": QWEN_BOUNDARIES}):
        s = DataSettings(datasets=[{"path": str(path)}], chat_template=no_calls, **extra)
        with pytest.raises(DataError, match=r"messages\[2\].*does not render this message's tool"):
            build_train_dataset(s, tok, sequence_len=4096, seed=0)


# --- inspect-data -----------------------------------------------------------------------------


def test_inspect_shows_tool_calls_and_results(tmp_path):
    template, family, row, _ = _case("qwen2_5")
    tok = byte_tokenizer(**SPECIALS[family])
    path = write_jsonl(tmp_path / "chat.jsonl", [row])
    s = DataSettings(datasets=[{"path": str(path)}], chat_template=str(TEMPLATES / "qwen2_5.jinja"))
    out = render_inspection(s, tok, sequence_len=4096)
    assert "[2] assistant, calls get_weather, get_weather: trained" in out
    assert "[3] tool, tool result: masked" in out
    assert f"[[{qwen_call('Paris')}\n{qwen_call('Rome')}<|im_end|>]]" in out
    assert "train_on_tool_calls=True" in out
