"""Packing short samples into sequences of up to `sequence_len` tokens.

Each pack holds whole samples laid end to end, with `position_ids` restarting at 0 at each
sample start, so that attention never crosses samples (see `collate`) and rotary positions
are those of an unpacked sample.
Bins are filled best-fit, longest sample first; ties keep a seed-shuffled order, so the packs
are the same for the same seed.
"""

from __future__ import annotations

import bisect
import random
from typing import Any

import torch

from protrain.train.data.collate import (
    _as_list,
    _cat_padded,
    check_flattenable,
    token_extra_keys,
)


def plan_bins(lengths: list[int], capacity: int, seed: int) -> list[list[int]]:
    """Indices of samples per bin; every sample lands in exactly one bin."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    order.sort(key=lambda i: -lengths[i])  # stable: ties keep the shuffled order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


def pack_items(
    items: list[dict[str, Any]], *, sequence_len: int, seed: int
) -> list[dict[str, Any]]:
    for item in items:
        check_flattenable(item)
    lengths = [len(item["input_ids"]) for item in items]
    packs = []
    for members in plan_bins(lengths, sequence_len, seed):
        members.sort()  # samples keep their dataset order inside a pack
        extra_keys = token_extra_keys(items[members[0]])
        pack: dict[str, Any] = {"input_ids": [], "labels": [], "position_ids": []}
        pack.update({k: [] for k in extra_keys})
        media: dict[str, list[torch.Tensor]] = {}
        for i in members:
            item = items[i]
            pack["input_ids"] += _as_list(item["input_ids"])
            pack["labels"] += _as_list(item["labels"])
            pack["position_ids"] += list(range(lengths[i]))
            for key in extra_keys:
                pack[key] += _as_list(item[key])
            for key, value in item.items():
                if isinstance(value, torch.Tensor):
                    media.setdefault(key, []).append(value)
        for key, values in media.items():
            pack[key] = _cat_padded(values)
        packs.append(pack)
    return packs
