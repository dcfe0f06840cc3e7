"""Tool calls in the form the chat template wants.

Rows carry a call's `arguments` as an object or as JSON text (the OpenAI API returns text), and a
calling message's content as null or as an empty string. Templates differ: Llama 3.x, Qwen2.5 and
Mistral write `arguments | tojson` (text would come out as an escaped JSON string), DeepSeek R1
and V3 write `'...' + arguments` (an object fails there) and write tool calls only for a null
content; Qwen3 takes either arguments but no null content. A template's form is found once, by
rendering a probe call each way; every row is then given to the template in that form.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_PROBE_NAME = "protrain_probe"
_PROBE_KEY = "protrain_probe_key"
_PROBE_ARGUMENTS = {_PROBE_KEY: "protrain probe value"}


class ArgumentsForm(enum.Enum):
    OBJECT = "object"  # a mapping (`arguments | tojson`, `arguments | items`)
    TEXT = "text"  # a JSON string (`'...' + arguments`)
    AS_GIVEN = "as given"  # the template takes either, or writes no tool calls


@dataclass(frozen=True)
class ToolCallForm:
    arguments: ArgumentsForm = ArgumentsForm.AS_GIVEN
    empty_content_as_null: bool = False  # calls are written only beside a null content


def _probe_messages(arguments: Any, content: str | None) -> list[dict[str, Any]]:
    call = {
        "type": "function",
        "id": "probe0001",  # Mistral wants 9 characters
        "function": {"name": _PROBE_NAME, "arguments": arguments},
    }
    return [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
    ]


def probe_tool_call_form(render: Callable[[list[dict[str, Any]]], str]) -> ToolCallForm:
    """The form in which `render` (a conversation -> text) writes a call, its arguments as JSON."""

    def rendered(arguments: Any, content: str | None) -> str | None:
        try:
            return render(_probe_messages(arguments, content))
        except Exception:  # the template refused this form
            return None

    def writes_json(text: str | None) -> bool:
        # JSON text passed to `tojson` comes out escaped; a mapping concatenated as a Python
        # dict comes out with single quotes.
        return (
            text is not None
            and _PROBE_KEY in text
            and f'\\"{_PROBE_KEY}\\"' not in text
            and f"'{_PROBE_KEY}'" not in text
        )

    texts = {
        (form, content): rendered(arguments, content)
        for form, arguments in (
            (ArgumentsForm.OBJECT, dict(_PROBE_ARGUMENTS)),
            (ArgumentsForm.TEXT, json.dumps(_PROBE_ARGUMENTS)),
        )
        for content in (None, "")
    }
    good = {form for (form, _), text in texts.items() if writes_json(text)}
    arguments = next(iter(good)) if len(good) == 1 else ArgumentsForm.AS_GIVEN

    def writes_call(content: str | None) -> bool:
        return any(
            text is not None and _PROBE_NAME in text
            for (_, c), text in texts.items()
            if c == content
        )

    return ToolCallForm(arguments, writes_call(None) and not writes_call(""))


def _converted(arguments: Any, form: ArgumentsForm) -> Any:
    if form is ArgumentsForm.OBJECT and isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # rows are checked when parsed; left for the template to refuse
    if form is ArgumentsForm.TEXT and isinstance(arguments, Mapping):
        return json.dumps(dict(arguments), ensure_ascii=False)  # as `tojson` writes it
    return arguments


def with_tool_call_form(messages: list[dict[str, Any]], form: ToolCallForm) -> list[dict[str, Any]]:
    """`messages` with every tool call in `form` (new dicts where changed)."""
    if form == ToolCallForm():
        return messages
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        new_calls = []
        for call in calls:
            nested = isinstance(call.get("function"), Mapping)
            fn = call["function"] if nested else call
            if "arguments" in fn:
                fn = {**fn, "arguments": _converted(fn["arguments"], form.arguments)}
            new_calls.append({**call, "function": fn} if nested else fn)
        message = {**message, "tool_calls": new_calls}
        if form.empty_content_as_null and message.get("content") == "":
            message["content"] = None
        out.append(message)
    return out


def check_arguments(arguments: Any) -> str | None:
    """Why `arguments` is neither a mapping nor JSON text of an object, or None if it is one."""
    if isinstance(arguments, Mapping):
        return None
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f"arguments {arguments!r} are not valid JSON ({e.msg} at {e.pos})"
        if isinstance(value, dict):
            return None
        return (
            f"arguments {arguments!r} are JSON text of a {type(value).__name__}, not of an object"
        )
    return f"arguments of type {type(arguments).__name__} ({arguments!r})"


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def drop_struct_fill(rows: list[dict[str, Any]]) -> int:
    """Arrow (Parquet, hub and saved datasets) stores a column of objects as one struct of every
    key seen in it: a call's arguments come back with the other calls' keys as null, a tool
    schema with the other schemas' keys. Those nulls are dropped, in place, from the arguments
    of every tool call and from the `tools` column (a genuine null cannot be told apart; JSON
    text keeps it). Returns how many calls and schemas changed."""
    changed = 0

    def clean(holder: dict[str, Any] | list[Any], key: Any) -> None:
        nonlocal changed
        value = holder[key]
        if isinstance(value, dict):
            cleaned = _without_nulls(value)
            if cleaned != value:
                holder[key] = cleaned
                changed += 1

    for row in rows:
        tools = row.get("tools")
        for k in range(len(tools) if isinstance(tools, list) else 0):
            clean(tools, k)
        for value in row.values():
            if not isinstance(value, list):
                continue
            for message in value:
                calls = message.get("tool_calls") if isinstance(message, dict) else None
                for call in calls if isinstance(calls, list) else ():
                    fn = call.get("function") if isinstance(call, dict) else None
                    fn = fn if isinstance(fn, dict) else call
                    if isinstance(fn, dict) and "arguments" in fn:
                        clean(fn, "arguments")
    return changed
