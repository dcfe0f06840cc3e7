"""Loss masks: which characters of a rendered sample are trained, and which tokens that makes.

Labels are the input ids where trained and `IGNORE_INDEX` elsewhere. The knobs:

- `train_on_inputs`: train on every token of the sample.
- `roles_to_train`: roles whose turns are trained (default: assistant). A turn's body is
  trained, from the end of its header to its end-of-turn marker, so reasoning blocks the
  template renders before the answer are trained with it; headers never are.
- `train_on_eos`: which end-of-turn markers are trained: `turn` (those closing a trained turn),
  `last` (only the one closing the last trained turn), `all` (every one in the sample, also
  those closing untrained turns), `none`.
"""

from __future__ import annotations

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

    def describe(self) -> str:
        return (
            f"train_on_inputs={self.train_on_inputs} roles_to_train={list(self.roles_to_train)} "
            f"train_on_eos={self.train_on_eos}"
        )


def resolve_mask_settings(settings: DataSettings, dataset: DatasetConfig) -> MaskSettings:
    """The masking knobs for one dataset: its own values where set, else the top-level ones."""

    def pick(name: str):
        own = getattr(dataset, name)
        return own if own is not None else getattr(settings, name)

    return MaskSettings(
        train_on_inputs=pick("train_on_inputs"),
        roles_to_train=tuple(pick("roles_to_train")),
        train_on_eos=pick("train_on_eos"),
    )


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
    trained = [t for t in turns if t.role in mask.roles_to_train]
    for turn in trained:
        end = turn.eot[0] if turn.eot else turn.content_end
        if end > turn.start:
            spans.append((turn.start, end))
    if mask.train_on_eos == "turn":
        spans += [t.eot for t in trained if t.eot]
    elif mask.train_on_eos == "last":
        closed = [t for t in trained if t.eot]
        if closed:
            spans.append(closed[-1].eot)  # type: ignore[arg-type]
    elif mask.train_on_eos == "all":
        spans += list(all_eot)
    return sorted(spans)


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
