"""Swap: the tensors a block saves for backward live in host memory between forward and backward.

During the block's forward a ``torch.autograd.graph.saved_tensors_hooks`` pair replaces each
saved activation by a handle to a host copy of its storage, copied on the transfer's
``d2h_stream`` (see :mod:`protrain.activations.transfer`). Parameters (and views of them)
are not activations and stay as they are: the chunk runtime owns where they live. Views of
one storage share one host copy.

In backward, when the gradient of a swapped block's output arrives (a tensor hook: the block's
backward is about to begin), its group of copies is brought back, and so are the groups of
the next ``prefetch_groups`` swapped blocks in backward order, on ``h2d_stream``. A device
copy is dropped as soon as the last saved tensor over it has been unpacked. So about
``prefetch_groups + 1`` groups are on the device at once (one more while a block's last
weight-gradient nodes run after the next block's backward has begun).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from protrain.activations.transfer import HostCopy, HostTransfer, storage_bytes, view_of


def is_parameter_like(t: torch.Tensor) -> bool:
    """A parameter, a leaf that needs a gradient, or a view of one: not an activation."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


def output_tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from output_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from output_tensors(o)


class SwapGroup:
    """The host copies made during one call of one block; ``order`` counts forward calls."""

    def __init__(self, order: int):
        self.order = order
        self.copies: dict[int, HostCopy] = {}  # storage data_ptr -> copy, while forward runs
        self.pending: dict[int, int] = {}  # id(copy) -> unpacks still to come
        self.sources: list[
            torch.Tensor
        ] = []  # keeps storages (and their data_ptr) alive in forward
        self.open = True
        self.fetched = False
        self.nbytes = 0

    def __repr__(self) -> str:
        return f"SwapGroup(order={self.order}, {len(self.copies)} storages, {self.nbytes} bytes)"


class _Packed:
    """What autograd holds instead of a swapped tensor."""

    __slots__ = ("group", "copy", "dtype", "offset", "size", "stride")

    def __init__(self, group, copy, t: torch.Tensor):
        self.group, self.copy = group, copy
        self.dtype, self.offset = t.dtype, t.storage_offset()
        self.size, self.stride = t.size(), t.stride()


class ActivationSwapper:
    """Swaps saved tensors of the blocks given the ``swap`` policy; one per model."""

    def __init__(
        self,
        device: torch.device | str,
        *,
        max_in_flight_bytes: int = 1 << 30,
        prefetch_groups: int = 1,
        transfer: HostTransfer | None = None,
    ):
        self.transfer = transfer or HostTransfer(device, max_in_flight_bytes)
        self.device = self.transfer.device
        self.prefetch_groups = prefetch_groups
        self._order = itertools.count()
        self._groups: list[weakref.ref[SwapGroup]] = []  # forward order, live ones only

    # -- forward -------------------------------------------------------------------------------

    def open_group(self) -> SwapGroup:
        group = SwapGroup(next(self._order))
        self._groups = [r for r in self._groups if r() is not None]
        self._groups.append(weakref.ref(group))
        return group

    def saving_to(self, group: SwapGroup) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(group, t), self.unpack)

    def pack(self, group: SwapGroup, t: torch.Tensor):
        if (
            type(t) is not torch.Tensor
            or t.layout is not torch.strided
            or t.device != self.device
            or is_parameter_like(t)
        ):
            return t
        key = t.untyped_storage().data_ptr()
        copy = group.copies.get(key) if group.open else None
        if copy is None:
            source = storage_bytes(t)
            copy = self.transfer.to_host(source)
            group.copies[key] = copy
            group.sources.append(source)
            group.pending[id(copy)] = 0
            group.nbytes += copy.nbytes
        group.pending[id(copy)] += 1
        return _Packed(group, copy, t)

    def close_group(self, group: SwapGroup, output) -> None:
        """End of the block's forward: drop the sources and watch for the block's backward."""
        group.open = False
        group.sources.clear()
        group.copies = {id(c): c for c in group.copies.values()}
        ref = weakref.ref(group)

        def on_output_grad(grad):
            g = ref()
            if g is not None:
                self.begin_backward(g)

        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(on_output_grad)

    # -- backward ------------------------------------------------------------------------------

    def begin_backward(self, group: SwapGroup) -> None:
        """``group``'s block is about to run backward: fetch it and prefetch the next groups."""
        self._fetch(group)
        self._prefetch_after(group)

    def _fetch(self, group: SwapGroup) -> None:
        if group.fetched:
            return
        group.fetched = True
        for copy in group.copies.values():
            if group.pending.get(id(copy), 0) > 0:
                self.transfer.to_device(copy)

    def _prefetch_after(self, group: SwapGroup) -> None:
        earlier = [g for r in self._groups if (g := r()) is not None and g.order < group.order]
        earlier.sort(key=lambda g: g.order, reverse=True)
        for g in earlier[: self.prefetch_groups]:
            self._fetch(g)

    def unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        group, copy = packed.group, packed.copy
        dev = self.transfer.wait_ready(copy)
        out = view_of(dev, packed.dtype, packed.offset, packed.size, packed.stride)
        left = group.pending[id(copy)] = group.pending[id(copy)] - 1
        if left <= 0:
            self.transfer.release(copy)  # the last saved tensor over this storage is unpacked
        return out

    def synchronize(self) -> None:
        self.transfer.synchronize()


def swapped_forward(forward: Callable, swapper: ActivationSwapper) -> Callable:
    """``forward`` with the tensors it saves for backward swapped to host memory."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        group = swapper.open_group()
        with swapper.saving_to(group):
            out = forward(*args, **kwargs)
        swapper.close_group(group, out)
        return out

    return run
