"""Recognizing bitsandbytes' layers without importing bitsandbytes, and importing it with
one clear message where it is needed (the 4-bit and the 8-bit base weights share both)."""

from __future__ import annotations

import functools
from types import ModuleType

from torch import nn


def import_bnb(what: str) -> ModuleType:
    """bitsandbytes, or an ImportError saying that ``what`` needs it."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ImportError(f"{what} need bitsandbytes: pip install 'protrain[qlora]'") from None
    return bnb


def is_bnb(module: nn.Module, class_name: str) -> bool:
    """An instance of bitsandbytes' ``class_name`` (without importing bitsandbytes)."""
    return class_name in _bnb_bases(type(module))


@functools.cache
def _bnb_bases(cls: type) -> frozenset[str]:
    # per class, not per module: the planner lifts every module of a 70B model per search
    return frozenset(c.__name__ for c in cls.__mro__ if c.__module__.startswith("bitsandbytes"))
