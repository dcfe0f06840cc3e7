"""The micro-batch the planner traces: the heaviest one the training data can produce.

A plan made for one micro-batch holds for every micro-batch that is no heavier. What makes
a micro-batch heavy is read from the preprocessed rows, without running the model:

- media input: the floating-point values of a row's media tensors after the processor
  (pixel values of images and video frames, audio features). For a vision tower these are
  its patches times the values of a patch, so more images, more frames and larger images
  after resizing all weigh more: they drive the tower's activations and time.
- width: the tokens of the widest micro-batch. The padded collator pads a micro-batch to
  its longest row, so the widest is as wide as the longest row of the dataset. A
  padding-free (packed) micro-batch lays `micro_batch_size` packs of up to `sequence_len`
  tokens end to end; packs fill to nearly `sequence_len`, so every packed micro-batch is
  planned at the same width, `micro_batch_size * sequence_len`.

The batch is made of real rows: the `micro_batch_size` rows with the most media input
(ties: the longest first; a text dataset has none, so its longest rows), collated by the
run's collator, then padded with masked, untrained tokens to the widest width where its
rows are narrower. Its media tensors have the shapes of the heaviest rows and its token
tensors the widest width, so no micro-batch of the run has more media values or more
tokens. Choosing reads row sizes only: no random draw, no stream position is used.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from protrain.train.loss import IGNORE_INDEX


@dataclass(frozen=True)
class RowSize:
    """What one preprocessed row weighs."""

    tokens: int
    media_values: int  # floating-point values of its media tensors


@dataclass
class HeaviestBatch:
    """The planning micro-batch, the rows it is made of, and why (one line)."""

    batch: dict[str, torch.Tensor]
    rows: list[int]
    reason: str


def media_values(tensors: dict[str, Any]) -> int:
    """Floating-point values among `tensors` (pixels, frames, audio features); integer
    tensors (grids, sizes, masks) describe the media and weigh nothing of their own."""
    return sum(t.numel() for t in tensors.values() if torch.is_tensor(t) and t.is_floating_point())


def row_sizes(dataset) -> list[RowSize]:
    """Sizes of every row. Datasets that can give token counts and media without building
    each row's token lists (`token_counts()`, `media(index)`) are read that way: building
    the lists of 100k rows of 2k tokens takes about 15 s."""
    if hasattr(dataset, "token_counts"):
        counts = dataset.token_counts()
        media = getattr(dataset, "media", None)
        return [
            RowSize(n, media_values(media(i)) if media is not None else 0)
            for i, n in enumerate(counts)
        ]
    sizes = []
    for i in range(len(dataset)):
        item = dataset[i]
        sizes.append(RowSize(len(item["input_ids"]), media_values(item)))
    return sizes


def choose_rows(sizes: list[RowSize], micro_batch_size: int) -> list[int]:
    """The `micro_batch_size` rows with the most media input; ties: the longest, then the
    first."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i].media_values, -sizes[i].tokens, i))
    return order[:micro_batch_size]


def heaviest_batch(
    dataset,
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    *,
    micro_batch_size: int,
    sequence_len: int | None = None,
    packing: bool = False,
    pad_to_multiple_of: int | None = None,
) -> HeaviestBatch:
    """The heaviest micro-batch of `dataset` under `collate` (see the module's note).
    `sequence_len`: the packs' length, needed where `packing`. `pad_to_multiple_of`: the
    multiple the collator pads to (None: its own `pad_to_multiple_of` attribute, if any)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size!r}: use an integer >= 1")
    if packing and sequence_len is None:
        raise ValueError("packing=True needs sequence_len, the length of a pack")
    sizes = row_sizes(dataset)
    if not sizes:
        raise ValueError("the training dataset is empty: there is no micro-batch to plan for")
    rows = choose_rows(sizes, micro_batch_size)
    items = [dataset[i] for i in rows]
    batch = collate(items)
    if packing:
        width = sequence_len * len(rows)
    else:
        if pad_to_multiple_of is None:
            pad_to_multiple_of = getattr(collate, "pad_to_multiple_of", 0)
        width = _round_up(max(s.tokens for s in sizes), pad_to_multiple_of)
    batch = pad_tokens(batch, width, getattr(collate, "pad_id", 0), _media_keys(items))
    return HeaviestBatch(batch, rows, _reason(sizes, rows, batch, packing, sequence_len))


def pad_tokens(
    batch: dict[str, torch.Tensor], width: int, pad_id: int, media_keys: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """`batch` with its per-token tensors padded on the right to `width` tokens: pad ids,
    untrained labels, masked attention, positions that go on counting (a packed row's
    padding is a sample of its own), zeros elsewhere. Media tensors are kept, except integer
    ones laid out per token (`(batch, tokens, ...)`, as Llama 3.2 Vision's cross-attention
    mask), which are padded with zeros."""
    ids = batch["input_ids"]
    n_pad = width - ids.shape[1]
    if n_pad <= 0:
        return batch
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX}
    out = {}
    for key, t in batch.items():
        per_token = torch.is_tensor(t) and t.dim() >= 2 and t.shape[:2] == ids.shape
        if key in media_keys:  # pixels never: their leading dims can match by chance
            per_token = per_token and t.dim() >= 3 and not t.is_floating_point()
        if not per_token:
            out[key] = t
        elif key == "position_ids":
            tail = torch.arange(n_pad, dtype=t.dtype).expand(t.shape[0], n_pad)
            out[key] = torch.cat([t, tail], dim=1)
        else:
            pad = t.new_full((t.shape[0], n_pad, *t.shape[2:]), fill.get(key, 0))
            out[key] = torch.cat([t, pad], dim=1)
    return out


def _media_keys(items: list[dict[str, Any]]) -> set[str]:
    """The rows' tensors other than their token tensors (integer, one value per token of
    the row: ids, masks and labels of rows stored as tensors)."""
    keys = set()
    for item in items:
        n_tokens = len(item["input_ids"])
        for key, v in item.items():
            if not torch.is_tensor(v):
                continue
            if not (v.dim() == 1 and v.shape[0] == n_tokens and not v.is_floating_point()):
                keys.add(key)
    return keys


def _round_up(n: int, multiple: int | None) -> int:
    return -(-n // multiple) * multiple if multiple else n


def _reason(
    sizes: list[RowSize], rows: list[int], batch: dict, packing: bool, sequence_len: int
) -> str:
    what = "packs" if packing else "rows"
    chosen = f"{what} {rows} of {len(sizes)}"
    media = sum(sizes[i].media_values for i in rows)
    if media:
        shapes = ", ".join(
            f"{k} {'x'.join(map(str, v.shape))}"
            for k, v in batch.items()
            if torch.is_tensor(v) and v.is_floating_point()
        )
        why = f"the most media input ({media:,} values: {shapes})"
    else:
        why = "the longest (" + ", ".join(str(sizes[i].tokens) for i in rows) + " tokens)"
    width = batch["input_ids"].shape[-1]
    if packing:
        where = (
            f"{width} tokens wide ({len(rows)} x sequence_len {sequence_len}: every "
            "padding-free micro-batch is planned at that width)"
        )
    else:
        longest = max(range(len(sizes)), key=lambda i: (sizes[i].tokens, -i))
        where = f"{width} tokens wide (the longest row, {longest}: {sizes[longest].tokens} tokens)"
    return f"planning micro-batch: {chosen}, {why}, {where}"
