"""Checkpoint: the block keeps only its inputs and is recomputed in backward.

``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around the block's forward. The
recomputation calls the block's submodules again, so module hooks fire again: the chunk
runtime gathers offloaded weights for it as it does in forward. PyTorch stops a
recomputation as soon as the tensors needed are rebuilt.

[Note: key-value caches and recomputation]
A Hugging Face model called with ``use_cache=True`` (the default of most configs, also in
training) hands every layer a cache object that the layer's attention (or state-space
mixer) appends its keys, values or states to. A recomputed layer would append them a
second time and recompute attention over the doubled keys, or fail on a cache whose shape
no longer fits. Like Hugging Face's own gradient checkpointing, a recomputed block is
therefore called without a cache while gradients are on, in forward and in recomputation
alike, and a warning says so once. Training needs no cache; pass ``use_cache=False`` to the
model to avoid the warning.

The name a cache travels under differs between families and releases (``past_key_values``,
``past_key_value``, ``layer_past``, ``cache``, ``cache_params``, or a positional argument
as in GPT-2), so a cache is recognised by what it is, a ``transformers`` ``Cache`` or an
object whose class is named ``...Cache``, as well as by the names known today.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache

log = logging.getLogger(__name__)

# Names under which a cache that is not a ``Cache`` (a tuple of tensors, in older code) is
# passed; objects of a cache type are recognised under any name.
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache", "cache_params")
_warned = False


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a key-value or state cache object."""
    # Some families keep their own cache class outside the ``Cache`` hierarchy (xLSTM,
    # Reformer, the convolution padding caches of audio models).
    return isinstance(value, Cache) or type(value).__name__.endswith("Cache")


def without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every key-value cache replaced by None and ``use_cache``
    off (see [Note: key-value caches and recomputation])."""
    global _warned
    found_args = [i for i, a in enumerate(args) if is_cache(a)]
    found_kwargs = [
        k for k, v in kwargs.items() if v is not None and (k in CACHE_KWARGS or is_cache(v))
    ]
    if not found_args and not found_kwargs and not kwargs.get("use_cache"):
        return args, kwargs
    if not _warned:
        _warned = True
        names = found_kwargs + [f"positional argument {i}" for i in found_args]
        log.warning(
            "activation checkpointing: a recomputed block was called with a key-value cache "
            "(%s); it runs without one, since recomputation would fill it twice. Pass "
            "use_cache=False to the model in training.",
            ", ".join(names) or "use_cache=True",
        )
    if found_args:
        args = tuple(None if i in found_args else a for i, a in enumerate(args))
    kwargs = {**kwargs, **dict.fromkeys(found_kwargs)}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def checkpointed_forward(forward: Callable) -> Callable:
    """``forward`` recomputed in backward instead of saving its intermediate tensors."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args, kwargs = without_cache(args, kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
