"""Loss masks: which characters of a rendered sample are trained, and which tokens that makes.

Labels are the input ids where trained and `IGNORE_INDEX` elsewhere. The knobs:

- `train_on_inputs`: train on every token of the sample.
- `roles_to_train`: roles whose turns are trained (default: assistant). A turn's body is
  trained, from the end of its header to its end-of-turn marker, so reasoning blocks the
  template renders before the answer are trained with it; headers never are.
- `train_on_eos`: which end-of-turn markers are trained: `turn` (those closing a trained turn),
  `last` (only the one closing the last trained turn), `all` (every one in the sample, also
  those closing untrained turns), `none`.
- `train_on_tool_calls`: assistant turns that call tools are trained like other assistant turns
  (default); false keeps them as context only. Tool results (role `tool`) are trained only when
  `tool` is in `roles_to_train`.

Templates that mark assistant output with `{% generation %}` say themselves what is trained in
an assistant turn: those spans, as transformers' `return_assistant_tokens_mask` has them (with
`train_on_eos: turn`; `none` and `last` take end-of-turn markers out of them).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from protrain.train.data.config import DatasetConfig, DataSettings
from protrain.train.data.rendering import Turn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MaskSettings:
    train_on_inputs: bool
    roles_to_train: tuple[str, ...]
    train_on_eos: str
    train_on_tool_calls: bool = True

    def describe(self) -> str:
        return (
            f"train_on_inputs={self.train_on_inputs} roles_to_train={list(self.roles_to_train)} "
            f"train_on_eos={self.train_on_eos} train_on_tool_calls={self.train_on_tool_calls}"
        )

    def trains(self, turn: Turn) -> bool:
        """Whether a turn's body is trained (headers never are)."""
        if turn.role not in self.roles_to_train:
            return False
        return self.train_on_tool_calls or not (turn.role == "assistant" and turn.tool_calls)


def resolve_mask_settings(settings: DataSettings, dataset: DatasetConfig) -> MaskSettings:
    """The masking knobs for one dataset: its own values where set, else the top-level ones."""

    def pick(name: str):
        own = getattr(dataset, name)
        return own if own is not None else getattr(settings, name)

    return MaskSettings(
        train_on_inputs=pick("train_on_inputs"),
        roles_to_train=tuple(pick("roles_to_train")),
        train_on_eos=pick("train_on_eos"),
        train_on_tool_calls=pick("train_on_tool_calls"),
    )


def _cut(spans: Sequence[tuple[int, int]], hole: tuple[int, int]) -> list[tuple[int, int]]:
    out = []
    for a, b in spans:
        out += [(x, y) for x, y in ((a, min(b, hole[0])), (max(a, hole[1]), b)) if y > x]
    return out


def chat_trained_spans(
    turns: Sequence[Turn],
    text_len: int,
    mask: MaskSettings,
    all_eot: Sequence[tuple[int, int]] = (),
) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of the rendered chat that are trained."""
    if mask.train_on_inputs:
        return [(0, text_len)]
    spans: list[tuple[int, int]] = []
    closers: list[tuple[int, int]] = []  # end-of-turn markers of trained turns, in order
    for turn in (t for t in turns if mask.trains(t)):
        if turn.generated is not None:
            eot = turn.eot
            if eot is not None and any(a <= eot[0] and eot[1] <= b for a, b in turn.generated):
                spans += _cut(turn.generated, eot)
                closers.append(eot)
            else:
                spans += turn.generated
            continue
        if turn.body_end > turn.start:
            spans.append((turn.start, turn.body_end))
        if turn.eot:
            closers.append(turn.eot)
    if mask.train_on_eos == "turn":
        spans += closers
    elif mask.train_on_eos == "last":
        spans += closers[-1:]
    elif mask.train_on_eos == "all":
        spans += list(all_eot)
    return sorted(spans)


def widen_to_tokens(
    spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Spans grown to whole tokens: from the token holding a span's first character to the one
    holding its last, as transformers' `return_assistant_tokens_mask` counts them."""
    starts = [s for s, _ in offsets]
    out = []
    for a, b in spans:
        k = bisect.bisect_right(starts, a) - 1
        if k >= 0 and offsets[k][0] <= a < offsets[k][1]:
            a = offsets[k][0]
        k = bisect.bisect_right(starts, b - 1) - 1
        if k >= 0 and offsets[k][0] <= b - 1 < offsets[k][1]:
            b = max(b, offsets[k][1])
        out.append((a, b))
    return out


def labels_from_offsets(
    input_ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    text: str,
    spans: Sequence[tuple[int, int]],
) -> list[int]:
    """Labels for tokens whose characters fall in the trained spans.

    A token is trained when it lies inside a span, or when it shares a non-blank character with
    one: a SentencePiece token such as `▁answer` carries the space before the answer with it.
    """
    trained = bytearray(len(text) + 1)
    for a, b in spans:
        trained[a:b] = b"\x01" * (b - a)
    labels = []
    for token_id, (s, e) in zip(input_ids, offsets):
        if e <= s:
            hit = False  # zero-width tokens are added specials (BOS), not text
        elif all(trained[s:e]):
            hit = True
        else:
            hit = any(trained[k] and not text[k].isspace() for k in range(s, e))
        labels.append(token_id if hit else IGNORE_INDEX)
    return labels
