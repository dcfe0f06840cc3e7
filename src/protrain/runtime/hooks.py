"""Module and parameter hooks that drive the chunk manager during forward and backward.

All through public extension points:

- root ``register_forward_pre_hook``: a new forward begins (prefetch the first chunks);
- per module owning parameters, ``register_forward_pre_hook``: gather its chunks and pin them
  while it runs (this also covers recomputation under activation checkpointing, which calls
  the module again inside backward);
- the matching ``register_forward_hook``: unpin, and put a ``Tensor.register_hook`` on each
  output that needs a gradient. That hook runs just before autograd runs the node producing
  the output, which is the module's backward: it gathers the module's chunks again and pins
  them until the module's backward is over. Module full-backward hooks are not used: they
  wrap outputs in a custom function and break on in-place use of outputs;
- per trainable parameter, ``register_post_accumulate_grad_hook``: hand the gradient to the
  gradient sink, and mark the owning module's backward as over.

[Note: when a module's backward is over]
A chunk pinned for a module's backward must stay on the device until the autograd nodes of
that module have run: under activation checkpointing the recomputation of a whole block
runs in between (inside the unpack of a saved tensor) and gathers other chunks. Two signals
end the pin, whichever comes first: an input of the module has its gradient complete (a
``Tensor.register_hook`` on each input that needs a gradient, put in the forward pre-hook),
or every trainable parameter of the module has its gradient accumulated (autograd runs a
parameter's accumulation only after every node that used it). Hooks are used
rather than an identity autograd function on the inputs (FSDP's way) because extra nodes
change the order in which autograd sums gradients, and the engine must compute bit for bit
what plain PyTorch computes. A module whose inputs need no gradient and whose parameters are frozen
produces outputs that need none, so it never pins in backward. Pins left at the end of
backward are cleared when the next forward begins.

[Note: recomputation stops early]
PyTorch's non-reentrant checkpoint stops a recomputation as soon as it has the tensors it
needs, so the forward post-hooks of the modules after that point never run. Forward pins
taken during recomputation would leak; recomputation (a forward pre-hook while the phase is
backward) therefore gathers without pinning, and a call left on a module's stack by a
stopped recomputation is dropped at the next forward. A leaf module's own operations are
all enqueued before any other hook can evict its chunk, so only a module that owns
parameters *and* calls children with parameters relies on ``n_buffer`` being large enough
during recomputation.

[Note: where a forward begins]
A new forward resets the chunk pins and starts the prefetch of the first chunks, in forward
order (the manager's phase goes back to forward). The root module's forward pre-hook marks
it, but a caller may run the body without the root: a chunked loss calls
``model.base_model(...)`` for hidden states and the output embedding itself. Then nothing
marked the forward, the manager stayed in its backward phase, and every gather prefetched
in backward order: on an 8B LoRA run, 104 gathers per step where 19 were needed. The input
embedding is where every forward of a language model starts and which recomputation never
runs again (activation checkpointing covers blocks), so its pre-hook also begins a forward
when a backward ran since the last one. A user's checkpointed region that contains the input
embedding breaks that assumption: its recomputation inside backward begins a forward there
(pins reset, prefetch in forward order for the rest of that backward). The results stay
exact on tiny Llama, full and LoRA, but the traffic is no longer the modelled
one; ending the backward phase with a callback at the end of backward would remove it.

[Note: parameters read without a call]
Some forwards read parameters without calling the module that owns them: peft's
``ParamWrapper`` (LoRA on fused MoE experts and routers) folds ``lora_B @ lora_A`` into the
expert weights and never calls ``lora_A``/``lora_B``; a ``ParameterList`` is read by the
module around it. Such a parameter's chunk was never gathered: "data is not allocated yet",
or a segmentation fault inside ``baddbmm``, or a right result while the chunk happened to be
resident. ``protrain.model.readers`` finds these reads (a decision made at wrap time, and
in the planner's buffer count); here the reading module's call gathers and pins them with
its own parameters, in forward, recomputation and backward, and its backward pin ends as
any module's. A reader gathers in recomputation too, where it calls children that gather
(the experts inside a ``ParamWrapper``): unpinned, its chunks could be evicted by theirs
before it reads them, so it pins, and its post-hook runs even when the recomputation stops
inside it (``always_call``), which gives the pin back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from protrain.chunks.manager import ChunkManager, Phase
from protrain.model.readers import DirectReads, direct_reads, has_forward
from protrain.runtime.grad_offload import GradSink


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        return None
    try:
        module = get()
    except (NotImplementedError, AttributeError):
        return None
    return module if isinstance(module, nn.Module) else None


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class _Call:
    """One call of a module: whether its backward pin is held."""

    __slots__ = ("ids", "forward_pinned", "pinned", "done")

    def __init__(self, ids: list[int]):
        self.ids, self.forward_pinned, self.pinned, self.done = ids, False, False, False


class RuntimeHooks:
    def __init__(
        self,
        model: nn.Module,
        manager: ChunkManager,
        sink: GradSink,
        reads: DirectReads | None = None,
    ):
        """``reads``: what each module's call brings in besides its own parameters
        (``protrain.model.readers.direct_reads``; computed here when not given). See
        [Note: parameters read without a call]."""
        self.manager = manager
        self._sink = sink
        self.handles: list = []
        self._pinned_calls: dict[int, list[_Call]] = {}  # id(module) -> calls pinned in backward
        self._stacks: list[list[_Call]] = []  # per module: calls between pre- and post-hook
        self._n_trainable: dict[int, int] = {}  # id(module) -> its own trainable parameters
        self._params_done: dict[int, set] = {}  # id(module) -> those with gradients this pass
        chunk_of = {s.param: s.chunk for s in manager.slots()}
        self.handles.append(model.register_forward_pre_hook(self._root_pre_forward))
        # See [Note: where a forward begins].
        entry = _input_embeddings(model)
        if entry is not None and entry is not model:
            self.handles.append(
                entry.register_forward_pre_hook(self._entry_pre_forward, prepend=True)
            )
        if reads is None:
            reads = direct_reads(model)
        extra: dict[int, list[nn.Parameter]] = {}
        for name, names in reads.groups.items():
            extra.setdefault(id(model.get_submodule(name)), []).extend(
                model.get_parameter(n) for n in names
            )
        owners: dict[nn.Parameter, list[nn.Module]] = {}
        for module in model.modules():
            if not has_forward(module):  # never called: an enclosing module covers it
                continue
            reader = id(module) in extra
            own = list(
                dict.fromkeys([*module.parameters(recurse=False), *extra.get(id(module), [])])
            )
            ids = sorted({chunk_of[p] for p in own if p in chunk_of})
            ids = [i for i in ids if not manager.chunks[i].persistent]
            if not ids:
                continue
            for p in own:
                owners.setdefault(p, []).append(module)
            self._n_trainable[id(module)] = sum(1 for p in own if p.requires_grad)
            stack: list[_Call] = []
            self._stacks.append(stack)
            self.handles.append(
                module.register_forward_pre_hook(
                    self._pre_forward(ids, stack, pin_in_recompute=reader), with_kwargs=True
                )
            )
            # A reader pins in recomputation too, so its post-hook must run even when the
            # recomputation stops inside it: see [Note: parameters read without a call].
            self.handles.append(
                module.register_forward_hook(self._post_forward(ids, stack), always_call=reader)
            )
        for s in manager.slots():
            if s.master is not None:
                self.handles.append(
                    s.param.register_post_accumulate_grad_hook(sink.on_grad_accumulated)
                )
                if s.param in owners:
                    self.handles.append(
                        s.param.register_post_accumulate_grad_hook(
                            self._param_done(owners[s.param])
                        )
                    )

    def _root_pre_forward(self, module, args):
        reducer = self._sink.reducer
        if reducer is not None and torch._C._current_graph_task_id() < 0:
            reducer.abandon_backward()  # a backward that raised left its state behind
        self.manager.begin_forward()
        self._pinned_calls.clear()
        self._params_done.clear()
        for stack in self._stacks:
            stack.clear()

    def _entry_pre_forward(self, module, args):
        if self.manager.phase is Phase.BACKWARD:  # a backward ran since the last forward
            self._root_pre_forward(module, args)

    def _pre_forward(self, ids: list[int], stack: list[_Call], pin_in_recompute: bool = False):
        def hook(module, args, kwargs):
            # See [Note: recomputation stops early] for why recomputation takes no pin.
            pin = pin_in_recompute or self.manager.phase is not Phase.BACKWARD
            self.manager.use(ids, pin=pin)
            call = _Call(ids)
            call.forward_pinned = pin
            stack.append(call)
            if torch.is_grad_enabled():
                for t in _tensors((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(self._input_grad_hook(call))

        return hook

    def _post_forward(self, ids: list[int], stack: list[_Call]):
        manager = self.manager

        def hook(module, args, output):
            call = stack.pop() if stack else _Call(ids)
            if call.forward_pinned:
                manager.unpin(ids)
            if not torch.is_grad_enabled():
                return
            key = id(module)

            def pre_backward(grad):
                manager.begin_backward()
                if not call.pinned and not call.done:
                    call.pinned = True
                    manager.use(ids, pin=True)
                    self._pinned_calls.setdefault(key, []).append(call)
                else:
                    manager.use(ids, pin=False)
                return grad

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(pre_backward)

        return hook

    def _input_grad_hook(self, call: _Call):
        def hook(grad):
            self._end_backward_pin(call)
            return grad

        return hook

    def _end_backward_pin(self, call: _Call) -> None:
        if call.pinned and not call.done:
            self.manager.unpin(call.ids)
        call.done = True

    def _param_done(self, modules: list[nn.Module]):
        def hook(param):
            for m in modules:
                done = self._params_done.setdefault(id(m), set())
                done.add(param)
                if len(done) == self._n_trainable[id(m)]:
                    for call in self._pinned_calls.pop(id(m), []):
                        self._end_backward_pin(call)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._pinned_calls.clear()
