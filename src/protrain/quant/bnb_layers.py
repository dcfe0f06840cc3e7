"""Recognizing bitsandbytes' layers without importing bitsandbytes, importing it with one
clear message where it is needed, and the linear layers a quantization replaces (the 4-bit
and the 8-bit base weights share these)."""

from __future__ import annotations

import functools
from types import ModuleType

from torch import nn


def import_bnb(what: str) -> ModuleType:
    """bitsandbytes, or an ImportError saying that ``what`` needs it."""
    try:
        # optional dependency (bitsandbytes, the qlora extra)
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


def linear_targets(model: nn.Module, skip: tuple[str, ...], caller: str):
    """``(name, layer)`` of every plain ``nn.Linear`` of ``model`` but its output embeddings
    and those whose name ends with one of ``skip``; ValueError where there is none, or where
    one is on the meta device."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m is not head and not any(name.endswith(s) for s in skip)
    ]
    if not targets:
        raise ValueError(f"{caller}: the model has no nn.Linear outside {skip}")
    for name, linear in targets:
        if linear.weight.device.type == "meta":
            raise ValueError(f"{name}.weight is on the meta device: materialize it first")
    return targets


def put_layer(model: nn.Module, name: str, linear: nn.Linear, layer: nn.Module) -> None:
    """``layer`` in place of the module ``name`` of ``model`` (``linear``), with its bias."""
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data, requires_grad=linear.bias.requires_grad)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
