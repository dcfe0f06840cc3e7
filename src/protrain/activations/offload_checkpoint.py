"""Offload-checkpoint: a checkpointed block whose held inputs wait in host memory.

A checkpointed block holds its inputs until its recomputation. Here the inputs that need a
gradient (the hidden states flowing through the stack; not masks or position embeddings,
which all blocks share) are copied to host memory as the block starts and the block forgets
the device tensors once its forward is over. The recomputation reads them back, prefetched
like swapped tensors when the block's backward is about to begin.

The inputs reach the checkpointed function through a small holder object instead of as
arguments: ``checkpoint`` keeps its arguments alive until backward, the holder lets go of
the device tensors after forward. The autograd graph still links the block's outputs to its
inputs' producers, so gradients flow as they do for a plain checkpoint. A key-value cache
is not passed on, as for a plain checkpoint (see :mod:`protrain.activations.checkpoint`).

[Note: random state of the recomputation]
``checkpoint`` replays the random state of the devices its tensor arguments live on, so that
dropout draws the same masks again. The holder is not a tensor, so the block's device is
named by a zero-size tensor passed beside it (it allocates nothing); without it the CUDA
random state would not be replayed and a recomputed dropout would draw new masks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from protrain.activations.checkpoint import without_cache
from protrain.activations.swap import ActivationSwapper


class _HeldInputs:
    """A block call's arguments; those needing a gradient are also held as host copies."""

    def __init__(self, swapper: ActivationSwapper, args: tuple, kwargs: dict):
        self.swapper = swapper
        self.args, self.kwargs = list(args), dict(kwargs)
        self.group = swapper.open_group()
        self.packed: dict[tuple[str, object], object] = {}  # where -> swapper handle
        for i, a in enumerate(self.args):
            self._hold(("arg", i), a)
        for k, a in self.kwargs.items():
            self._hold(("kwarg", k), a)

    def device(self) -> torch.device:
        """The accelerator the block's tensor arguments are on (the swapper's when none is)."""
        for a in [*self.args, *self.kwargs.values()]:
            if torch.is_tensor(a) and a.device.type != "cpu":
                return a.device
        return self.swapper.device

    def _hold(self, where, a) -> None:
        if torch.is_tensor(a) and a.requires_grad:
            self.packed[where] = self.swapper.pack(self.group, a.detach())

    def arguments(self) -> tuple[list, dict]:
        """The arguments, device tensors read back from host memory where forward dropped them."""
        args, kwargs = list(self.args), dict(self.kwargs)
        for (kind, key), packed in self.packed.items():
            target = args if kind == "arg" else kwargs
            if target[key] is None:  # only inputs that need a gradient are held
                target[key] = self.swapper.unpack(packed).requires_grad_(True)
        return args, kwargs

    def release(self, output) -> None:
        """End of forward: drop the device copies of the held inputs."""
        for kind, key in self.packed:
            (self.args if kind == "arg" else self.kwargs)[key] = None
        self.swapper.close_group(self.group, output)


def offload_checkpointed_forward(forward: Callable, swapper: ActivationSwapper) -> Callable:
    """``forward`` checkpointed, its gradient-carrying inputs held in host memory."""

    def recompute(held: _HeldInputs, device_marker: torch.Tensor):
        args, kwargs = held.arguments()
        return forward(*args, **kwargs)

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        held = _HeldInputs(swapper, *without_cache(args, kwargs))
        device_marker = torch.empty(0, device=held.device())  # [Note: random state ...]
        out = checkpoint(recompute, held, device_marker, use_reentrant=False)
        held.release(out)
        return out

    return run
