"""axolotl 0.21.0 ``axolotl/utils/dict.py``: ``DictDefault``, an ``addict.Dict`` returning
None for missing keys. Here a dict with the same access (attribute or item, nested
mappings converted, None when missing); left out: its ``|`` (addict's recursive merge),
addict's pickling workaround and ``remove_none_values``."""

from __future__ import annotations

from typing import Any


class DictDefault(dict):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for key, value in self.items():
            super().__setitem__(key, _convert(value))

    def __missing__(self, key: str) -> None:
        return None

    def __getattr__(self, key: str) -> Any:
        return self[key]

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def _convert(value: Any) -> Any:
    if isinstance(value, dict) and not isinstance(value, DictDefault):
        return DictDefault(value)
    if isinstance(value, list):
        return [_convert(v) for v in value]
    return value
