"""The tokenized datasets' item containers: in memory (``TokenizedDataset``) and read back
from a prepared Arrow folder (``ArrowItems``). Both give items as dicts of token lists (and
media tensors) and count tokens without building those lists."""

from __future__ import annotations

from typing import Any

import torch

from protrain.train.data.collate import token_extra_keys


class TokenizedDataset(torch.utils.data.Dataset):
    """Encoded samples; items are dicts with `input_ids` and `labels` (lists of ints), plus
    `position_ids` when packed and media tensors for VLM rows.

    Per-token lists are held as int32 tensors (a Python list of ints costs about nine times
    as much memory) and given back as lists.
    """

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self._tokens: list[dict[str, torch.Tensor]] = []
        self._others: list[dict[str, Any]] = []
        for item in items:
            keys = {"input_ids", "labels", "position_ids", *token_extra_keys(item)} & item.keys()
            self._tokens.append({k: torch.tensor(item[k], dtype=torch.int32) for k in keys})
            self._others.append({k: v for k, v in item.items() if k not in keys})

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        tokens = {k: v.tolist() for k, v in self._tokens[index].items()}
        return {**tokens, **self._others[index]}

    def token_counts(self) -> list[int]:
        """Tokens of every item, without building their lists."""
        return [len(t["input_ids"]) for t in self._tokens]

    def media(self, index: int) -> dict[str, torch.Tensor]:
        """The media tensors of item `index`, without building its token lists."""
        return {k: v for k, v in self._others[index].items() if isinstance(v, torch.Tensor)}


class ArrowItems(torch.utils.data.Dataset):
    """Items read back from a `datasets` folder."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.ds[index]

    def token_counts(self) -> list[int]:
        """Tokens of every item, read from the Arrow column without building its lists."""
        # pyarrow comes with datasets, which the config check does not load (see loading.py)
        import pyarrow.compute as pc

        return pc.list_value_length(self.ds.with_format("arrow")["input_ids"]).to_pylist()
