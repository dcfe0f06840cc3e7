"""One piece of a chunk's host update in one pass over memory (the kernel of ``host_adam_ext``).

Per parameter it reads the gradient where it is (the low-precision one where the device's
copy left it, or the fp32 accumulator after several micro-batches: [Note: gradients for the
one pass] in ``runtime/grad_offload.py``), unscales and clips it as it reads, updates the fp32
master and both moments in place, and writes the updated weights into the chunk's host copy
in the dtype the device computes in (rounded to nearest even, as ``.to()`` rounds), which the
next gather copies as it is. The Adam state is :class:`~protrain.optim.flat_adamw.FlatAdamW`'s
(same storage, same step counts, same ``state_dict``); only the arithmetic runs here.

[Note: host bytes of the one pass]
A parameter of bf16 weights stepped after one micro-batch moves 32 bytes of host memory a
step: the device's copy writes its gradient (2), the pass reads it (2), reads and writes
master and moments (24) and writes the weights (2), and the next gather's copy reads them
(2). torch's fused AdamW with the cast on the device moved about 40: the fp32 gradient
written by the copy (4) and read (4), the 24 of the update, a pass each for unscaling and
clipping (8 each, when on), and the fp32 master read by the gather (4) with the cast weights
written back (2). The counters ``host_update_bytes`` and ``host_update_params`` count the
update's own bytes (without the copies, which ``copy_times`` counts) on either path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from protrain.chunks.chunk import ParamSlot
from protrain.optim.flat_adamw import FlatAdamW

_STATE_BYTES = 24  # fp32 master and two fp32 moments, each read and written


def step_piece(
    kernel: ModuleType,
    adam: FlatAdamW,
    with_grad: list[ParamSlot],
    hyper: list[dict],
    inv_scale: float | None,
    clip_coef: float | None,
    stats: dict,
) -> None:
    """One AdamW step of the slots ``with_grad`` (of ``adam``'s piece) at the outer groups'
    hyperparameters ``hyper``: one kernel call per parameter group, as torch steps a group."""
    for s in with_grad:  # a second step on the same gradient: torch's changed it in place
        if s.grad_pending_mul is not None:
            apply_pending(s)
    adam.ensure_state(set(map(id, with_grad)))
    by_group: dict[int, list[ParamSlot]] = {}
    for s in with_grad:
        by_group.setdefault(adam.group_of(s), []).append(s)
    moved = 0
    for gi, slots in by_group.items():
        h = hyper[gi]
        steps = [adam.step_count(s) + 1.0 for s in slots]
        moments = [adam.moments(s) for s in slots]
        grads = [_grad(s) for s in slots]
        outs = [s.host_view.view(-1) for s in slots]
        kernel.adamw_step(
            [s.master.view(-1) for s in slots],
            [m.view(-1) for m, _ in moments],
            [v.view(-1) for _, v in moments],
            grads,
            outs,
            steps,
            h["lr"],
            h["betas"][0],
            h["betas"][1],
            h["weight_decay"],
            h["eps"],
            inv_scale,
            clip_coef,
        )
        for s, step in zip(slots, steps):
            adam.set_step_count(s, step)
        moved += sum(
            g.numel() * (g.element_size() + _STATE_BYTES + o.element_size())
            for g, o in zip(grads, outs)
        )
    pending = None if inv_scale is None and clip_coef is None else (inv_scale, clip_coef)
    for s in with_grad:
        s.grad_pending_mul = pending
    stats["host_update_bytes"] = stats.get("host_update_bytes", 0) + moved
    stats["host_update_params"] = stats.get("host_update_params", 0) + sum(
        s.master.numel() for s in with_grad
    )


def _grad(s: ParamSlot) -> torch.Tensor:
    """The gradient the pass reads: the landed low-precision one, else the accumulator."""
    return (s.grad_staging if s.grad_low else s.grad_acc).view(-1)


def apply_pending(s: ParamSlot) -> None:
    """Make ``s.grad_acc`` the gradient as torch's ``.grad`` holds it now: the landed
    low-precision one in fp32 (exact), then the unscale and clip a one-pass step applied
    as it read it (each a multiply, in that order)."""
    if s.grad_low:
        s.grad_acc.copy_(s.grad_staging)
        s.grad_low = False
    if s.grad_pending_mul is not None:
        for factor in s.grad_pending_mul:
            if factor is not None:
                s.grad_acc.mul_(factor)
        s.grad_pending_mul = None
