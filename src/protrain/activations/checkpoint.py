"""Checkpoint: the block keeps only its inputs and is recomputed in backward.

``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around the block's forward. The
recomputation calls the block's submodules again, so module hooks fire again: the chunk
runtime gathers offloaded weights for it as it does in forward. PyTorch stops a
recomputation as soon as the tensors needed are rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def checkpointed_forward(forward: Callable) -> Callable:
    """``forward`` recomputed in backward instead of saving its intermediate tensors."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
