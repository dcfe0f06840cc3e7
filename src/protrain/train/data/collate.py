"""Collation of samples into batches.

- Padded (`packing=False`): rows padded on the right to the longest row of the batch (rounded
  up to `pad_to_multiple_of`), with `attention_mask`; padding is never trained.
- Padding-free (`packing=True`): the batch's samples (or packs) are laid end to end in one row
  of shape `[1, total]`, with `position_ids` that restart at 0 for each sample. Attention
  implementations that read sequence starts from `position_ids` (flash-attention, flex
  attention) then never attend across samples. The first label of each sample is ignored, so
  that no sample is trained to predict its first token from the end of the previous one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from protrain.train.data.masks import IGNORE_INDEX

# Keys of items that are per-token and padded/concatenated with the text.
_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


def _as_list(x: Any) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def _round_up(n: int, multiple: int | None) -> int:
    if not multiple:
        return n
    return -(-n // multiple) * multiple


def pad_token_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return 0 if pad is None else pad


def _media(items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Media tensors of VLM rows, concatenated along the first dimension."""
    keys = [k for k in items[0] if k not in _TOKEN_KEYS]
    out = {}
    for key in keys:
        values = [item[key] for item in items if item.get(key) is not None]
        if values and all(isinstance(v, torch.Tensor) for v in values):
            out[key] = torch.cat(values, dim=0)
    return out


def _positions(item: dict[str, Any]) -> list[int]:
    if "position_ids" in item:
        return _as_list(item["position_ids"])
    return list(range(len(item["input_ids"])))


class Collator:
    def __init__(
        self,
        tokenizer,
        *,
        sequence_len: int,
        packing: bool,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        self.pad_id = pad_token_id(tokenizer)
        self.sequence_len = sequence_len
        self.packing = packing
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not items:
            raise ValueError("cannot collate an empty batch")
        batch = self._flatten(items) if self.packing else self._pad(items)
        batch.update(_media(items))
        return batch

    def _pad(self, items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [_as_list(item["input_ids"]) for item in items]
        width = _round_up(max(len(r) for r in rows), self.pad_to_multiple_of)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, item) in enumerate(zip(rows, items)):
            n = len(row)
            input_ids[i, :n] = torch.tensor(row, dtype=torch.long)
            labels[i, :n] = torch.tensor(_as_list(item["labels"]), dtype=torch.long)
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}

    def _flatten(self, items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for item in items:
            item_ids = _as_list(item["input_ids"])
            item_labels = _as_list(item["labels"])
            item_pos = _positions(item)
            for j, p in enumerate(item_pos):
                if p == 0:  # a sample starts here: nothing before it may predict its first token
                    item_labels[j] = IGNORE_INDEX
            ids += item_ids
            labels += item_labels
            positions += item_pos
        width = _round_up(len(ids), self.pad_to_multiple_of)
        n_pad = width - len(ids)
        ids += [self.pad_id] * n_pad
        labels += [IGNORE_INDEX] * n_pad
        positions += list(range(n_pad))
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long),
        }


def build_collator(
    tokenizer,
    *,
    sequence_len: int,
    packing: bool,
    pad_to_multiple_of: int | None = None,
) -> Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]:
    """A callable turning a list of dataset items into a batch dict of tensors."""
    return Collator(
        tokenizer, sequence_len=sequence_len, packing=packing, pad_to_multiple_of=pad_to_multiple_of
    )
