"""A wrapped model's trainable state as flat pieces, named by parameter: what a sharded
checkpoint saves from each rank and loads back at any world size, mode or chunk size.

Keys (``protrain.distributed.dcp_flat``: 1-D tensors, each rank holding element ranges):

    model/<name>           the fp32 master, flattened
    optim/<name>/<state>   each Adam state tensor of the parameter's shape (``exp_avg``,
                           ``exp_avg_sq``), flattened
    optim/<name>/step      a one-element tensor: the parameter's step count

Compact host moments (``optimizer_state`` bf16 or 8bit) are saved decoded to fp32 and
encoded again over the elements a rank holds when loaded (``HybridAdamW.checkpoint_state``).

Which elements a rank writes: its own ``[lo, hi)`` of a parameter of a sharded chunk (the
elements it alone holds; possibly none); an equal ``1/world`` slice of any parameter every
rank holds whole (persistent chunks, the replicated mode, one rank), so that replicated
values are written once and all ranks write in parallel. The step count is written by the
rank that writes element 0. A load asks each rank for what it holds: its own elements of
a sharded chunk's parameter, the whole of any other; DCP reads the overlaps.

Only trainable parameters are saved (frozen ones, an adapter's base or 4-bit weights, are
rebuilt from their source), as in the one-process checkpoint format.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from protrain.chunks.chunk import ParamSlot
from protrain.distributed.dcp_flat import FlatPiece, saved_keys

MODEL = "model/"
OPTIM = "optim/"
STEP = "step"


def model_key(name: str) -> str:
    return f"{MODEL}{name}"


def optim_key(name: str, state: str) -> str:
    return f"{OPTIM}{name}/{state}"


def even_slice(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s elements of a value every rank holds whole: ``1/world`` of them."""
    return rank * numel // world, (rank + 1) * numel // world


def _engine(model: nn.Module):
    engine = getattr(model, "_protrain_engine", None)
    if engine is None:
        raise RuntimeError("protrain: this model is not wrapped (or was closed)")
    return engine


def _slots_by_name(model: nn.Module, names: Iterable[str]) -> dict[str, ParamSlot]:
    engine = _engine(model)
    by_id = {id(s.param): s for s in engine.manager.slots()}
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        slot = by_id.get(id(params[name]))
        if slot is None or slot.master is None:
            raise ValueError(f"protrain: {name} is not a trainable parameter of the engine")
        out[name] = slot
    return out


def _adam_state(optimizer, slot: ParamSlot) -> dict:
    """The Adam state of one slot's master as a checkpoint holds it (empty before its first
    step): its inner optimizer's, with compact host moments decoded to fp32."""
    return optimizer.checkpoint_state(slot)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


@torch.no_grad()
def pieces_to_save(
    model: nn.Module, optimizer, names: list[str], rank: int, world: int
) -> list[FlatPiece]:
    """This rank's pieces of the trainable state of ``names`` (views: write them at once).
    Waits for the host optimizer first, as a state dict does; no collective."""
    optimizer.check_between_steps("a sharded checkpoint save")
    optimizer.synchronize()
    pieces = []
    for name, s in _slots_by_name(model, names).items():
        n = s.placement.numel
        if s.shard is not None:  # the rank's own elements, already flat
            lo, hi = s.shard
            a, b, base = lo, hi, lo
        else:
            a, b = even_slice(n, rank, world)
            base = 0
        if b <= a:
            continue
        own = slice(a - base, b - base)
        pieces.append(FlatPiece(model_key(name), _flat(s.master)[own], a, n))
        for k, v in _adam_state(optimizer, s).items():
            if not torch.is_tensor(v):
                raise ValueError(f"protrain: optimizer state {k!r} of {name} is not a tensor")
            if v.dim() == 0:
                if a == 0:  # one rank writes the step count
                    pieces.append(FlatPiece(optim_key(name, k), v.detach().reshape(1), 0, 1))
            else:
                pieces.append(FlatPiece(optim_key(name, k), _flat(v)[own], a, n))
    return pieces


def saved_moments(saved, name: str) -> list[str] | None:
    """The optimizer state keys a checkpoint holds for parameter ``name`` besides its step
    count; None where it holds no step (no step taken with a gradient for it yet)."""
    prefix = optim_key(name, "")
    keys = sorted(k[len(prefix) :] for k in saved if k.startswith(prefix))
    if STEP not in keys:
        return None
    return [k for k in keys if k != STEP]


@dataclass
class EngineLoad:
    """Where a load writes (``pieces``), and what :meth:`apply` then puts in place."""

    optimizer: object
    pieces: list[FlatPiece] = field(default_factory=list)
    masters: list[ParamSlot] = field(default_factory=list)
    # slot, its Adam moments (the master's shape), its one-element step count
    states: list[tuple[ParamSlot, dict[str, torch.Tensor], torch.Tensor]] = field(
        default_factory=list
    )
    no_state: list[ParamSlot] = field(default_factory=list)

    @torch.no_grad()
    def apply(self) -> None:
        """After the pieces are filled: each master into its chunk's host copy (offloaded)
        or device copy (persistent), cast; the Adam state into the inner optimizers."""
        for s in self.masters:
            (s.host_view if s.host_view is not None else s.device_view).copy_(s.master)
        for s, moments, step in self.states:
            # fused AdamW keeps its step as a 0-d fp32 tensor beside the parameter
            state = {STEP: step.view(()).to(s.master.device, copy=True), **moments}
            self.optimizer.load_checkpoint_state(s, state)
        for s in self.no_state:
            self.optimizer._opt_of(s).state.pop(s.master, None)


@torch.no_grad()
def plan_engine_load(model: nn.Module, optimizer, names: list[str], directory) -> EngineLoad:
    """The pieces this rank reads from the checkpoint in ``directory`` (its metadata says
    which parameters have optimizer state): each master in place, its own elements of a
    sharded chunk or the whole; Adam moments into fresh tensors of the master's shape.
    Call :meth:`EngineLoad.apply` once they are read."""
    optimizer.check_between_steps("a sharded checkpoint load")
    optimizer.synchronize()
    _engine(model).manager.release_all()  # device copies of offloaded chunks go stale
    saved = saved_keys(directory)
    load = EngineLoad(optimizer)
    for name, s in _slots_by_name(model, names).items():
        n = s.placement.numel
        lo, hi = s.shard if s.shard is not None else (0, n)
        if hi > lo:
            load.pieces.append(FlatPiece(model_key(name), s.master.view(-1), lo, n))
        load.masters.append(s)
        keys = saved_moments(saved, name)
        if keys is None:
            load.no_state.append(s)
            continue
        step = torch.zeros(1, dtype=torch.float32)
        load.pieces.append(FlatPiece(optim_key(name, STEP), step, 0, 1))
        moments = {}
        for k in keys:
            t = torch.zeros(hi - lo, dtype=torch.float32, device=s.master.device)
            if hi > lo:
                load.pieces.append(FlatPiece(optim_key(name, k), t, lo, n))
            moments[k] = t.view_as(s.master)
        load.states.append((s, moments, step))
    return load
