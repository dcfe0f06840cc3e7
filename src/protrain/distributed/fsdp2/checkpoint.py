"""The FSDP2 engine's trainable state as flat pieces, in the keys of
``protrain.distributed.dcp_state`` (``model/<name>``, ``optim/<name>/<state>``): a sharded
checkpoint that every rank of ``fully_shard`` writes in parallel, with no gather, and that
the chunked engine, plain PyTorch or FSDP2 resume at any world size.

``fully_shard`` splits each parameter along dim 0 as ``torch.chunk`` does: over a mesh of
W ranks, rank r holds rows ``[r * c, min((r + 1) * c, n0))`` with ``c = ceil(n0 / W)``
(none where that is empty). A row-major tensor's rows are a contiguous range of its
flattened elements, so each rank's shard is one flat piece at offset ``r * c * row``.
DCP's own DTensor support would do the same for FSDP2 alone; the flat keys are what lets
a checkpoint move between engines whose shards are unrelated (the chunked engine shards
chunks, not parameters).

Pieces are fp32, as the chunked engine's masters: a shard held in another dtype is saved
through an fp32 copy and loaded through one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from protrain.distributed.dcp_flat import FlatPiece, saved_keys
from protrain.distributed.dcp_state import (
    STEP,
    even_slice,
    model_key,
    optim_key,
    saved_moments,
)


def _flat_range(name: str, param: torch.Tensor, rank: int, world: int) -> tuple[int, int]:
    """The flat elements ``[a, b)`` of ``param`` this rank holds."""
    numel = param.numel()
    if not isinstance(param, DTensor):  # held whole on every rank: an even share each
        return even_slice(numel, rank, world)
    if tuple(param.placements) != (Shard(0),) or param.device_mesh.ndim != 1:
        raise ValueError(
            f"protrain: {name} is sharded as {param.placements} over a {param.device_mesh.ndim}-D "
            "mesh; a sharded checkpoint of the FSDP2 engine takes Shard(0) over one mesh dim"
        )
    n0 = param.shape[0]
    per_row = numel // n0 if n0 else 0
    mesh_size = param.device_mesh.size()
    coord = param.device_mesh.get_coordinate()
    position = coord[0] if coord else 0
    rows = -(-n0 // mesh_size)
    start = min(position * rows, n0)
    local_rows = param.to_local().shape[0]
    if local_rows != max(0, min(rows, n0 - start)):
        raise ValueError(
            f"protrain: {name}'s shard on mesh position {position} has {local_rows} rows, "
            f"not the {max(0, min(rows, n0 - start))} of an even dim-0 split of {n0}"
        )
    return start * per_row, (start + local_rows) * per_row


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _own(local: torch.Tensor, a: int, b: int, whole: bool) -> torch.Tensor:
    """The elements ``[a, b)`` of a whole tensor, or a shard's own elements (all of them)."""
    flat = local.detach().reshape(-1)
    return flat[a:b] if whole else flat


@torch.no_grad()
def fsdp2_pieces_to_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str], rank: int, world: int
) -> list[FlatPiece]:
    """This rank's pieces of the trainable state of ``names``: its shard of each parameter
    and of its AdamW moments, the step count from the rank holding element 0."""
    params = dict(model.named_parameters())
    pieces = []
    for name in names:
        param = params[name]
        a, b = _flat_range(name, param, rank, world)
        if b <= a:
            continue
        whole = not isinstance(param, DTensor)
        n = param.numel()
        pieces.append(FlatPiece(model_key(name), _own(_local(param), a, b, whole).float(), a, n))
        for k, v in optimizer.state.get(param, {}).items():
            if not torch.is_tensor(v):
                raise ValueError(f"protrain: optimizer state {k!r} of {name} is not a tensor")
            local = _local(v)
            if local.dim() == 0:
                if a == 0:
                    pieces.append(FlatPiece(optim_key(name, k), local.reshape(1).float(), 0, 1))
            else:
                pieces.append(FlatPiece(optim_key(name, k), _own(local, a, b, whole).float(), a, n))
    return [FlatPiece(p.key, p.tensor.contiguous(), p.offset, p.total) for p in pieces]


@dataclass
class FSDP2Load:
    """Where a load writes (``pieces``, fp32), and what :meth:`apply` then puts in place."""

    optimizer: torch.optim.Optimizer
    pieces: list[FlatPiece] = field(default_factory=list)
    # (destination, fp32 buffer read into) for every shard read through a buffer
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    states: list[tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]] = field(
        default_factory=list
    )
    no_state: list[torch.Tensor] = field(default_factory=list)

    @torch.no_grad()
    def apply(self) -> None:
        for dst, buf in self.copies:
            dst.copy_(buf.view_as(dst))
        for param, moments, step in self.states:
            group = next(
                g for g in self.optimizer.param_groups if any(p is param for p in g["params"])
            )
            # as torch's AdamW makes it: on the parameter's device when fused or capturable
            on_device = group.get("fused") or group.get("capturable")
            device = _local(param).device if on_device else torch.device("cpu")
            self.optimizer.state[param] = {STEP: step.view(()).to(device, copy=True), **moments}
        for param in self.no_state:
            self.optimizer.state.pop(param, None)


@torch.no_grad()
def plan_fsdp2_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str], directory, rank: int,
    world: int,
) -> FSDP2Load:  # fmt: skip
    """The pieces this rank reads from the checkpoint in ``directory``: its shard of each
    parameter (in place when fp32) and of each AdamW moment (into fresh shards of the
    parameter's sharding). Call :meth:`FSDP2Load.apply` once they are read."""
    params = dict(model.named_parameters())
    saved = saved_keys(directory)
    load = FSDP2Load(optimizer)
    for name in names:
        param = params[name]
        whole = not isinstance(param, DTensor)
        a, b = (0, param.numel()) if whole else _flat_range(name, param, rank, world)
        n = param.numel()
        local = _local(param)
        if b > a:
            load.pieces.append(FlatPiece(model_key(name), _target(load, local), a, n))
        keys = saved_moments(saved, name)
        if keys is None:
            load.no_state.append(param)
            continue
        step = torch.zeros(1, dtype=torch.float32)
        load.pieces.append(FlatPiece(optim_key(name, STEP), step, 0, 1))
        moments = {}
        for k in keys:
            moment = torch.zeros_like(param.detach(), dtype=torch.float32)
            if b > a:
                load.pieces.append(
                    FlatPiece(optim_key(name, k), _target(load, _local(moment)), a, n)
                )
            moments[k] = moment
        load.states.append((param, moments, step))
    return load


def _target(load: FSDP2Load, local: torch.Tensor) -> torch.Tensor:
    """Where a piece of ``local`` is read: ``local`` itself when an fp32 contiguous tensor,
    else an fp32 buffer copied in by :meth:`FSDP2Load.apply`."""
    if local.dtype == torch.float32 and local.is_contiguous():
        return local.detach().view(-1)
    buf = torch.empty(local.numel(), dtype=torch.float32, device=local.device)
    load.copies.append((local, buf))
    return buf
