"""Role boundaries: where each role's turns start and end, as token sequences.

Vision-language processors expand media placeholders into many tokens after the chat is
rendered, so their masks are found on the final token ids: a turn of `role` starts at its
`start` marker and ends at its `end` marker (`None`: the end of the sequence). At each
position the longest matching start marker wins, so `<|im_start|>assistant\\n` is never
taken for a shorter marker that shares its prefix. A turn's end marker may also open the next
turn (Mistral and Pixtral: `[/INST]` closes the user turn and opens the answer).

The built-in tables below are the families' published chat formats. A YAML `role_boundaries`
list replaces them (an empty list too: it then means "no turn is trained").
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from protrain.train.data.config import RoleBoundary
from protrain.train.data.errors import DataError
from protrain.train.data.formats import ChatSample
from protrain.train.data.masks import IGNORE_INDEX, MaskSettings
from protrain.train.data.rendering import ChatRenderer, TemplateMismatch

logger = logging.getLogger("protrain.train.data")


def _rb(role: str, start: str, end: str | None, include_start=False, include_end=True):
    return RoleBoundary(
        role=role, start=start, end=end, include_start=include_start, include_end=include_end
    )


def _chatml() -> list[RoleBoundary]:
    return [
        _rb("system", "<|im_start|>system\n", "<|im_end|>"),
        _rb("user", "<|im_start|>user\n", "<|im_end|>"),
        _rb("assistant", "<|im_start|>assistant\n", "<|im_end|>"),
        _rb("tool", "<|im_start|>tool\n", "<|im_end|>"),
    ]


def _gemma3() -> list[RoleBoundary]:
    # The system prompt is folded into the first user turn.
    return [
        _rb("user", "<start_of_turn>user\n", "<end_of_turn>"),
        _rb("assistant", "<start_of_turn>model\n", "<end_of_turn>"),
    ]


def _gemma4() -> list[RoleBoundary]:
    return [
        _rb("system", "<|turn>system\n", "<turn|>"),
        _rb("user", "<|turn>user\n", "<turn|>"),
        _rb("assistant", "<|turn>model\n", "<turn|>"),
        _rb("tool", "<|turn>tool\n", "<turn|>"),
    ]


def _llama3() -> list[RoleBoundary]:
    # An assistant turn that calls a built-in tool ends with <|eom_id|>: the tool's output follows.
    return [
        _rb(role, f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")
        for role in ("system", "user")
    ] + [
        _rb(
            "assistant",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            ["<|eot_id|>", "<|eom_id|>"],
        ),
        _rb("tool", "<|start_header_id|>ipython<|end_header_id|>\n\n", "<|eot_id|>"),
        _rb("tool", "<|start_header_id|>tool<|end_header_id|>\n\n", "<|eot_id|>"),
    ]


def _llama4() -> list[RoleBoundary]:
    return [
        _rb(role, f"<|header_start|>{role}<|header_end|>\n\n", "<|eot|>")
        for role in ("system", "user")
    ] + [
        _rb("assistant", "<|header_start|>assistant<|header_end|>\n\n", ["<|eot|>", "<|eom|>"]),
        _rb("tool", "<|header_start|>ipython<|header_end|>\n\n", "<|eot|>"),
        _rb("tool", "<|header_start|>tool<|header_end|>\n\n", "<|eot|>"),
    ]


def _pixtral() -> list[RoleBoundary]:
    return [
        _rb("user", "[INST]", "[/INST]", include_end=False),
        _rb("assistant", "[/INST]", "eos_token"),
    ]


def _mistral_v7_tekken() -> list[RoleBoundary]:
    return [
        _rb("system", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
        *_pixtral(),
    ]


FAMILY_BOUNDARIES = {
    "qwen2_vl": _chatml,
    "qwen2_5_vl": _chatml,
    "qwen3_vl": _chatml,
    "qwen3_5": _chatml,
    "qwen2_audio": _chatml,
    "gemma3": _gemma3,
    "gemma3n": _gemma3,
    "gemma4": _gemma4,
    "llama3_2_vision": _llama3,
    "llama4": _llama4,
    "pixtral": _pixtral,
    "mistral_v7_tekken": _mistral_v7_tekken,
}

# Processor (or model type) names onto families; the first matching prefix wins.
PROCESSOR_FAMILIES = (
    ("Qwen2_5_VL", "qwen2_5_vl"),
    ("Qwen2VL", "qwen2_vl"),
    ("Qwen3VL", "qwen3_vl"),
    ("Qwen3_5", "qwen3_5"),
    ("Qwen2Audio", "qwen2_audio"),
    ("Gemma3n", "gemma3n"),
    ("Gemma3", "gemma3"),
    ("Gemma4", "gemma4"),
    ("Mllama", "llama3_2_vision"),
    ("Llama4", "llama4"),
    ("Pixtral", "pixtral"),
    ("Mistral3", "mistral_v7_tekken"),
)

# Tokens that stand for media, or frame it: never trained.
MEDIA_TOKENS = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|audio_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<start_of_audio>",
    "<end_of_audio>",
    "<audio_soft_token>",
    "<|image>",
    "<|image|>",
    "<image|>",
    "<|audio>",
    "<|audio|>",
    "<audio|>",
    "<|video|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "<image>",
    "<video>",
)

_SPECIAL_LOOKING = re.compile(r"<\|?[^<>\s|]+\|?>|\[/?[A-Z_]+\]")

_warned: set[str] = set()


@dataclass(frozen=True)
class Boundary:
    """A role boundary resolved to token ids."""

    role: str
    start: tuple[int, ...]
    end: tuple[tuple[int, ...], ...] | None  # alternatives; the first found ends the turn
    include_start: bool
    include_end: bool


def detect_family(processor, template: str | None) -> str | None:
    """The built-in family of a processor, by class name, else by the template's markers."""
    name = type(processor).__name__ if processor is not None else ""
    for prefix, family in PROCESSOR_FAMILIES:
        if name.startswith(prefix):
            return family
    if not template:
        return None
    if "<|vision_start|>" in template:
        return "qwen2_vl"
    if "<|AUDIO|>" in template and "<|im_start|>" in template:
        return "qwen2_audio"
    if "<start_of_turn>" in template:
        return "gemma3"
    if "<|turn>" in template:
        return "gemma4"
    if "<|start_header_id|>" in template:
        return "llama3_2_vision"
    if "<|header_start|>" in template:
        return "llama4"
    if "[SYSTEM_PROMPT]" in template and "[/INST]" in template:
        return "mistral_v7_tekken"
    if "[/INST]" in template:
        return "pixtral"
    return None


def encode_marker(tokenizer, marker: str, what: str) -> tuple[int, ...]:
    """Token ids of a marker; a marker the tokenizer cannot encode exactly is an error."""
    if marker == "eos_token":
        if tokenizer.eos_token_id is None:
            raise DataError(
                f"{what}: 'eos_token' but the tokenizer has no EOS token", field="role_boundaries"
            )
        return (tokenizer.eos_token_id,)
    ids = tuple(tokenizer(marker, add_special_tokens=False)["input_ids"])
    unk = getattr(tokenizer, "unk_token_id", None)
    problem = None
    if not ids:
        problem = "encodes to no token"
    elif unk is not None and unk in ids and "unk" not in marker.lower():
        problem = "contains text the tokenizer maps to its unknown token"
    elif tokenizer.decode(list(ids), skip_special_tokens=False) != marker:
        problem = "does not decode back to itself"
    else:
        vocab = tokenizer.get_vocab()
        missing = [m for m in _SPECIAL_LOOKING.findall(marker) if m not in vocab]
        if missing:
            problem = f"uses {missing}, which the tokenizer does not have as tokens"
    if problem:
        raise DataError(f"{what}: marker {marker!r} {problem}", field="role_boundaries")
    return ids


def resolve_boundaries(specs: Sequence[RoleBoundary], tokenizer, source: str) -> list[Boundary]:
    out = []
    for k, spec in enumerate(specs):
        what = f"{source}[{k}] (role {spec.role})"
        ends = [spec.end] if isinstance(spec.end, str) else spec.end
        out.append(
            Boundary(
                role=spec.role,
                start=encode_marker(tokenizer, spec.start, what + " start"),
                end=None
                if ends is None
                else tuple(encode_marker(tokenizer, e, what + " end") for e in ends),
                include_start=spec.include_start,
                include_end=spec.include_end,
            )
        )
    return out


def boundaries_for(settings_boundaries, processor, template, tokenizer) -> list[Boundary] | None:
    """The YAML override, else the family's built-in table; None (and one warning) if neither."""
    if settings_boundaries is not None:
        return resolve_boundaries(settings_boundaries, tokenizer, "role_boundaries")
    family = detect_family(processor, template)
    if family is None:
        key = type(processor).__name__
        if key not in _warned:
            _warned.add(key)
            logger.warning(
                "no verified role boundaries for %s; masks come from the rendered text, aligned "
                "onto the processor's tokens. To set them, add to the config e.g.\n"
                "role_boundaries:\n"
                "  - {role: user, start: '<|im_start|>user\\n', end: '<|im_end|>'}\n"
                "  - {role: assistant, start: '<|im_start|>assistant\\n', end: '<|im_end|>'}",
                key,
            )
        return None
    return family_boundaries(family, tokenizer)


def family_boundaries(family: str, tokenizer) -> list[Boundary]:
    """A family's built-in boundaries, less roles whose markers the tokenizer lacks."""
    vocab = tokenizer.get_vocab()
    specs = []
    for spec in FAMILY_BOUNDARIES[family]():
        if not all(m in vocab for m in _SPECIAL_LOOKING.findall(spec.start)):
            continue
        if isinstance(spec.end, list):  # keep the end markers the tokenizer has
            ends = [e for e in spec.end if all(m in vocab for m in _SPECIAL_LOOKING.findall(e))]
            spec = spec.model_copy(update={"end": ends or spec.end[:1]})
        specs.append(spec)
    return resolve_boundaries(specs, tokenizer, f"built-in {family} role boundaries")


def media_token_ids(tokenizer, processor=None) -> set[int]:
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in MEDIA_TOKENS if t in vocab}
    for attr in (
        "image_token_id",
        "video_token_id",
        "audio_token_id",
        "boi_token_id",
        "eoi_token_id",
    ):
        value = getattr(processor, attr, None) if processor is not None else None
        if isinstance(value, int):
            ids.add(value)
    return ids


@dataclass(frozen=True)
class TokenTurn:
    role: str
    start: tuple[int, int]  # start marker
    body: tuple[int, int]
    end: tuple[int, int] | None  # end marker


def _match(ids: Sequence[int], at: int, seq: tuple[int, ...]) -> bool:
    return tuple(ids[at : at + len(seq)]) == seq


def _longest_start(ids: Sequence[int], at: int, boundaries: Sequence[Boundary], skip_role=None):
    best = None
    for b in boundaries:
        if (
            b.role != skip_role
            and _match(ids, at, b.start)
            and (best is None or len(b.start) > len(best.start))
        ):
            best = b
    return best


def find_turns(
    ids: Sequence[int], boundaries: Sequence[Boundary]
) -> list[tuple[Boundary, TokenTurn]]:
    turns = []
    n = len(ids)
    i = 0
    while i < n:
        b = _longest_start(ids, i, boundaries)
        if b is None:
            i += 1
            continue
        body_start = i + len(b.start)
        end_at, end_len = None, 0
        if b.end is not None:
            j = body_start
            while j < n and end_at is None:
                hit = next((e for e in b.end if _match(ids, j, e)), None)
                if hit is not None:
                    end_at, end_len = j, len(hit)
                j += 1
        if end_at is None:
            turns.append((b, TokenTurn(b.role, (i, body_start), (body_start, n), None)))
            break
        end_span = (end_at, end_at + end_len)
        turns.append((b, TokenTurn(b.role, (i, body_start), (body_start, end_at), end_span)))
        # A shared marker: the end of this turn is the start of another role's turn.
        i = end_at if _longest_start(ids, end_at, boundaries, skip_role=b.role) else end_span[1]
    return turns


def calls_per_assistant(messages: Sequence[dict]) -> list[bool]:
    """For `labels_by_boundaries`: whether each assistant message, in order, calls tools."""
    return [bool(m.get("tool_calls")) for m in messages if m.get("role") == "assistant"]


class TurnCountMismatch(ValueError):
    """The assistant turns the boundaries found are not one a message."""


def labels_by_boundaries(
    ids: Sequence[int],
    boundaries: Sequence[Boundary],
    mask: MaskSettings,
    never_trained: set[int],
    calls: Sequence[bool] | None = None,
) -> list[int]:
    """Labels of `ids` from role boundaries. `calls`: per assistant message in order,
    whether it calls tools; with `train_on_tool_calls` off, the assistant turn of each
    such message is not trained (the k-th assistant turn found is the k-th assistant
    message's: a template that writes them otherwise is a `TurnCountMismatch`)."""
    labels = [IGNORE_INDEX] * len(ids)

    def train(span):
        for k in range(*span):
            labels[k] = ids[k]

    if mask.train_on_inputs:
        train((0, len(ids)))
    else:
        turns = find_turns(ids, boundaries)
        trained = [(b, t) for b, t in turns if t.role in mask.roles_to_train]
        if not mask.train_on_tool_calls and calls is not None and any(calls):
            assistant = [t for _, t in turns if t.role == "assistant"]
            if len(assistant) != len(calls):
                raise TurnCountMismatch(
                    f"the role boundaries find {len(assistant)} assistant turn(s) for "
                    f"{len(calls)} assistant message(s), so train_on_tool_calls: false cannot "
                    "tell which turns call tools"
                )
            calling = {id(t) for t, c in zip(assistant, calls) if c}
            trained = [(b, t) for b, t in trained if id(t) not in calling]
        for b, t in trained:
            train(t.body)
            if b.include_start:
                train(t.start)
        if mask.train_on_eos == "turn":
            for b, t in trained:
                if t.end and b.include_end:
                    train(t.end)
        elif mask.train_on_eos == "last":
            closed = [(b, t) for b, t in trained if t.end and b.include_end]
            if closed:
                train(closed[-1][1].end)
        elif mask.train_on_eos == "all":
            for b, t in turns:
                if t.end and b.include_end:
                    train(t.end)
    return [IGNORE_INDEX if tok in never_trained else lab for tok, lab in zip(ids, labels)]


def boundary_labels(
    renderer: ChatRenderer,
    sample: ChatSample,
    text: str,
    ids: list[int],
    boundaries,
    mask: MaskSettings,
    never_trained: set[int],
    *,
    dataset: str,
    row: int,
) -> list[int]:
    """Labels from role boundaries for a chat rendered as `text` (tokens `ids`, which a
    processor may have expanded), after checking that the template wrote every tool call
    (else that turn would be trained empty); `train_on_tool_calls` applied per turn."""
    try:
        renderer.check_tool_calls_rendered(sample.messages, sample.template_kwargs, text)
        return labels_by_boundaries(
            ids, boundaries, mask, never_trained, calls_per_assistant(sample.messages)
        )
    except TemplateMismatch as e:
        raise e.data_error(dataset, row) from e
    except TurnCountMismatch as e:
        raise DataError(str(e), dataset=dataset, row=row, field="messages") from e
