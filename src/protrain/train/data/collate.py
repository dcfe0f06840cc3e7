"""Collation of samples into batches.

- Padded (`packing=False`): rows padded on the right to the longest row of the batch (rounded
  up to `pad_to_multiple_of`), with `attention_mask`; padding is never trained.
- Padding-free (`packing=True`): the batch's samples (or packs) are laid end to end in one row
  of shape `[1, total]`, with `position_ids` that restart at 0 for each sample and no
  `attention_mask`. transformers' mask builder derives the samples from those `position_ids`
  (sdpa, eager, flex and flash attention alike) when the forward runs without a KV cache
  (`use_cache=False`), so no sample attends to another. The first label of each sample is ignored, so
  that no sample is trained to predict its first token from the end of the previous one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from protrain.train.data.errors import DataError
from protrain.train.data.masks import IGNORE_INDEX

# Keys of items that are per-token and padded/concatenated with the text.
_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


def token_extra_keys(item: dict[str, Any]) -> list[str]:
    """Other per-token keys of an item (e.g. `token_type_ids` of Gemma 3 image tokens).

    They are plain lists as long as `input_ids`; media tensors are `torch.Tensor`s.
    """
    n = len(item["input_ids"])
    return [
        k for k, v in item.items() if k not in _TOKEN_KEYS and isinstance(v, list) and len(v) == n
    ]


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


def _cat_padded(values: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0; tensors that differ in later dims are zero-padded to the max."""
    shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    padded = []
    for v in values:
        if list(v.shape[1:]) != shape:
            pad: list[int] = []
            for d in reversed(range(1, v.dim())):
                pad += [0, shape[d - 1] - v.shape[d]]
            v = torch.nn.functional.pad(v, pad)
        padded.append(v)
    return torch.cat(padded, dim=0)


def _media(items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Media tensors of VLM rows (pixel values, grids, sizes), concatenated along dim 0."""
    keys = sorted(
        {k for item in items for k, v in item.items() if isinstance(v, torch.Tensor)}
        - set(_TOKEN_KEYS)
    )
    out = {}
    for key in keys:
        values = [item[key] for item in items if isinstance(item.get(key), torch.Tensor)]
        out[key] = _cat_padded(values)
    return out


def check_flattenable(item: dict[str, Any]) -> None:
    """Padding-free batches cannot carry per-token tensors of more than one dimension per
    token (Llama 3.2 Vision's `cross_attention_mask`): say so instead of mixing them up."""
    n = len(item["input_ids"])
    for key, value in item.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[:2] == (1, n):
            raise DataError(
                f"packed / padding-free batches do not support per-token tensor {key!r} "
                f"of shape {tuple(value.shape)}; set sample_packing: false for this model",
                field="sample_packing",
            )


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
        extra_keys = token_extra_keys(items[0])
        if "position_ids" in items[0]:
            extra_keys.append("position_ids")  # packed items padded anyway: keep their positions
        extras = {k: torch.zeros((len(rows), width), dtype=torch.long) for k in extra_keys}
        for i, (row, item) in enumerate(zip(rows, items)):
            n = len(row)
            input_ids[i, :n] = torch.tensor(row, dtype=torch.long)
            labels[i, :n] = torch.tensor(_as_list(item["labels"]), dtype=torch.long)
            attention_mask[i, :n] = 1
            for k in extra_keys:
                extras[k][i, :n] = torch.tensor(_as_list(item[k]), dtype=torch.long)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            **extras,
        }

    def _flatten(self, items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        extra_keys = token_extra_keys(items[0])
        extras: dict[str, list[int]] = {k: [] for k in extra_keys}
        for item in items:
            check_flattenable(item)
            for k in extra_keys:
                extras[k] += _as_list(item[k])
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
        for k in extra_keys:
            extras[k] += [0] * n_pad
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long),
            **{k: torch.tensor([v], dtype=torch.long) for k, v in extras.items()},
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
