"""Rendering a chat with its template, and finding each message in the rendered text.

[Note: locating messages]
A chat template is not always prefix-stable: Mistral moves the system prompt and the tool list
to the last user turn, Qwen3 drops the `<think>` block of assistant turns before the last user
query, Phi-3.5 appends EOS when no generation prompt is asked for, Llama 3.1 folds the tool list
into the first user turn, DeepSeek concatenates every system message at the start. So the
conversation is rendered once, in full (`T`), and each message is placed in it from the
renderings of its prefixes, never from a search for its content alone:

- Message `i` owns the text from `b_i` to `b_{i+1}`, where `b_i` is where the rendering of
  `messages[:i]` ends inside `T`. Where that rendering is a prefix of `T`, `b_i` is exact.
  Otherwise it is placed by the last structural marker (special token) of the prefix, counted
  (the c-th `<|im_end|>` of the prefix is the c-th of `T`), or, where the prefix only appends a
  closer that `T` does not have there (an EOS, the `<|im_end|>` after a group of tool results),
  where the two texts part. Either placement must keep each message's content on its own side;
  where neither does, the row is a `TemplateMismatch`: a guessed mask is never made.
- An assistant turn's body starts where its generation prompt ends (what
  `add_generation_prompt=True` appends after `messages[:i]`, e.g. `<|im_start|>assistant\\n`),
  as far as `T` repeats it there (DeepSeek-R1 prompts with `<｜Assistant｜><think>\\n` but
  renders history as `<｜Assistant｜>` + answer). Templates without a header (Mistral) start the
  body right after the previous message. Reasoning and tool calls the template writes in the
  turn belong to the body.
- A turn ends at the last end-of-turn marker in its own text (`<|im_end|>`, `<|eot_id|>`,
  `<|eom_id|>`, `</s>`, ...); a turn without one ends where the next message begins.
- Cut points never fall inside a special token: `<|endoftext|>` and `<|assistant|>` share `<|`.

Content is still searched, inside the message's own text only, to check the placement and to
find where user, system and tool bodies start. Where a body's text occurs more than once in its
turn (the header's role word, a default system prompt, a tool list, a date may hold it), the
search starts where a rendering with a stand-in body stops agreeing with `T`: the body lies past
everything the template writes before it. System messages may be moved anywhere by the
template (Gemma folds them into the first user turn), so they are searched in the whole text.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2
import jinja2.meta

from protrain.train.data.errors import DataError
from protrain.train.data.tool_call_form import (
    ToolCallForm,
    probe_tool_call_form,
    with_tool_call_form,
)

logger = logging.getLogger("protrain.train.data")

# End-of-turn markers of the template families; only those in the tokenizer's vocabulary count.
# `<|eom_id|>` (Llama 3.x) and `<|eom|>` (Llama 4) end an assistant turn that calls a tool.
END_OF_TURN_CANDIDATES = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|eot|>",
    "<|eom|>",
    "<end_of_turn>",
    "<turn|>",
    "<|end|>",
    "<|endoftext|>",
    "</s>",
)

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Names a template sees that never come from a row.
_RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "raise_exception",
        "strftime_now",
        "range",
        "namespace",
        "loop",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    }
)


class TemplateRenderError(Exception):
    """The chat template refused a conversation (or failed on it)."""


class TemplateMismatch(Exception):
    """Message `index` cannot be placed in the rendering with certainty."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason

    def data_error(self, dataset: str, row: int) -> DataError:
        """The row's `DataError`, naming the message."""
        return DataError(
            f"{self.reason}; the loss mask cannot be placed",
            dataset=dataset,
            row=row,
            field=f"messages[{self.index}]",
        )


@dataclass(frozen=True)
class Turn:
    """Character positions of one message inside the rendered conversation."""

    role: str
    start: int  # first character of the turn's body (after its header)
    content_end: int  # end of the message content (== start when it has none)
    eot: tuple[int, int] | None  # the end-of-turn marker that closes it, if any
    begin: int = -1  # start of the message's own text (its header, if it has one)
    end: int = -1  # end of the message's own text (where the next message begins)
    tool_calls: tuple[str, ...] = ()  # names of the tools the message calls
    generated: tuple[tuple[int, int], ...] | None = None  # `{% generation %}` spans, if tagged

    @property
    def body_end(self) -> int:
        """Where the trained body stops: at the end-of-turn marker, else at the end of the
        assistant's own text (a tool call the template leaves unclosed), else at the content."""
        if self.eot is not None:
            return self.eot[0]
        if self.role == "assistant" and self.end >= self.start:
            return self.end
        return self.content_end


def end_of_turn_markers(tokenizer) -> tuple[str, ...]:
    """End-of-turn marker strings this tokenizer knows, EOS first."""
    vocab = tokenizer.get_vocab()
    markers = []
    eos = getattr(tokenizer, "eos_token", None)
    if eos:
        markers.append(eos)
    markers += [m for m in END_OF_TURN_CANDIDATES if m in vocab and m not in markers]
    return tuple(markers)


def special_token_strings(tokenizer) -> tuple[str, ...]:
    """The tokenizer's added tokens (the template's markup vocabulary), longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {str(getattr(t, "content", t)) for t in decoder.values()}
    found |= {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    return tuple(sorted((t for t in found if t.strip()), key=len, reverse=True))


def template_variables(template: str) -> frozenset[str]:
    """Top-level names the template reads (`tools`, `builtin_tools`, `date_string`, ...)."""
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(
            GENERATION_TAG.sub("", re.sub(r"\{%-?\s*endgeneration\s*-?%\}", "", template))
        )
    except jinja2.TemplateError:
        return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(ast)) - _RESERVED_TEMPLATE_NAMES


def _text_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content if p.get("type") == "text" and p.get("text")]


def _needles(message: dict[str, Any]) -> tuple[str, str]:
    """Text that marks the start and the end of a message's content once rendered."""
    parts = [p.strip() for p in _text_parts(message.get("content"))]
    parts = [p for p in parts if p]
    if not parts:
        return "", ""
    first, last = parts[0], parts[-1]
    if message["role"] == "assistant" and "</think>" in last:
        # Templates with reasoning render the answer after the think block, or drop the block.
        last = last.split("</think>")[-1].strip() or last
        if len(parts) == 1:
            first = last
    return first, last


# A body no template writes for itself and no tokenizer merges with what precedes it: where a
# rendering with it stops agreeing with the real one, the real body begins.
_STAND_IN = "\ue000protrain-stand-in\ue000"


def _with_stand_in(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with ``_STAND_IN`` for its first text (a list of parts keeps its other
    parts, so that a template that takes only lists renders it, and media stay in place)."""
    content = message.get("content")
    if not isinstance(content, list):
        return {**message, "content": _STAND_IN}
    parts = list(content)
    for j, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") == "text" and str(part.get("text")).strip():
            parts[j] = {**part, "text": _STAND_IN}
            break
    return {**message, "content": parts}


def _json_inner(text: str) -> str:
    """`text` as it appears inside a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _tool_call_names(message: dict[str, Any]) -> tuple[str, ...]:
    names = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return tuple(names)


def _lcp(a: str, b: str) -> int:
    """Length of the common prefix of `a` and `b` (slice compares run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class _Placement:
    """What `locate` needs about one conversation's renderings."""

    text: str
    prefixes: list[str | None] = field(default_factory=list)  # render(messages[:i])
    prompts: list[str | None] = field(default_factory=list)  # same, with the generation prompt
    messages: list[dict[str, Any]] = field(default_factory=list)
    kwargs: dict[str, Any] | None = None


class ChatRenderer:
    """Renders conversations with one template and locates their messages."""

    def __init__(
        self,
        renderer,
        template: str,
        eot_markers: tuple[str, ...],
        special_tokens: tuple[str, ...] = (),
    ) -> None:
        self.renderer = renderer  # a tokenizer or processor with apply_chat_template
        self.template = template
        self.eot_markers = eot_markers
        self.variables = template_variables(template)
        self.has_generation_tags = bool(GENERATION_TAG.search(template))
        specials = sorted(set(special_tokens) | set(eot_markers), key=len, reverse=True)
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in specials)) if specials else None
        )
        self._longest_special = max((len(s) for s in specials), default=0)
        self._warned_null_content = False
        self._tool_call_form: ToolCallForm | None = None
        self._warned_dropped_system = False

    # --- rendering ----------------------------------------------------------------------------

    @property
    def renders_with_tokenizer(self) -> bool:
        # the config check imports this module: transformers loads where a model is built
        from transformers import PreTrainedTokenizerBase

        return isinstance(self.renderer, PreTrainedTokenizerBase)

    def _render_once(
        self,
        messages: list[dict[str, Any]],
        kwargs: dict[str, Any],
        add_generation_prompt: bool,
        with_generation_spans: bool = False,
    ):
        # the config check imports this module: transformers loads where a model is built
        from transformers.utils.chat_template_utils import render_jinja_template

        # Rendered as `apply_chat_template` renders (tokenizers and processors alike: processors
        # take the same arguments, special tokens from their tokenizer), except that a null
        # content stays None, where `apply_chat_template` drops the key: templates branch on it
        # (DeepSeek writes tool calls only for `content is none`).
        source = self.renderer
        if not hasattr(source, "special_tokens_map"):  # a processor: its tokenizer's tokens
            source = source.tokenizer
        extra = dict(kwargs)
        tools = extra.pop("tools", None)
        documents = extra.pop("documents", None)
        rendered, spans = render_jinja_template(
            conversations=[messages],
            tools=tools,
            documents=documents,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=with_generation_spans,
            **{**source.special_tokens_map, **extra},
        )
        if with_generation_spans:
            return rendered[0], [tuple(s) for s in spans[0]]
        return rendered[0]

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        if not messages:
            return ""
        try:
            return self._render_once(messages, kwargs or {}, add_generation_prompt)
        except Exception as e:  # the template's raise_exception, or content it cannot join
            raise TemplateRenderError(
                f"cannot render with the chat template: {type(e).__name__}: {e}"
            ) from e

    def prepare(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """The messages as the template takes them, and their full rendering.

        Tool calls are given in the form the template wants (`tool_call_form.py`). A null
        content is given to the template as None; a template that cannot render it
        (Qwen3 tests `'</think>' in content`) gets an empty string instead, said once.
        """
        messages = with_tool_call_form(messages, self.tool_call_form)
        try:
            return messages, self.render(messages, kwargs=kwargs)
        except TemplateRenderError:
            if not any(m.get("content", "") is None for m in messages):
                raise
        emptied = [{**m, "content": ""} if m.get("content", "") is None else m for m in messages]
        text = self.render(emptied, kwargs=kwargs)
        if not self._warned_null_content:
            self._warned_null_content = True
            logger.warning(
                "the chat template cannot render a message whose content is null; such "
                "contents are rendered as empty strings"
            )
        return emptied, text

    def check_tool_calls_rendered(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None, text: str
    ) -> None:
        """Raise `TemplateMismatch` for the first message whose tool calls the template does
        not write: the conversation, `text`, renders the same without them. For masks from
        role boundaries, which never look at the messages: such a turn would be trained
        empty (the rendering's own placement checks this per turn, `_turn`)."""
        for i, message in enumerate(messages):
            names = _tool_call_names(message)
            if not names:
                continue
            bare = {k: v for k, v in message.items() if k != "tool_calls"}
            try:
                _, without = self.prepare([*messages[:i], bare, *messages[i + 1 :]], kwargs)
            except TemplateRenderError:
                continue  # it cannot render the message without them: they are written
            if without == text:
                raise TemplateMismatch(
                    i,
                    f"the chat template does not render this message's tool call(s) {list(names)}; "
                    "use a chat template with tool support",
                )

    @property
    def tool_call_form(self) -> ToolCallForm:
        """The form in which this template writes tool calls and their arguments (probed once)."""
        if self._tool_call_form is None:
            self._tool_call_form = probe_tool_call_form(
                lambda messages: self._render_once(messages, {}, add_generation_prompt=False)
            )
        return self._tool_call_form

    def generation_spans(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None = None
    ) -> list[tuple[int, int]]:
        """Character spans the template marks with `{% generation %}` (as transformers does)."""
        _, spans = self._render_once(
            messages, kwargs or {}, add_generation_prompt=False, with_generation_spans=True
        )
        return spans

    # --- cut points ---------------------------------------------------------------------------

    def _backoff(self, k: int, *texts: str) -> int:
        """`k`, moved back so that it does not fall inside a special token of any text."""
        if self._special_re is None or k <= 0:
            return k
        moved = True
        while moved and k > 0:
            moved = False
            for text in texts:
                lo = max(0, k - self._longest_special)
                for m in self._special_re.finditer(text, lo, k + self._longest_special):
                    if m.start() < k < m.end():
                        k, moved = m.start(), True
                        break
        return k

    def _common(self, a: str, b: str) -> int:
        return self._backoff(_lcp(a, b), a, b)

    def _starts_with_eot(self, text: str, at: int) -> bool:
        return any(text.startswith(m, at) for m in self.eot_markers)

    def _last_special(self, text: str) -> tuple[str, int] | None:
        """The last special token of `text` and how many times it occurs up to there."""
        if self._special_re is None:
            return None
        last = None
        for m in self._special_re.finditer(text):
            last = m
        if last is None:
            return None
        return last.group(), text.count(last.group(), 0, last.end())

    def _nth(self, text: str, marker: str, count: int) -> int:
        pos = -1
        for _ in range(count):
            pos = text.find(marker, pos + 1)
            if pos < 0:
                return -1
        return pos

    def _place_prefix(
        self,
        prefix: str,
        text: str,
        lo: int,
        hi: int,
        before: dict[str, Any],
        after: dict[str, Any] | None,
    ) -> int | None:
        """Where the rendering `prefix` of `messages[:i]` ends in `text`, or None if unsure.

        `lo` is the start of message i-1's text, `hi` the end of the conversation's text;
        `before` is message i-1 and `after` message i.
        """
        if text.startswith(prefix):
            return len(prefix)
        _, last_before = _needles(before)
        first_after = _needles(after)[0] if after is not None else ""

        def plausible(b: int) -> bool:
            if not lo <= b <= hi:
                return False
            if last_before:
                pos = text.find(last_before, lo)
                if pos >= 0 and pos + len(last_before) > b:
                    return False
            return not (
                first_after
                and after is not None
                and after["role"] != "system"
                and text.find(first_after) >= 0
                and text.find(first_after, b) < 0
            )

        # The prefix appends only closing markup that the conversation does not have here
        # (an EOS, the `<|im_end|>` after a group of tool results): its text ends where they part.
        k = self._common(prefix, text)
        closer = prefix[k:]
        closer_fits = (
            plausible(k)
            and not self._starts_with_eot(text, k)
            and not (last_before and last_before in closer)
        )
        if closer_fits and self._is_markup(closer):
            return k
        # Otherwise the template changed text before the prefix's end (a think block, a moved
        # system prompt or tool list): its last marker, counted, is the same marker in `text`.
        last = self._last_special(prefix)
        if last is not None:
            marker, count = last
            at_prefix = self._nth(prefix, marker, count)
            at_text = self._nth(text, marker, count)
            tail = prefix[at_prefix + len(marker) :]
            if at_text >= 0 and text.startswith(tail, at_text + len(marker)):
                b = at_text + len(marker) + len(tail)
                if plausible(b):
                    return b
        return k if closer_fits else None

    def _is_markup(self, text: str) -> bool:
        """Only special tokens and whitespace."""
        rest = self._special_re.sub("", text) if self._special_re is not None else text
        return not rest.strip()

    # --- locating -----------------------------------------------------------------------------

    def _renderings(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None, text: str
    ) -> _Placement:
        placement = _Placement(text, messages=messages, kwargs=kwargs)
        for i in range(len(messages) + 1):
            prefix = messages[:i]
            try:
                plain = self.render(prefix, kwargs=kwargs) if i < len(messages) else text
            except TemplateRenderError:
                plain = None
            prompted = None
            if i == len(messages) or messages[i]["role"] == "assistant":
                try:
                    prompted = self.render(prefix, add_generation_prompt=True, kwargs=kwargs)
                except TemplateRenderError:
                    prompted = None
            placement.prefixes.append(plain)
            placement.prompts.append(prompted)
        return placement

    def locate(
        self,
        messages: list[dict[str, Any]],
        text: str,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Turn]:
        """Each message's turn in `text`, the full rendering of `messages`."""
        n = len(messages)
        placed = self._renderings(messages, kwargs, text)

        # The conversation's own text ends where a generation prompt would be written; what a
        # template appends only at the very end (Phi-3.5's EOS) belongs to no message.
        closing = placed.prompts[n]
        conv_end = len(text)
        if closing is not None and not closing.startswith(text):
            conv_end = self._common(text, closing)

        bounds = [0]
        for i in range(1, n):
            prefix = placed.prefixes[i]
            b = None
            if prefix is not None:
                b = self._place_prefix(
                    prefix, text, bounds[-1], conv_end, messages[i - 1], messages[i]
                )
            if b is None:
                if messages[i - 1]["role"] == "system":
                    b = bounds[-1]  # the template placed the system prompt elsewhere
                else:
                    raise TemplateMismatch(
                        i,
                        "the chat template renders the conversation in a way this message's "
                        "start cannot be placed with certainty",
                    )
            bounds.append(b)
        bounds.append(max(conv_end, bounds[-1]))

        turns = []
        for i, message in enumerate(messages):
            turns.append(self._turn(i, message, text, bounds[i], bounds[i + 1], placed))
        return turns

    def _generation_header(self, i: int, placed: _Placement) -> str:
        prompted, plain = placed.prompts[i], placed.prefixes[i] if i else ""
        if prompted is None or plain is None:
            return ""
        return prompted[self._common(plain, prompted) :]

    def _turn(
        self, i: int, message: dict[str, Any], text: str, b: int, end: int, placed: _Placement
    ) -> Turn:
        role = message["role"]
        names = _tool_call_names(message)
        start = b
        if role == "assistant":
            header = self._generation_header(i, placed)
            start = b + self._backoff(_lcp(header, text[b:end]), header, text[b:end])
        content = self._find_content(i, message, text, start, end, placed)
        if names:
            missing = [name for name in names if name not in text[start:end]]
            if missing:
                why = (
                    "it writes tool calls only beside a null content (DeepSeek R1, V3): drop the "
                    "text or use another template"
                    if self.tool_call_form.empty_content_as_null
                    else "use a chat template with tool support"
                )
                raise TemplateMismatch(
                    i,
                    f"the chat template does not render this message's tool call(s) {missing}; {why}",
                )
        if role == "system" and content is not None and not b <= content[0] < end:
            # A system prompt the template moved: its body is its content, wherever it went.
            return Turn(role, content[0], content[1], None, content[0], content[1], names)
        if role != "assistant" and content is not None:
            start = content[0]  # user, system and tool bodies are their content
        content_end = content[1] if content is not None else start
        eot = self._last_eot(text, content_end, end)
        if role != "assistant" and content is None:
            start = content_end = eot[0] if eot else end  # an empty body, not the header
        return Turn(role, start, content_end, eot, b, end, names)

    def _find_content(
        self, i: int, message: dict[str, Any], text: str, start: int, end: int, placed: _Placement
    ) -> tuple[int, int] | None:
        """Where the message's content lies in its own text (system: anywhere), or None."""
        first, last = _needles(message)
        if not first:
            return None
        forms = [(first, last)]
        if message["role"] == "tool":
            # Tool results may be written as JSON strings (Llama 3.x: `content | tojson`).
            forms.append((_json_inner(first), _json_inner(last)))
        for k, (a, z) in enumerate(forms):
            pos = self._find_text(text, a, self._body_start(i, placed, a, start, end), end)
            stop = self._find_text(text, z, pos, end) if pos >= 0 else -1
            if stop >= 0:
                stop += len(z)
                if k and text[pos - 1 : pos] == text[stop : stop + 1] == '"':
                    pos, stop = pos - 1, stop + 1  # the whole JSON string
                return pos, stop
        if message["role"] == "system":  # moved by the template: anywhere in the text
            pos = self._find_text(
                text, first, self._body_start(i, placed, first, 0, len(text)), len(text)
            )
            stop = self._find_text(text, last, pos, len(text)) if pos >= 0 else -1
            if stop >= 0:
                return pos, stop + len(last)
            if not self._warned_dropped_system:
                # Mistral v3 writes the system prompt only when the conversation ends with a
                # user turn: a training row keeps the other messages, placed by their prefixes.
                self._warned_dropped_system = True
                logger.warning(
                    "the chat template does not write the system message of some conversations "
                    "(Mistral's writes it only into a final user turn); they are trained without it"
                )
            return None
        if message["role"] == "assistant" and _tool_call_names(message):
            return None  # templates may write only the tool calls (Llama 3.x, Mistral)
        raise TemplateMismatch(
            i, "the chat template does not render this message's content verbatim"
        )

    def _body_start(self, i: int, placed: _Placement, needle: str, lo: int, hi: int) -> int:
        """Where a user, system or tool body of message ``i`` may start in its turn
        ``[lo, hi)``. What the template writes before the body (its header's role word, a
        default system prompt, a tool list, a date) may hold the body's own words: where they
        occur twice, the conversation is rendered again with a stand-in for the body's first
        text, and the body lies where that rendering holds the stand-in, the two texts
        agreeing up to there. Where that rendering fails or disagrees earlier, past the
        header's role word when the first match starts inside it."""
        messages, text = placed.messages, placed.text
        message = messages[i] if i < len(messages) else None
        first = self._find_text(text, needle, lo, hi)
        if message is None or message["role"] == "assistant" or first < 0:
            return lo
        if self._find_text(text, needle, first + 1, hi) < 0:
            return lo  # one occurrence: it is the body
        stand_in = _with_stand_in(message)
        try:
            rendered = self.render(
                [*messages[:i], stand_in, *messages[i + 1 :]], kwargs=placed.kwargs
            )
        except TemplateRenderError:
            rendered = ""
        at = _lcp(text, rendered)
        agrees = lo <= at < hi and rendered.startswith(_STAND_IN, at)
        if agrees and self._find_text(text, needle, at, hi) >= 0:
            return at
        return self._past_role_word(text, message["role"], first, lo, hi)

    def _past_role_word(self, text: str, role: str, first: int, lo: int, hi: int) -> int:
        """Past the header's role word (ChatML's `<|im_start|>user`) where the body's first
        match ``first`` starts inside it ("user", "er"), else ``lo``."""
        word = text.find(role, lo, hi)
        if word < 0 or not word <= first < word + len(role):
            return lo
        return word + len(role)

    def _find_text(self, text: str, needle: str, lo: int, hi: int) -> int:
        """First occurrence of `needle` in `text[lo:hi]` that is not a piece of a special token
        (a system prompt "S" is not the S of `[INST]`)."""
        pos = text.find(needle, lo, hi)
        while pos >= 0 and self._special_re is not None:
            window = self._special_re.finditer(  # tokens that start before or end after it too
                text, max(0, pos - self._longest_special), pos + len(needle) + self._longest_special
            )
            if not any(
                m.start() < pos + len(needle) and pos < m.end() and m.group() not in needle
                for m in window
            ):
                break
            pos = text.find(needle, pos + 1, hi)
        return pos

    def _last_eot(self, text: str, lo: int, hi: int) -> tuple[int, int] | None:
        """The last end-of-turn marker in `text[lo:hi]`: the turn's own closer, even when the
        content or a tool call holds marker text."""
        eot = None
        if self._special_re is not None:
            for m in self._special_re.finditer(text, lo, hi):
                if m.group() in self.eot_markers:
                    eot = (m.start(), m.end())
        return eot

    def all_markers(self, text: str) -> list[tuple[int, int]]:
        found = []
        for marker in self.eot_markers:
            pos = text.find(marker)
            while pos >= 0:
                found.append((pos, pos + len(marker)))
                pos = text.find(marker, pos + len(marker))
        return sorted(found)


def with_generation_spans(turns: list[Turn], spans: list[tuple[int, int]]) -> list[Turn]:
    """Assistant turns with the `{% generation %}` spans that fall in their own text."""
    out = []
    for turn in turns:
        if turn.role == "assistant":
            mine = tuple((a, b) for a, b in spans if turn.begin <= a < turn.end and b > a)
            turn = replace(turn, generated=mine)
        out.append(turn)
    return out
