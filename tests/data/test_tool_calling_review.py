"""Tool conversations written apart from `test_tool_calling.py`, as a reviewer would check them:
each expected text is what the official template (fixtures in `templates/`) renders, trained
text between ⟦ and ⟧ as a reading of the template says the model generates it, compared token by
token with a byte tokenizer and a BPE. Arguments come as objects and as JSON text, calling turns
with text, null, empty or no content; results repeat calls or hold the template's markup."""

from __future__ import annotations

import json

import pytest

from .helpers import expected_labels, marked_pieces
from .test_tool_calling import (
    LLAMA_TOOLS,
    QWEN_TOOLS,
    WEATHER,
    _encode,
    _tokenizer,
    call,
    llama_answer,
    llama_turn,
    qwen_answer,
    qwen_turn,
)

OSLO = '{"city": "Oslo"}'


def qwen_call(args: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'


# Qwen: text before the calls, a result that is the call itself, a result and an answer that are
# the template's markup, parallel calls without a content key.
QWEN = [
    {"role": "user", "content": "Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [call("get_weather", OSLO)]},
    {"role": "tool", "content": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
    {"role": "assistant", "content": "<tool_call>"},
    {"role": "user", "content": "again"},
    {
        "role": "assistant",
        "tool_calls": [call("get_weather", {"city": "Bergen"}), call("get_weather", OSLO)],
    },
    {"role": "tool", "content": "<tool_response>"},
    {"role": "tool", "content": "snow"},
    {"role": "assistant", "content": "user"},
]


def _qwen(system: str, last: str) -> str:
    return (
        f"<|im_start|>system\n{system}{QWEN_TOOLS}"
        + qwen_turn("user", "Oslo?")
        + qwen_answer("Checking.\n" + qwen_call(OSLO))
        + qwen_turn("user", f"<tool_response>\n{qwen_call(OSLO)[12:-13]}\n</tool_response>")
        + qwen_answer("<tool_call>")
        + qwen_turn("user", "again")
        + qwen_answer(qwen_call('{"city": "Bergen"}') + "\n" + qwen_call(OSLO))
        + qwen_turn(
            "user",
            "<tool_response>\n<tool_response>\n</tool_response>\n<tool_response>\nsnow\n"
            "</tool_response>",
        )
        + qwen_answer(last)
    )


# Qwen3, reasoning on the call after the last query: kept in the turn and trained with it.
QWEN3_REASONING = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "need data",
        "tool_calls": [call("get_weather", {"city": "Oslo"})],
    },
    {"role": "tool", "content": "snow"},
    {"role": "assistant", "content": "<think>cold</think>\n\nSnow."},
]
QWEN3_REASONING_EXPECTED = (
    f"<|im_start|>system\nsys\n\n{QWEN_TOOLS}"
    + qwen_turn("user", "Oslo?")
    + qwen_answer("<think>\nneed data\n</think>\n\n" + qwen_call(OSLO))
    + qwen_turn("user", "<tool_response>\nsnow\n</tool_response>")
    + qwen_answer("<think>\ncold\n</think>\n\nSnow.")
)

# Llama 3.1 with built-in tools: every call turn ends with <|eom_id|>, JSON calls included; a
# JSON result that repeats the call is written as a JSON string; an answer that is a role name.
LLAMA = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Oslo, then news"},
    {"role": "assistant", "tool_calls": [call("get_weather", OSLO)]},
    {"role": "ipython", "content": '{"name": "get_weather", "parameters": {"city": "Oslo"}}'},
    {"role": "assistant", "content": "", "tool_calls": [call("brave_search", {"query": "news"})]},
    {"role": "tool", "content": "<|eom_id|>"},
    {"role": "assistant", "content": "ipython"},
]
LLAMA_EXPECTED = (
    "<|begin_of_text|>"
    + llama_turn(
        "system",
        "Environment: ipython\nTools: brave_search, wolfram_alpha\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 03 Mar 2025\n\nYou help.",
    )
    + llama_turn("user", LLAMA_TOOLS + "Oslo, then news")
    + llama_answer('{"name": "get_weather", "parameters": {"city": "Oslo"}}', end="<|eom_id|>")
    + llama_turn("ipython", json.dumps('{"name": "get_weather", "parameters": {"city": "Oslo"}}'))
    + llama_answer('<|python_tag|>brave_search.call(query="news")', end="<|eom_id|>")
    + llama_turn("ipython", '"<|eom_id|>"')
    + llama_answer("ipython")
)

# Mistral Nemo ending on a user turn: the system prompt and the tool list go into it.
NEMO = [
    {"role": "system", "content": "Short answers."},
    {"role": "user", "content": "Oslo?"},
    {"role": "assistant", "tool_calls": [call("get_weather", OSLO, "a1b2c3d4e")]},
    {
        "role": "tool",
        "content": '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        "tool_call_id": "a1b2c3d4e",
    },
    {"role": "assistant", "content": "[TOOL_CALLS]"},
    {"role": "user", "content": "thanks"},
]
NEMO_EXPECTED = (
    "<s>[INST]Oslo?[/INST]"
    '⟦[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]</s>⟧'
    '[TOOL_RESULTS]{"content": {"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '"call_id": "a1b2c3d4e"}[/TOOL_RESULTS]⟦[TOOL_CALLS]</s>⟧'
    "[AVAILABLE_TOOLS][" + json.dumps(WEATHER) + "][/AVAILABLE_TOOLS][INST]Short answers.\n\n"
    "thanks[/INST]"
)

# DeepSeek V3.1: text before the calls; after tool results the answer follows without a header.
V3_1 = [
    {"role": "user", "content": "Oslo?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", OSLO)]},
    {"role": "tool", "content": "Let me check."},
    {"role": "assistant", "content": "<think>cold</think>Cold."},
    {"role": "user", "content": "More"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [call("get_weather", {"city": "Bergen"}), call("get_weather", OSLO)],
    },
    {"role": "tool", "content": "rain"},
    {"role": "tool", "content": "snow"},
    {"role": "assistant", "content": "</think>"},
]


def v3_1_calls(*cities: str) -> str:
    calls = "".join(
        f'<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{{"city": "{c}"}}<｜tool▁call▁end｜>'
        for c in cities
    )
    return f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"


V3_1_EXPECTED = (
    "<｜begin▁of▁sentence｜><｜User｜>Oslo?<｜Assistant｜><think></think>"
    "⟦Let me check." + v3_1_calls("Oslo") + "⟧"
    "<｜tool▁output▁begin｜>Let me check.<｜tool▁output▁end｜>"
    "⟦<think>cold</think>Cold.<｜end▁of▁sentence｜>⟧"
    "<｜User｜>More<｜Assistant｜><think></think>⟦" + v3_1_calls("Bergen", "Oslo") + "⟧"
    "<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜><｜tool▁output▁begin｜>snow<｜tool▁output▁end｜>"
    "⟦</think><｜end▁of▁sentence｜>⟧"
)

# DeepSeek R1 writes calls only beside a null content: an empty content is given as null, and
# object arguments as JSON text.
R1 = [
    {"role": "user", "content": "Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
    {"role": "tool", "content": "```json"},
    {"role": "assistant", "content": "<think>cold</think>Cold."},
]
R1_EXPECTED = (
    "<｜begin▁of▁sentence｜><｜User｜>Oslo?<｜Assistant｜>"
    "⟦<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    f"```json\n{OSLO}\n```<｜tool▁call▁end｜>⟧"
    "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>```json<｜tool▁output▁end｜>"
    "<｜tool▁outputs▁end｜>⟦<think>cold</think>Cold.<｜end▁of▁sentence｜>⟧"
)

BUILTIN = ["brave_search", "wolfram_alpha"]
REVIEW = {
    "qwen2_5": (
        "qwen2_5",
        "qwen",
        {"messages": QWEN, "tools": [WEATHER]},
        {},
        _qwen("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n", "user"),
    ),
    "qwen3": (
        "qwen3",
        "qwen",
        {"messages": QWEN, "tools": [WEATHER]},
        {},
        _qwen("", "<think>\n\n</think>\n\nuser"),
    ),
    "qwen3_reasoning": (
        "qwen3",
        "qwen",
        {"messages": QWEN3_REASONING, "tools": [WEATHER]},
        {},
        QWEN3_REASONING_EXPECTED,
    ),
    "llama3_1_builtin_and_json": (
        "llama3_1",
        "llama3",
        {"messages": LLAMA, "tools": [WEATHER], "builtin_tools": BUILTIN},
        {"chat_template_kwargs": {"date_string": "03 Mar 2025"}},
        LLAMA_EXPECTED,
    ),
    "mistral_nemo": ("mistral_nemo", "mistral", {"messages": NEMO, "tools": [WEATHER]}, {}, None),
    "deepseek_v3_1": ("deepseek_v3_1", "deepseek", {"messages": V3_1}, {}, V3_1_EXPECTED),
    "deepseek_r1": ("deepseek_r1", "deepseek", {"messages": R1}, {}, R1_EXPECTED),
}
EXPECTED = {"mistral_nemo": NEMO_EXPECTED}


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
@pytest.mark.parametrize("case", sorted(REVIEW))
def test_reviewed_tool_conversation_trained_spans(tmp_path, case, kind):
    template, family, row, settings, expected = REVIEW[case]
    pieces = marked_pieces(expected or EXPECTED[case])
    tok = _tokenizer(family, kind, "".join(p for p, _ in pieces))
    item = _encode(tmp_path, tok, [row], template, **settings)[0]
    text, ids, labels = expected_labels(tok, pieces)
    assert item["input_ids"] == tok(text, add_special_tokens=False)["input_ids"] == ids
    assert item["labels"] == labels
