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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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

TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
DEFAULT_MIN_NUM_PARAMS = int(1e8)  # accelerate's and FSDP1's default


@dataclass(frozen=True)
class FSDP2Settings:
    auto_wrap_policy: str
    layer_classes: tuple[str, ...] = ()  # TRANSFORMER_BASED_WRAP
    min_num_params: int = DEFAULT_MIN_NUM_PARAMS  # SIZE_BASED_WRAP
    reshard_after_forward: bool = True
    offload_params: bool = False
    param_dtype: torch.dtype | None = None  # None: compute in the parameters' dtype


def transformer_units(model: nn.Module, layer_classes: Iterable[str]) -> list[str]:
    """Names of the modules whose class is listed, children before parents (root excluded)."""
    wanted = set(layer_classes)
    names = [n for n, m in model.named_modules() if n and type(m).__name__ in wanted]
    return names[::-1]  # named_modules is parents first


def size_based_units(model: nn.Module, min_num_params: int) -> list[str]:
    """Names of the units FSDP1's size-based policy would wrap, children before parents
    (root excluded: it is always a unit)."""
    tied_outside = _tied_across(model)
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
        return transformer_units(model, settings.layer_classes)
    if settings.auto_wrap_policy == SIZE_BASED_WRAP:
        return size_based_units(model, settings.min_num_params)
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
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return units
