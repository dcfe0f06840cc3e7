"""FSDP2 wrap policies and their application: which modules become `fully_shard` units.

A *unit* is a module handed to `torch.distributed.fsdp.fully_shard`: its parameters not
already in a unit below it are sharded over the ranks, gathered before its forward and
backward and reduce-scattered after its backward. The root is always a unit, last, so
whatever no policy claimed (embeddings, the final norm, the head) lands there.

- `TRANSFORMER_BASED_WRAP`: every module whose class name is listed (by default the
  blocks `protrain.model.discover_blocks` finds) is a unit.
- `SIZE_BASED_WRAP`: FSDP1's `size_based_auto_wrap_policy` decisions, taken by the same
  recursion: walk down while a module holds at least `min_num_params` parameters; after its
  children, a module is a unit when the parameters left over (not in a unit below it) still
  reach `min_num_params`, so small consecutive children are grouped with their parent.
  `nn.ModuleList`/`nn.ModuleDict` are never units. A module holding one side of a tied
  parameter is not a unit either (the other side would use a resharded weight).

[Note: gradients summed over ranks]
Each rank's loss is already divided by the tokens of the whole global batch
(`train/ranks.py`), so the gradient of the job is the SUM over ranks. FSDP2 divides the
reduce-scatter by the world size by default (DDP's mean); `set_gradient_divide_factor(1.0)`
on every unit makes it a sum, and `set_force_sum_reduction_for_comms(True)` issues it as a
plain `ReduceOp.SUM` (a factor alone becomes NCCL's `PREMUL_SUM`, which gloo refuses).
Each micro-batch's backward reduce-scatters, and the shards accumulate the sums: the step's
gradient is (sum over ranks of micro-batch 1) + (sum over ranks of micro-batch 2) + ...,
in that order (two addends commute exactly, so with 2 ranks the sum of a micro-batch is
the same on every rank). fp32 addition is not associative: a reference that accumulates
every micro-batch one after another differs in the last bits, which AdamW turns into
updates of up to `lr * |g| / eps` where a gradient cancels to about zero.

[Note: explicit prefetch]
After sharding, each unit is told which unit's all-gather to issue next
(`FSDPModule.set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`, public
since torch 2.6), so that the next all-gather is in flight while this unit computes. The
orders are taken from the module tree, assuming children run in the order they are
registered (as in Hugging Face decoder stacks): forward, the root then the units in
pre-order (a unit's pre-forward runs before those of the units nested in it); backward,
the reverse of the units' post-order (a unit's outputs come after those of the units nested
in it, so its pre-backward fires first). The first forward run with gradients checks this
with hooks on the units (the order their forwards began and ended); where the units ran
otherwise (a vision-language model embeds its text before its vision tower runs, though
the tower is registered first), they are told the order that ran, with a warning. A unit whose subtree holds no parameter at or after
the first trainable one (a frozen embedding under LoRA) is left out of the backward order:
its outputs need no gradient, its pre-backward never fires, and a prefetch of it would be
an all-gather for nothing. An empty backward list is FSDP2's own default (prefetch by the
reverse post-forward order recorded in the first step), which `backward_prefetch=False`
keeps.

[Note: modules that are never units]
A unit's collectives run from its module's hooks, once per call. `not_units` names modules
whose hooks would run a different number of times on different ranks, or not at all: the
output embedding under the chunked loss (called once per chunk of tokens, a number that
follows each rank's sequence length), the modules between the root and the causal-LM body
that the chunked loss calls past, and the children of a tiled MLP (called once per tile).
Their parameters stay in the nearest unit above them.

[Note: 4-bit weights under FSDP2]
bitsandbytes' `Linear4bit` keeps the packed NF4 bytes as its `weight` and the scales in a
`QuantState`. `prepare_4bit` stores the packed bytes as a frozen parameter of the
computing dtype (bytes reinterpreted, not converted: bitsandbytes' `quant_storage`, as
FSDP-QLoRA does), so a unit's parameters share one dtype and FSDP2 shards, gathers and
casts none of them differently (a float storage equal to `param_dtype` is never cast).
The `QuantState` (block scales, about 1/32 of the packed bytes with double quantization)
is kept whole on every rank on the device, as in FSDP-QLoRA, and a forward pre-hook on
each layer hands it to the weight FSDP2 has just gathered (bitsandbytes reads it from
`weight.quant_state`).

[Note: the meshes outlive the model]
A gloo group must be freed before interpreter exit: its worker threads stop only then, and
one still releasing a finished collective when the interpreter finalizes aborts the
process after a passing run ([Note: the group is held weakly] in
`protrain/distributed/process_group.py`). Two things keep an FSDP2 engine's group after
`destroy_process_group`. The units hold it (`FSDPMeshInfo`) and, closed, are garbage in
reference cycles: `train/ranks.py`'s `stop_ranks` collects them before it ends the group.
And DTensor's caches keep every `DeviceMesh` they have seen (the sharding propagation's in
`torch/distributed/tensor/_sharding_prop.py` and its C++ fast path, the redistribution
planners of `_redistribute.py`, the mesh topology of `_collective_utils.py`), while a mesh
holds its groups (`DeviceMesh._pg_registry`, torch 2.13). torch has no public call to
empty those caches; `release_groups` instead empties the registry of the engine's own mesh
when it closes, so that the caches keep a mesh without its group. Outside `torch.compile`
a mesh finds its groups by name, so one used after that still works while the group lives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.utils._pytree import tree_leaves

from protrain.quant import is_4bit_linear

TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
logger = logging.getLogger("protrain.distributed.fsdp2")  # the engine's one logger

DEFAULT_MIN_NUM_PARAMS = int(1e8)  # accelerate's and FSDP1's default


@dataclass(frozen=True)
class FSDP2Settings:
    auto_wrap_policy: str
    layer_classes: tuple[str, ...] = ()  # TRANSFORMER_BASED_WRAP
    min_num_params: int = DEFAULT_MIN_NUM_PARAMS  # SIZE_BASED_WRAP
    reshard_after_forward: bool = True
    offload_params: bool = False
    param_dtype: torch.dtype | None = None  # None: compute in the parameters' dtype
    not_units: frozenset[str] = frozenset()  # [Note: modules that are never units]
    forward_prefetch: bool = False  # [Note: explicit prefetch]
    backward_prefetch: bool = True


def transformer_units(
    model: nn.Module, layer_classes: Iterable[str], not_units: Iterable[str] = ()
) -> list[str]:
    """Names of the modules whose class is listed, children before parents (root and
    `not_units` excluded)."""
    wanted, skip = set(layer_classes), set(not_units)
    names = [
        n for n, m in model.named_modules() if n and type(m).__name__ in wanted and n not in skip
    ]
    return names[::-1]  # named_modules is parents first


def size_based_units(
    model: nn.Module, min_num_params: int, not_units: Iterable[str] = ()
) -> list[str]:
    """Names of the units FSDP1's size-based policy would wrap, children before parents
    (root excluded: it is always a unit; a module in `not_units` is never one, its
    parameters counted with its parent's)."""
    tied_outside = _tied_across(model) | set(not_units)
    units: list[str] = []

    def visit(module: nn.Module, name: str) -> int:  # the parameters wrapped under it
        numel = sum(p.numel() for p in module.parameters())
        if not size_based_auto_wrap_policy(module, True, numel, min_num_params=min_num_params):
            return 0
        wrapped = 0
        for child_name, child in module.named_children():
            wrapped += visit(child, f"{name}.{child_name}" if name else child_name)
        left = numel - wrapped
        if (
            name
            and name not in tied_outside
            and size_based_auto_wrap_policy(module, False, left, min_num_params=min_num_params)
        ):
            units.append(name)
            return numel
        return wrapped

    visit(model, "")
    return units


def _tied_across(model: nn.Module) -> set[str]:
    """Modules holding a parameter that is also used outside them (tied weights)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name.rpartition(".")[0])
    out: set[str] = set()
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for mod in modules:
            prefix = mod.split(".")
            for i in range(1, len(prefix) + 1):
                candidate = ".".join(prefix[:i])
                inside = [m for m in modules if m == candidate or m.startswith(candidate + ".")]
                if len(inside) < len(modules):
                    out.add(candidate)
    return out


def choose_units(model: nn.Module, settings: FSDP2Settings) -> list[str]:
    if settings.auto_wrap_policy == TRANSFORMER_BASED_WRAP:
        return transformer_units(model, settings.layer_classes, settings.not_units)
    if settings.auto_wrap_policy == SIZE_BASED_WRAP:
        return size_based_units(model, settings.min_num_params, settings.not_units)
    raise ValueError(f"unknown auto_wrap_policy {settings.auto_wrap_policy!r}")


def apply_fsdp2(model: nn.Module, settings: FSDP2Settings, mesh: DeviceMesh) -> list[str]:
    """`fully_shard` each unit the policy chooses, then the root; gradients summed over
    ranks ([Note: gradients summed over ranks]). Returns the units' names."""
    units = choose_units(model, settings)
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
        if settings.offload_params
        else OffloadPolicy()
    )
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=settings.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=settings.param_dtype, reduce_dtype=torch.float32
        ),
        offload_policy=offload,
    )
    for name in units:
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    set_prefetch(model, units, settings.forward_prefetch, settings.backward_prefetch)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        if is_4bit_linear(module):  # after fully_shard: FSDP2's own pre-hook gathers first
            module.quant_state.to(_mesh_device(mesh))
            module.register_forward_pre_hook(_hand_over_quant_state)
    return units


@dataclass(frozen=True)
class PrefetchOrder:
    """The units in the order their all-gathers are needed ("" is the root)."""

    forward: tuple[str, ...]
    backward: tuple[str, ...]

    def neighbours(self) -> dict[str, tuple[str | None, str | None]]:
        """Each unit's (forward, backward) prefetch target: the next one in each order."""
        out: dict[str, list[str | None]] = {name: [None, None] for name in self.forward}
        for i, order in enumerate((self.forward, self.backward)):
            for current, following in zip(order, order[1:]):
                out.setdefault(current, [None, None])[i] = following
        return {name: (fwd, bwd) for name, (fwd, bwd) in out.items()}


def prefetch_order(model: nn.Module, units: Iterable[str]) -> PrefetchOrder:
    """Forward and backward orders of the root and ``units`` ([Note: explicit prefetch])."""
    wanted = set(units) | {""}
    pre = [name for name, _ in model.named_modules() if name in wanted]
    post: list[str] = []
    open_units: list[str] = []
    for name in pre:
        while open_units and not _inside(name, open_units[-1]):
            post.append(open_units.pop())
        open_units.append(name)
    post.extend(reversed(open_units))
    # positions of the parameters in registration order; the first trainable one
    index = {id(p): i for i, p in enumerate(model.parameters())}
    first_trainable = min(
        (index[id(p)] for p in model.parameters() if p.requires_grad), default=len(index)
    )

    def has_backward(name: str) -> bool:
        last = max((index[id(p)] for p in model.get_submodule(name).parameters()), default=-1)
        return name == "" or last >= first_trainable

    backward = tuple(name for name in reversed(post) if has_backward(name))
    return PrefetchOrder(forward=tuple(pre), backward=backward)


def _inside(name: str, parent: str) -> bool:
    return parent == "" or name.startswith(parent + ".")


def set_prefetch(
    model: nn.Module, units: Iterable[str], forward: bool, backward: bool
) -> PrefetchOrder:
    """Each sharded unit prefetches the next one of each order ([Note: explicit prefetch]);
    the first forward with gradients checks the orders against the units that ran."""
    order = prefetch_order(model, units)
    if forward or backward:
        _apply_order(model, order, forward, backward)
        _OrderCheck(model, order, forward, backward)
    return order


def _apply_order(model: nn.Module, order: PrefetchOrder, forward: bool, backward: bool) -> None:
    for name, (fwd, bwd) in order.neighbours().items():
        module = model.get_submodule(name)
        assert isinstance(module, FSDPModule), name
        if forward:
            module.set_modules_to_forward_prefetch([model.get_submodule(fwd)] if fwd else [])
        if backward:
            module.set_modules_to_backward_prefetch([model.get_submodule(bwd)] if bwd else [])


class _OrderCheck:
    """Forward hooks on every unit for the first forward run with gradients: the order the
    units' forwards began (the forward order) and the reverse of the order they ended, kept
    where their output needs a gradient (the backward order). Where the module tree's orders
    differ, the units are told the ones that ran, with a warning; then the hooks go."""

    def __init__(self, model: nn.Module, order: PrefetchOrder, forward: bool, backward: bool):
        self.model, self.order, self.forward, self.backward = model, order, forward, backward
        self.began: list[str] = []
        self.ended: list[str] = []
        self.handles = []
        for name in order.forward:
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            if name == "":
                self.began, self.ended = [], []
            if torch.is_grad_enabled() and name not in self.began:
                self.began.append(name)

        return hook

    def _post(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or name in self.ended:
                return
            tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
            if name == "" or not tensors or any(t.requires_grad for t in tensors):
                self.ended.append(name)
            if name == "":
                self._done()

        return hook

    def _done(self) -> None:
        for handle in self.handles:
            handle.remove()
        ran = PrefetchOrder(forward=tuple(self.began), backward=tuple(reversed(self.ended)))
        if (not self.forward or ran.forward == self.order.forward) and (
            not self.backward or ran.backward == self.order.backward
        ):
            return
        logger.warning(
            "fsdp2 prefetch: the units ran in another order than the module tree's "
            "(forward %s, backward %s); prefetching in the order they ran",
            _first_difference(self.order.forward, ran.forward),
            _first_difference(self.order.backward, ran.backward),
        )
        _apply_order(self.model, ran, self.forward, self.backward)


def _first_difference(planned: tuple[str, ...], ran: tuple[str, ...]) -> str:
    for i, (a, b) in enumerate(zip(planned, ran)):
        if a != b:
            return f"at {i}: {b or 'the root'!r} instead of {a or 'the root'!r}"
    if len(planned) == len(ran):
        return "as planned"
    return f"{len(ran)} units instead of {len(planned)}"


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def release_groups(mesh: DeviceMesh) -> None:
    """``mesh`` no longer holds its process groups ([Note: the meshes outlive the model])."""
    registry = getattr(mesh, "_pg_registry", None)  # private, torch 2.13
    if registry is not None:
        registry.clear()


# -- 4-bit base weights ([Note: 4-bit weights under FSDP2])


@torch.no_grad()
def prepare_4bit(model: nn.Module, storage_dtype: torch.dtype) -> int:
    """Store the packed weight of every bitsandbytes `Linear4bit` of ``model`` as a frozen
    parameter of ``storage_dtype`` (the same bytes), before `apply_fsdp2`, which moves
    the `QuantState` whole to the device; returns how many layers. The scales the chunk
    engine lifts into parameters (`protrain.quant.lift_quant_state`) become plain tensors
    of the state again."""
    layers = [(n, m) for n, m in model.named_modules() if is_4bit_linear(m)]
    if not layers:
        return 0
    if not storage_dtype.is_floating_point:
        raise ValueError(
            f"4-bit weights under FSDP2 are stored in a float dtype, not {storage_dtype}"
        )
    size = torch.empty((), dtype=storage_dtype).element_size()
    for name, layer in layers:
        weight = layer.weight
        state = getattr(weight, "quant_state", None) or getattr(layer, "quant_state", None)
        if state is None:
            raise ValueError(f"{name}: a Linear4bit whose weight is not quantized yet")
        for lifted in ("quant_absmax", "quant_absmax2"):
            layer._parameters.pop(lifted, None)
        packed = weight.data.reshape(-1)
        if packed.dtype != storage_dtype:
            if packed.numel() * packed.element_size() % size:
                raise ValueError(
                    f"{name}: {packed.numel() * packed.element_size()} packed bytes do not "
                    f"divide into {storage_dtype} elements of {size} bytes"
                )
            packed = packed.view(torch.uint8).view(storage_dtype)
        layer.weight = nn.Parameter(packed.unsqueeze(1), requires_grad=False)
        layer.quant_state = state
        layer.quant_storage = storage_dtype
        # bitsandbytes repacks a CPU layer's weight in eval mode on CPUs with AVX512-BF16:
        # the shard FSDP2 holds must keep the training layout
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def _hand_over_quant_state(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a 4-bit layer: its scales on the weight FSDP2 just gathered."""
    if getattr(module.weight, "quant_state", None) is not module.quant_state:
        module.weight.quant_state = module.quant_state
