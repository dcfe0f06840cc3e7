"""Tool-call arguments in the form the chat template wants.

Rows carry a call's `arguments` as an object or as JSON text (the OpenAI API returns text).
Templates differ: Llama 3.x, Qwen2.5 and Mistral write `arguments | tojson` (text would come out
as an escaped JSON string), DeepSeek R1 and V3 write `'...' + arguments` (an object fails there),
Qwen3 takes either. A template's form is found once, by rendering a probe call both ways and
keeping the form whose arguments come out as JSON; each row's arguments are then converted to it.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from typing import Any

_PROBE_KEY = "protrain_probe_key"
_PROBE_ARGUMENTS = {_PROBE_KEY: "protrain probe value"}


class ArgumentsForm(enum.Enum):
    OBJECT = "object"  # a mapping (`arguments | tojson`, `arguments | items`)
    TEXT = "text"  # a JSON string (`'...' + arguments`)
    AS_GIVEN = "as given"  # the template takes either, or writes no tool calls


def _probe_messages(arguments: Any, content: str | None) -> list[dict[str, Any]]:
    call = {
        "type": "function",
        "id": "probe0001",  # Mistral wants 9 characters
        "function": {"name": "protrain_probe", "arguments": arguments},
    }
    return [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
    ]


def probe_arguments_form(render: Callable[[list[dict[str, Any]]], str]) -> ArgumentsForm:
    """The form of `arguments` that `render` (a conversation -> text) writes as JSON."""

    def writes_json(arguments: Any) -> bool:
        for content in (None, ""):  # R1 writes calls only for a null content; Qwen3 needs a string
            try:
                text = render(_probe_messages(arguments, content))
            except Exception:  # the template refused this form
                continue
            # JSON text passed to `tojson` comes out escaped; a mapping concatenated as a
            # Python dict comes out with single quotes.
            return (
                _PROBE_KEY in text
                and f'\\"{_PROBE_KEY}\\"' not in text
                and f"'{_PROBE_KEY}'" not in text
            )
        return False

    as_object = writes_json(dict(_PROBE_ARGUMENTS))
    as_text = writes_json(json.dumps(_PROBE_ARGUMENTS))
    if as_object and not as_text:
        return ArgumentsForm.OBJECT
    if as_text and not as_object:
        return ArgumentsForm.TEXT
    return ArgumentsForm.AS_GIVEN


def _converted(arguments: Any, form: ArgumentsForm) -> Any:
    if form is ArgumentsForm.OBJECT and isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # rows are checked when parsed; left for the template to refuse
    if form is ArgumentsForm.TEXT and isinstance(arguments, Mapping):
        return json.dumps(dict(arguments), ensure_ascii=False)  # as `tojson` writes it
    return arguments


def with_arguments_form(
    messages: list[dict[str, Any]], form: ArgumentsForm
) -> list[dict[str, Any]]:
    """`messages` with every tool call's `arguments` in `form` (new dicts where changed)."""
    if form is ArgumentsForm.AS_GIVEN:
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
                fn = {**fn, "arguments": _converted(fn["arguments"], form)}
            new_calls.append({**call, "function": fn} if nested else fn)
        out.append({**message, "tool_calls": new_calls})
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
