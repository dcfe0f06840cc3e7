"""Rendering a chat with its template, and finding each turn in the rendered text.

[Note: locating turns]
A chat template is not always prefix-stable: Mistral moves the system prompt into the last
user turn, Qwen3 drops the `<think>` block of assistant turns before the last user query,
Gemma folds the system prompt into the first user turn. So the text of a conversation is
rendered once, in full, and each message is found in it by its content, in order. An
assistant turn starts where its generation header ends (the text that
`add_generation_prompt=True` appends after the conversation so far, e.g.
`<|im_start|>assistant\\n`), so that reasoning blocks the template places before the content
belong to the turn; with templates that have no header (Mistral: `[/INST]` closes the user
turn and opens the answer) the turn starts at its content. A turn ends at the first
end-of-turn marker after its content (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, `</s>`...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# End-of-turn markers of the template families; only those in the tokenizer's vocabulary count.
END_OF_TURN_CANDIDATES = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eot|>",
    "<end_of_turn>",
    "<turn|>",
    "<|end|>",
    "<|endoftext|>",
    "</s>",
)


class TemplateRenderError(Exception):
    """The chat template refused a conversation (or failed on it)."""


class TemplateMismatch(Exception):
    """The template does not render message `index` verbatim, so it cannot be located."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason


@dataclass(frozen=True)
class Turn:
    """Character positions of one message inside the rendered conversation."""

    role: str
    start: int  # first character of the turn's body (after its header)
    content_end: int  # end of the message content
    eot: tuple[int, int] | None  # the end-of-turn marker that closes it, if any


def end_of_turn_markers(tokenizer) -> tuple[str, ...]:
    """End-of-turn marker strings this tokenizer knows, EOS first."""
    vocab = tokenizer.get_vocab()
    markers = []
    eos = getattr(tokenizer, "eos_token", None)
    if eos:
        markers.append(eos)
    markers += [m for m in END_OF_TURN_CANDIDATES if m in vocab and m not in markers]
    return tuple(markers)


def _text_parts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content if p.get("type") == "text" and p.get("text")]


def _needles(message: dict[str, Any]) -> tuple[str, str]:
    """Text that marks the start and the end of a message's content once rendered."""
    parts = [p.strip() for p in _text_parts(message["content"])]
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


class ChatRenderer:
    """Renders conversations with one template and locates their turns."""

    def __init__(self, renderer, template: str, eot_markers: tuple[str, ...]) -> None:
        self.renderer = renderer  # a tokenizer or processor with apply_chat_template
        self.template = template
        self.eot_markers = eot_markers

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        try:
            return self.renderer.apply_chat_template(
                messages,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # the template's raise_exception, or content it cannot join
            raise TemplateRenderError(
                f"cannot render with the chat template: {type(e).__name__}: {e}"
            ) from e

    def generation_header(self, messages: list[dict[str, Any]]) -> str:
        """What `add_generation_prompt` adds after `messages` ("" if it adds nothing)."""
        if not messages:
            return ""
        try:
            plain = self.render(messages)
            prompted = self.render(messages, add_generation_prompt=True)
        except Exception:  # a template may refuse a prefix (e.g. one ending with a system turn)
            return ""
        return prompted[len(plain) :] if prompted.startswith(plain) else ""

    def _first_marker(self, text: str, lo: int, hi: int) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        for marker in self.eot_markers:
            pos = text.find(marker, lo, hi)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, pos + len(marker))
        return best

    def all_markers(self, text: str) -> list[tuple[int, int]]:
        found = []
        for marker in self.eot_markers:
            pos = text.find(marker)
            while pos >= 0:
                found.append((pos, pos + len(marker)))
                pos = text.find(marker, pos + len(marker))
        return sorted(found)

    def locate(self, messages: list[dict[str, Any]], text: str) -> list[Turn]:
        """Each message's turn in `text`, the full rendering of `messages`."""
        headers = [
            self.generation_header(messages[:i]) if m["role"] == "assistant" else ""
            for i, m in enumerate(messages)
        ]
        content_spans: list[tuple[int, int]] = []
        cursor = 0
        for i, message in enumerate(messages):
            first, last = _needles(message)
            lo = 0 if message["role"] == "system" else cursor
            if not first:
                # An empty message sits right after its header (if the template has one).
                pos = text.find(headers[i], lo) if headers[i] else -1
                at = pos + len(headers[i]) if pos >= 0 else lo
                content_spans.append((at, at))
                if message["role"] != "system":
                    cursor = at
                continue
            if headers[i]:
                # Look for the content after the turn's header, so that content that also
                # occurs in the header (an answer "assistant") is not taken for it.
                at = text.find(headers[i], lo)
                if at >= 0 and text.find(first, at + len(headers[i])) >= 0:
                    lo = at + len(headers[i])
            start = text.find(first, lo)
            if start < 0:
                raise TemplateMismatch(
                    i, "the chat template does not render this message's content verbatim"
                )
            end_at = text.find(last, start)
            if end_at < 0:
                raise TemplateMismatch(
                    i, "the end of this message's content is not in the rendering"
                )
            content_spans.append((start, end_at + len(last)))
            if message["role"] != "system":
                cursor = end_at + len(last)

        turns = []
        prev_end = 0
        for i, message in enumerate(messages):
            start, content_end = content_spans[i]
            if message["role"] == "system":
                later = [content_spans[j][0] for j in range(i + 1, len(messages))]
                bound = min([s for s in later if s > content_end], default=len(text))
            else:
                bound = next(
                    (
                        content_spans[j][0]
                        for j in range(i + 1, len(messages))
                        if messages[j]["role"] != "system" and content_spans[j][0] > content_end
                    ),
                    len(text),
                )
            body_start = start
            if headers[i]:
                pos = text.rfind(headers[i], prev_end, start)
                if pos >= 0:
                    body_start = pos + len(headers[i])
            eot = self._first_marker(text, content_end, bound)
            turns.append(Turn(message["role"], body_start, content_end, eot))
            if message["role"] != "system":
                prev_end = content_end
        return turns
