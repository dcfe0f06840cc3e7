"""One piece of a chunk's host update: torch's fused AdamW over flat views of its masters.

torch's fused CPU AdamW runs one parallel region per tensor, and with many small tensors the
regions' start and barrier, not the arithmetic, are the step: one step over 51.8 M
parameters took 0.238 s as 280 LoRA-shaped tensors against 0.066 s as one flat tensor
(``benchmarks/host_adam_small_tensors.py``). :class:`FlatAdamW` hands the kernel one flat
view per *run* of a piece instead, and keeps torch's AdamW state per parameter as views of
flat moments, so that ``state`` reads and writes like ``torch.optim.AdamW.state``.

[Note: flat runs]
A run is consecutive slots of the piece in one parameter group whose fp32 masters lie back
to back in one storage, and whose gradient accumulators do too (the chunk manager carves
them so; where it does not, every slot is a run of its own and the step is the per-tensor
one). At a step, the slots of a run that step (a gradient, and the same step count) and are
consecutive make one flat tensor of the fused call; each parameter's step count is kept on
its own, as torch keeps it, so a parameter without a gradient is neither decayed nor counted.

Bits: the kernel (``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``) hands each thread whole
64-byte units of a tensor and computes them in vector lanes, except a tensor's last
``numel % Vec::size()`` elements, which a scalar loop computes with other roundings (one ulp
of ``exp_avg_sq`` apart on this AVX2 CPU, measured). An element keeps its arithmetic in a
flat view as long as no tensor's tail moves into vector lanes, so a run ends after a slot
whose size is not a multiple of ``_LANE_UNIT`` (16 fp32, the 64-byte unit: a multiple of
the vector width of AVX2 and AVX-512); its tail stays the flat tensor's tail. The result is
then bit for bit the per-tensor fused AdamW's (``tests/optim/test_flat_adamw.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field

import torch
from torch.optim.adamw import adamw

from protrain.chunks.chunk import ParamSlot
from protrain.optim.state_format import (
    ABSMAX,
    MOMENTS,
    check_state_format,
    n_blocks,
    new_moments,
    param_seed,
    state_keys,
)


def fused_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    group: dict,
) -> None:
    """torch's functional fused AdamW over these tensors at one param group's
    hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``), as
    ``torch.optim.AdamW(fused=True)`` steps a group; ``steps`` are incremented by it."""
    adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        fused=True,
        amsgrad=False,
        beta1=group["betas"][0],
        beta2=group["betas"][1],
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


_LANE_UNIT = 16  # fp32 elements of the kernel's 64-byte task unit


@dataclass(eq=False)
class _Run:
    """Slots whose masters (and gradient accumulators) are one flat view each."""

    slots: list[ParamSlot]
    group: int  # the outer optimizer's parameter group
    offsets: list[int]  # element offset of each slot in the run, and the run's size last
    master: torch.Tensor
    grad: torch.Tensor
    block_offsets: list[int]  # as offsets, of the 8-bit state's absmaxes (a block per slot)
    # the moments (and 8-bit absmaxes) in the optimizer's state format, made at first use
    moments: dict[str, torch.Tensor] = field(default_factory=dict)

    def ensure_moments(self, state_format: str) -> None:
        if not self.moments:
            numel = self.offsets[-1]
            self.moments = new_moments(state_format, numel, self.block_offsets[-1])

    def span(self, key: str, a: int, b: int) -> torch.Tensor:
        """Slots ``a .. b-1`` of the run as one flat view of ``key``."""
        if key in ABSMAX:
            return self.moments[key][self.block_offsets[a] : self.block_offsets[b]]
        flat = self.master if key == "param" else self.grad if key == "grad" else self.moments[key]
        return flat[self.offsets[a] : self.offsets[b]]

    def view(self, key: str, i: int) -> torch.Tensor:
        """Slot ``i``'s ``key`` in its master's shape (an absmax: flat)."""
        flat = self.span(key, i, i + 1)
        return flat if key in ABSMAX else flat.view(self.slots[i].master.shape)


def _back_to_back(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.is_contiguous()
        and b.is_contiguous()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()
    )


def _flat(tensors: list[torch.Tensor], numel: int) -> torch.Tensor:
    """One flat view of back-to-back ``tensors`` (a lone one as itself, flattened)."""
    if len(tensors) == 1:
        return tensors[0].view(-1)
    return tensors[0].as_strided((numel,), (1,))  # from the first's storage offset on


def _runs(slots: list[ParamSlot], groups: list[int]) -> list[_Run]:
    runs: list[list[int]] = []
    for i, s in enumerate(slots):
        prev = slots[i - 1] if i else None
        joins = (
            prev is not None
            and groups[i] == groups[i - 1]
            and prev.master.numel() % _LANE_UNIT == 0
            and _back_to_back(prev.master, s.master)
            and _back_to_back(prev.grad_acc, s.grad_acc)
        )
        if joins:
            runs[-1].append(i)
        else:
            runs.append([i])
    out = []
    for idx in runs:
        members = [slots[i] for i in idx]
        offsets, block_offsets = [0], [0]
        for s in members:
            offsets.append(offsets[-1] + s.master.numel())
            block_offsets.append(block_offsets[-1] + n_blocks(s.master.numel()))
        out.append(
            _Run(
                slots=members,
                group=groups[idx[0]],
                offsets=offsets,
                master=_flat([s.master for s in members], offsets[-1]),
                grad=_flat([s.grad_acc for s in members], offsets[-1]),
                block_offsets=block_offsets,
            )
        )
    return out


@dataclass
class FlatBatch:
    """What one step hands the kernel: per stepping span, its run, slot range and views."""

    spans: list[tuple[_Run, int, int]]
    grads: list[torch.Tensor]  # the spans' gradient views (unscaled and clipped in place)


class FlatAdamW:
    """torch's fused AdamW (its functional API, ``fused=True``) over the fp32 masters of
    ``slots``, one flat tensor per stepping span of a run; see [Note: flat runs].
    ``groups[i]``: the parameter group of ``slots[i]``. ``state_format``: how the moments
    are kept (``optim/state_format.py``); torch's AdamW steps fp32 ones only, the one pass
    (``optim/host_one_pass.py``) every format."""

    def __init__(
        self, slots: list[ParamSlot], groups: list[int], state_format: str = "fp32"
    ) -> None:
        if len(slots) != len(groups):
            raise ValueError(f"FlatAdamW: {len(slots)} slots but {len(groups)} group indices")
        check_state_format(state_format)
        self.state_format = state_format
        self.slots = slots
        self.runs = _runs(slots, groups)
        self._where = {id(s): (run, i) for run in self.runs for i, s in enumerate(run.slots)}
        self._step: dict[int, float] = {}  # id(slot) -> step count, for slots with state
        self.state = FlatState(self)

    def prepare(self, stepping: set[int]) -> FlatBatch:
        """The spans of the slots in ``stepping`` (ids), state made for those without
        (zero moments, step 0, as torch's first step makes it)."""
        self.ensure_state(stepping)
        spans = []
        for run in self.runs:
            i, n = 0, len(run.slots)
            while i < n:
                sid = id(run.slots[i])
                if sid not in stepping:
                    i += 1
                    continue
                j = i + 1
                while (
                    j < n
                    and id(run.slots[j]) in stepping
                    and self._step[id(run.slots[j])] == self._step[sid]
                ):
                    j += 1
                spans.append((run, i, j))
                i = j
        return FlatBatch(spans, [run.span("grad", a, b) for run, a, b in spans])

    def step(self, batch: FlatBatch, hyper: list[dict]) -> None:
        """One AdamW step of ``batch`` at the outer groups' hyperparameters ``hyper``: one
        fused call per parameter group, as torch's ``AdamW.step``."""
        if self.state_format != "fp32":
            raise RuntimeError(
                f"protrain: torch's fused AdamW steps fp32 moments only, not "
                f"optimizer_state={self.state_format!r} (the one pass steps it)"
            )
        by_group: dict[int, list[int]] = {}
        for k, (run, _, _) in enumerate(batch.spans):
            by_group.setdefault(run.group, []).append(k)
        steps = [
            torch.tensor(self._step[id(run.slots[a])], dtype=torch.float32)
            for run, a, _ in batch.spans
        ]
        for gi, ks in by_group.items():
            h = hyper[gi]
            spans = [batch.spans[k] for k in ks]
            fused_adamw(
                [run.span("param", a, b) for run, a, b in spans],
                [batch.grads[k] for k in ks],
                [run.span("exp_avg", a, b) for run, a, b in spans],
                [run.span("exp_avg_sq", a, b) for run, a, b in spans],
                [steps[k] for k in ks],
                h,
            )
        for (run, a, b), t in zip(batch.spans, steps):
            value = float(t)
            for s in run.slots[a:b]:
                self._step[id(s)] = value

    def ensure_state(self, stepping: set[int]) -> None:
        """State for the slots in ``stepping`` (ids) that have none, as torch's first step
        makes it (zero moments, step 0)."""
        for s in self.slots:
            if id(s) in stepping and id(s) not in self._step:
                self.init_state(s)

    def moments(self, s: ParamSlot) -> tuple[torch.Tensor, torch.Tensor]:
        """``exp_avg`` and ``exp_avg_sq`` of ``s``: the flat moments' own views (in the
        state format's dtype), which an update elsewhere (``optim/device_step.py``, the one
        pass) reads and writes in place."""
        run, i = self._where[id(s)]
        return run.view("exp_avg", i), run.view("exp_avg_sq", i)

    def absmaxes(self, s: ParamSlot) -> tuple[torch.Tensor, torch.Tensor]:
        """The 8-bit state's absmaxes of ``s`` (one per block); empty in other formats."""
        if self.state_format != "8bit":
            return torch.empty(0), torch.empty(0)
        run, i = self._where[id(s)]
        return run.view(ABSMAX[0], i), run.view(ABSMAX[1], i)

    def seed(self, s: ParamSlot) -> int:
        """The seed of ``s``'s stochastic rounding (bf16 state)."""
        return param_seed(s.name)

    def pin_moments(self) -> None:
        """Move the flat moments to page-locked memory (the views handed out are made anew
        on each read), so that a device step's copies of them are asynchronous."""
        for run in self.runs:
            if run.moments and not run.moments[MOMENTS[0]].is_pinned():
                run.moments = {k: v.pin_memory() for k, v in run.moments.items()}

    def group_of(self, s: ParamSlot) -> int:
        """The outer optimizer's parameter group of ``s``."""
        return self._where[id(s)][0].group

    def step_count(self, s: ParamSlot) -> float:
        return self._step[id(s)]

    def set_step_count(self, s: ParamSlot, value: float) -> None:
        self._step[id(s)] = value

    # ---- per-parameter state (torch's format) -------------------------------------------

    def init_state(self, s: ParamSlot) -> None:
        run, i = self._where[id(s)]
        run.ensure_moments(self.state_format)
        for k in run.moments:
            run.view(k, i).zero_()
        self._step[id(s)] = 0.0

    def has_state(self, s: ParamSlot) -> bool:
        return id(s) in self._step

    def state_of(self, s: ParamSlot) -> dict[str, torch.Tensor]:
        """torch's per-parameter state: the step count (a 0-d fp32 tensor, as the fused
        AdamW keeps it) and the moments as views of the flat ones (in the state format:
        bf16, or 8-bit codes with their absmaxes; ``optim/state_format.py``)."""
        run, i = self._where[id(s)]
        step = torch.tensor(self._step[id(s)], dtype=torch.float32)
        return {"step": step, **{k: run.view(k, i) for k in run.moments}}

    def set_state(self, s: ParamSlot, state: dict) -> None:
        """Copy a per-parameter state ``state`` of this state format in (values are
        copied; a value of another dtype is cast as ``copy_`` casts)."""
        want = state_keys(self.state_format)
        if set(state) != want:
            raise ValueError(
                f"protrain: AdamW state of {s.name} has keys {sorted(state)}; "
                f"optimizer_state={self.state_format!r} keeps {sorted(want)}"
            )
        run, i = self._where[id(s)]
        run.ensure_moments(self.state_format)
        for k in sorted(want - {"step"}):
            dst, src = run.view(k, i), state[k]
            if src.numel() != dst.numel():
                whose = "its master has" if k in MOMENTS else "its blocks are"
                raise ValueError(
                    f"protrain: AdamW state {k!r} of {s.name} has {src.numel()} elements; "
                    f"{whose} {dst.numel()}"
                )
            dst.copy_(src.reshape(dst.shape))
        self._step[id(s)] = float(state["step"])

    def drop_state(self, s: ParamSlot) -> None:
        self._step.pop(id(s), None)


class FlatState(MutableMapping):
    """``FlatAdamW``'s state as torch's ``Optimizer.state``: master tensor -> its state
    dict (moments as views of the flat ones); setting an entry copies it in."""

    def __init__(self, owner: FlatAdamW) -> None:
        self._owner = owner
        self._slot = {id(s.master): s for s in owner.slots}

    def _slot_of(self, master: torch.Tensor) -> ParamSlot:
        s = self._slot.get(id(master))
        if s is None:
            raise KeyError("protrain: not a master of this piece")
        return s

    def __getitem__(self, master: torch.Tensor) -> dict:
        s = self._slot_of(master)
        if not self._owner.has_state(s):
            raise KeyError(s.name)
        return self._owner.state_of(s)

    def __setitem__(self, master: torch.Tensor, state: dict) -> None:
        self._owner.set_state(self._slot_of(master), state)

    def __delitem__(self, master: torch.Tensor) -> None:
        s = self._slot_of(master)
        if not self._owner.has_state(s):
            raise KeyError(s.name)
        self._owner.drop_state(s)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([s.master for s in self._owner.slots if self._owner.has_state(s)])

    def __len__(self) -> int:
        return sum(self._owner.has_state(s) for s in self._owner.slots)
