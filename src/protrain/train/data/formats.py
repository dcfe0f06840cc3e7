"""Row formats: turn a raw row into a `ChatSample`, `CompletionSample` or `TextSample`.

- `chat`: `messages` (role, content), or the legacy `conversations` (from, value).
  Content may be a string or a list of parts (`{"type": "text", "text": ...}`,
  `{"type": "image", ...}`, `{"type": "audio", ...}`); an assistant message may carry `reasoning_content`.
  Tool calling, in the OpenAI / transformers shape: an assistant message's `tool_calls`
  (`[{"type": "function", "function": {"name": ..., "arguments": ...}}]`, `arguments` an object
  or JSON text of one, converted to what the template wants: `tool_call_form.py`) with `content`
  null, empty or text; results as `tool` (or `ipython`, `function`) messages with `tool_call_id` /
  `name`. Every other key of a message (`id`, `prefix`, ...) reaches the template as it is, and so does every
  column of the row that the template reads: `tools` (a list of schemas, or its JSON text),
  `builtin_tools`, `date_string`, `documents`, `enable_thinking`, ...
- `completion`: `prompt` and `completion` (and an optional `system`).
- `text`: `text`, trained on every token.

Every check names the dataset, the row and the field, so a bad row is one clear `DataError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from protrain.train.data.config import DEFAULT_ROLE_MAP, DatasetConfig
from protrain.train.data.errors import DataError
from protrain.train.data.tool_call_form import check_arguments

MEDIA_PART_TYPES = ("image", "video", "audio")
_EXAMPLE_ARGUMENTS = '{"city": "Paris"}'


@dataclass
class ChatSample:
    messages: list[dict[str, Any]]  # role in KNOWN_ROLES, content str, list of parts or None
    images: list[Any] = field(default_factory=list)
    audios: list[Any] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # `tools`, ... for the template


@dataclass
class CompletionSample:
    prompt: str
    completion: str
    system: str | None = None


@dataclass
class TextSample:
    text: str


Sample = ChatSample | CompletionSample | TextSample


def _message_keys(cfg: DatasetConfig, column: str) -> tuple[str, str]:
    legacy = column == "conversations"
    role_key = cfg.message_field_role or ("from" if legacy else "role")
    content_key = cfg.message_field_content or ("value" if legacy else "content")
    return role_key, content_key


def _check_content(content: Any, dataset: str, row: int, where: str) -> Any:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or "type" not in part:
                raise DataError(
                    "content parts must be objects with a 'type'",
                    dataset=dataset,
                    row=row,
                    field=f"{where}[{j}]",
                )
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise DataError(
                    "a text part needs a string 'text'",
                    dataset=dataset,
                    row=row,
                    field=f"{where}[{j}]",
                )
            if part["type"] not in ("text", *MEDIA_PART_TYPES):
                raise DataError(
                    f"unknown content part type {part['type']!r}; allowed: text, {', '.join(MEDIA_PART_TYPES)}",
                    dataset=dataset,
                    row=row,
                    field=f"{where}[{j}]",
                )
        return content
    raise DataError(
        f"content must be a string or a list of parts, got {type(content).__name__}",
        dataset=dataset,
        row=row,
        field=where,
    )


def _check_tool_calls(calls: Any, dataset: str, row: int, where: str) -> list[Any]:
    if not isinstance(calls, list):
        raise DataError(
            f"must be a list of tool calls, got {type(calls).__name__}",
            dataset=dataset,
            row=row,
            field=where,
        )
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(
                'a tool call must be an object {"type": "function", "function": {"name": ..., '
                '"arguments": ...}} (or {"name": ..., "arguments": ...}) with a non-empty name',
                dataset=dataset,
                row=row,
                field=f"{where}[{j}]",
            )
        problem = check_arguments(fn["arguments"]) if "arguments" in fn else "no arguments"
        if problem is not None:
            raise DataError(
                f"{problem}; a tool call's arguments must be an object, e.g. "
                f"{_EXAMPLE_ARGUMENTS}, or JSON text of one, e.g. {json.dumps(_EXAMPLE_ARGUMENTS)} "
                "({} for none)",
                dataset=dataset,
                row=row,
                field=f"{where}[{j}]" + (".function" if fn is not call else "") + ".arguments",
            )
    return calls


def _template_kwargs(
    row: dict[str, Any], template_vars: frozenset[str], skip: set[str], dataset: str, row_index: int
) -> dict[str, Any]:
    """The row's columns that the chat template reads, `tools` checked."""
    kwargs = {k: row[k] for k in sorted(template_vars) if k in row and k not in skip}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    tools = kwargs.get("tools")
    if isinstance(tools, str):  # datasets often keep the schemas as JSON text
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(
                f"a string here must be a JSON list of tool schemas: {e}",
                dataset=dataset,
                row=row_index,
                field="tools",
            ) from e
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise DataError(
                "must be a list of tool schemas (objects such as "
                '{"type": "function", "function": {"name": ..., "parameters": ...}})',
                dataset=dataset,
                row=row_index,
                field="tools",
            )
        kwargs["tools"] = tools or None
    return kwargs


def parse_chat(
    row: dict[str, Any],
    cfg: DatasetConfig,
    row_index: int,
    template_vars: frozenset[str] = frozenset({"tools"}),
    text_only: bool = False,
) -> ChatSample:
    """A chat row; `template_vars` are the names the chat template reads (row columns of those
    names are passed to it). `text_only`: for a model without a processor, see
    `_text_content`; media columns are refused."""
    dataset = cfg.path
    if cfg.field_messages is not None:
        column = cfg.field_messages
        if column not in row:
            raise DataError(
                f"missing; the row has {sorted(row)}", dataset=dataset, row=row_index, field=column
            )
    elif "messages" in row:
        column = "messages"
    elif "conversations" in row:
        column = "conversations"
    else:
        raise DataError(
            f"a chat row needs 'messages' or 'conversations'; the row has {sorted(row)}",
            dataset=dataset,
            row=row_index,
            field="messages",
        )
    turns = row[column]
    if not isinstance(turns, list):
        raise DataError(
            f"must be a list of messages, got {type(turns).__name__}",
            dataset=dataset,
            row=row_index,
            field=column,
        )
    if not turns:
        raise DataError("empty conversation", dataset=dataset, row=row_index, field=column)
    role_key, content_key = _message_keys(cfg, column)
    role_map = {**DEFAULT_ROLE_MAP, **(cfg.roles or {})}
    messages = []
    for i, turn in enumerate(turns):
        where = f"{column}[{i}]"
        if not isinstance(turn, dict):
            raise DataError(
                "a message must be an object", dataset=dataset, row=row_index, field=where
            )
        if role_key not in turn:
            raise DataError(
                f"missing role key {role_key!r}", dataset=dataset, row=row_index, field=where
            )
        calls = turn.get("tool_calls")
        if content_key not in turn and not calls:
            raise DataError(
                f"missing content key {content_key!r}", dataset=dataset, row=row_index, field=where
            )
        raw_role = turn[role_key]
        role = role_map.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise DataError(
                f"unknown role {raw_role!r}; known: {sorted(role_map)} (map others with `roles:`)",
                dataset=dataset,
                row=row_index,
                field=f"{where}.{role_key}",
            )
        content = turn.get(content_key)
        if content is None and role == "assistant" and not calls:
            content = ""
        if content is not None or role != "assistant":
            content = _check_content(content, dataset, row_index, f"{where}.{content_key}")
        if text_only and isinstance(content, list):
            content = _text_content(content, dataset, row_index, f"{where}.{content_key}")
        # A null content stays None beside tool calls: templates branch on it.
        message: dict[str, Any] = {"role": role, "content": content}
        if calls:
            if role != "assistant":
                raise DataError(
                    f"only assistant messages make tool calls, this one is {role!r}",
                    dataset=dataset,
                    row=row_index,
                    field=f"{where}.tool_calls",
                )
            message["tool_calls"] = _check_tool_calls(
                calls, dataset, row_index, f"{where}.tool_calls"
            )
        reasoning = turn.get(cfg.message_field_reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        # Other keys reach the template as they are; Arrow rows carry None (and empty lists)
        # for keys a message lacks, which templates would take for present.
        taken = {role_key, content_key, cfg.message_field_reasoning, "tool_calls"}
        for key, value in turn.items():
            if key not in taken and value is not None and value != []:
                message[key] = value
        messages.append(message)
    if not any(m["role"] != "system" for m in messages):
        raise DataError(
            "conversation has no user or assistant message",
            dataset=dataset,
            row=row_index,
            field=column,
        )
    images = row.get(cfg.field_images) or []
    if not isinstance(images, list):
        images = [images]
    audios = row.get(cfg.field_audios) or []
    if not isinstance(audios, list):
        audios = [audios]
    for key, media in ((cfg.field_images, images), (cfg.field_audios, audios)):
        if text_only and media:
            raise DataError(
                f"{len(media)} item(s) here, but the model reads text only (it has no "
                "processor) and would train on the text around media it never sees; allowed "
                "for it: rows without media, or use a vision-language model",
                dataset=dataset,
                row=row_index,
                field=key,
            )
    skip = {column, cfg.field_images, cfg.field_audios}
    kwargs = _template_kwargs(row, template_vars, skip, dataset, row_index)
    _check_tool_turns(messages, dataset, row_index, column)
    return ChatSample(messages=messages, images=images, audios=audios, template_kwargs=kwargs)


def _check_tool_turns(messages: list[dict[str, Any]], dataset: str, row: int, column: str) -> None:
    """Tool results answer calls: none before the first assistant message, and after an
    assistant message with structured `tool_calls`, at most one result a call, each
    `tool_call_id` one of those calls' ids. Results after an assistant message without
    structured calls are taken as they are: datasets write calls as text too (Hermes,
    Llama's `<|python_tag|>`). A call's name is not checked against `tools`: templates
    declare tools elsewhere too (Llama 3.1's `builtin_tools`)."""
    answered: tuple[set[str], int] | None = None  # the last calls' ids, results left
    seen_assistant = False
    for i, m in enumerate(messages):
        where = f"{column}[{i}]"
        if m["role"] == "assistant":
            seen_assistant = True
            calls = m.get("tool_calls") or []
            ids = {c["id"] for c in calls if isinstance(c.get("id"), str)}
            answered = (ids if len(ids) == len(calls) else set(), len(calls)) if calls else None
        elif m["role"] == "tool":
            if not seen_assistant:
                raise DataError(
                    "a tool result before any assistant message: it answers no call",
                    dataset=dataset,
                    row=row,
                    field=where,
                )
            if answered is None:
                continue
            ids, left = answered
            if left == 0:
                raise DataError(
                    "more tool results than the calls of the assistant message before them",
                    dataset=dataset,
                    row=row,
                    field=where,
                )
            call_id = m.get("tool_call_id")
            if ids and call_id is not None and call_id not in ids:
                raise DataError(
                    f"tool_call_id {call_id!r} is none of the calls of the assistant message "
                    f"before it; their ids: {sorted(ids)}",
                    dataset=dataset,
                    row=row,
                    field=f"{where}.tool_call_id",
                )
            answered = (ids, left - 1)
        else:
            answered = None


def _text_content(parts: list[dict[str, Any]], dataset: str, row: int, where: str) -> str:
    """A content of parts for a text-only model: its text parts joined without a separator,
    as the chat templates that take parts write them (a template without that support
    would write the list's Python repr). A media part is refused: the model has no
    processor to read it."""
    for j, part in enumerate(parts):
        if part["type"] != "text":
            raise DataError(
                f"{_article(part['type'])} {part['type']} part, but the model reads text only "
                "(it has no processor); "
                "allowed for it: text parts, or use a vision-language model",
                dataset=dataset,
                row=row,
                field=f"{where}[{j}]",
            )
    return "".join(part["text"] for part in parts)


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _string_field(row: dict[str, Any], key: str, cfg: DatasetConfig, row_index: int) -> str:
    if key not in row:
        raise DataError(
            f"missing; the row has {sorted(row)}", dataset=cfg.path, row=row_index, field=key
        )
    value = row[key]
    if not isinstance(value, str):
        raise DataError(
            f"must be a string, got {type(value).__name__}",
            dataset=cfg.path,
            row=row_index,
            field=key,
        )
    return value


def parse_row(
    row: dict[str, Any],
    cfg: DatasetConfig,
    row_index: int,
    template_vars: frozenset[str] = frozenset({"tools"}),
    text_only: bool = False,
) -> Sample:
    """Parse one raw row in the format `cfg.type` names; raises `DataError` on a bad row.
    `text_only`: the model has no processor (see `parse_chat`)."""
    if cfg.type == "chat":
        return parse_chat(row, cfg, row_index, template_vars, text_only)
    if cfg.type == "completion":
        system = row.get(cfg.field_system)
        return CompletionSample(
            prompt=_string_field(row, cfg.field_prompt, cfg, row_index),
            completion=_string_field(row, cfg.field_completion, cfg, row_index),
            system=system if isinstance(system, str) and system else None,
        )
    return TextSample(text=_string_field(row, cfg.field_text, cfg, row_index))
