"""Module and parameter hooks that drive the chunk manager during forward and backward.

All through public extension points:

- root ``register_forward_pre_hook``: a new forward begins (prefetch the first chunks);
- per module owning parameters, ``register_forward_pre_hook``: gather its chunks and pin them
  while it runs (this also covers recomputation under activation checkpointing, which calls
  the module again inside backward);
- the matching ``register_forward_hook``: unpin, and put a ``Tensor.register_hook`` on each
  output that needs a gradient. That hook runs just before autograd runs the node producing
  the output, which is the module's backward: it gathers the module's chunks again. Module
  full-backward hooks are not used: they wrap outputs in a custom function and break on
  in-place use of outputs;
- per trainable parameter, ``register_post_accumulate_grad_hook``: hand the gradient to the
  gradient sink.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from protrain.chunks.manager import ChunkManager
from protrain.runtime.grad_offload import GradSink


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class RuntimeHooks:
    def __init__(self, model: nn.Module, manager: ChunkManager, sink: GradSink):
        self.manager = manager
        self.handles: list = []
        chunk_of = {s.param: s.chunk for s in manager.slots()}
        self.handles.append(model.register_forward_pre_hook(self._root_pre_forward))
        for module in model.modules():
            ids = sorted({chunk_of[p] for p in module.parameters(recurse=False) if p in chunk_of})
            ids = [i for i in ids if not manager.chunks[i].persistent]
            if not ids:
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(ids)))
            self.handles.append(module.register_forward_hook(self._post_forward(ids)))
        for s in manager.slots():
            if s.master is not None:
                self.handles.append(
                    s.param.register_post_accumulate_grad_hook(sink.on_grad_accumulated)
                )

    def _root_pre_forward(self, module, args):
        self.manager.begin_forward()

    def _pre_forward(self, ids: list[int]):
        def hook(module, args):
            self.manager.use(ids, pin=True)

        return hook

    def _post_forward(self, ids: list[int]):
        manager = self.manager

        def pre_backward(grad):
            manager.begin_backward()
            manager.use(ids, pin=False)
            return grad

        def hook(module, args, output):
            manager.unpin(ids)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(pre_backward)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
