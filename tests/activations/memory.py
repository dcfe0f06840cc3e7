"""Watching tensor sizes on the CPU: every op's outputs, forward and backward alike."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestOutputs(TorchDispatchMode):
    """Records, per dtype, the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}
        self.shapes: dict[torch.dtype, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest.get(t.dtype, -1):
                self.largest[t.dtype] = t.numel()
                self.shapes[t.dtype] = tuple(t.shape)
        return out
