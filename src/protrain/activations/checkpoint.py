"""Checkpoint: the block keeps only its inputs and is recomputed in backward.

``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around the block's forward. The
recomputation calls the block's submodules again, so module hooks fire again: the chunk
runtime gathers offloaded weights for it as it does in forward. PyTorch stops a
recomputation as soon as the tensors needed are rebuilt.

[Note: key-value caches and recomputation]
A Hugging Face model called with ``use_cache=True`` (the default of most configs, also in
training) hands every layer a cache object that the layer's attention appends its keys and
values to. A recomputed layer would append them a second time and recompute attention over
the doubled keys. Like Hugging Face's own gradient checkpointing, a recomputed block is
therefore called without a cache while gradients are on (``past_key_values`` and its older
spellings set to None, ``use_cache`` to False), and a warning says so once. Training needs
no cache; pass ``use_cache=False`` to the model to avoid the warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")
_warned = False


def without_cache(kwargs: dict) -> dict:
    """``kwargs`` with any key-value cache removed (see [Note: key-value caches and
    recomputation])."""
    global _warned
    found = [k for k in CACHE_KWARGS if kwargs.get(k) is not None]
    if not found and not kwargs.get("use_cache"):
        return kwargs
    if not _warned:
        _warned = True
        log.warning(
            "activation checkpointing: a recomputed block was called with a key-value cache "
            "(%s); it runs without one, since recomputation would fill it twice. Pass "
            "use_cache=False to the model in training.",
            ", ".join(found) or "use_cache=True",
        )
    kwargs = {**kwargs, **{k: None for k in found}}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def checkpointed_forward(forward: Callable) -> Callable:
    """``forward`` recomputed in backward instead of saving its intermediate tensors."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **without_cache(kwargs))

    return run
