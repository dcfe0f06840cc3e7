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
master and moments (24) and writes the weights (2, in non-temporal stores: an ordinary
store would read each line first, [Note: streamed copies] in ``csrc/host_adam.cpp``), and
the next gather's copy reads them (2). torch's fused AdamW with the cast on the device moved about 40: the fp32 gradient
written by the copy (4) and read (4), the 24 of the update, a pass each for unscaling and
clipping (8 each, when on), and the fp32 master read by the gather (4) with the cast weights
written back (2). The counters ``host_update_bytes`` and ``host_update_params`` count the
update's own bytes (without the copies, which ``copy_times`` counts) on either path. With
compact moments (``optimizer_state``: ``optim/state_format.py``) the moments move 8 bytes
(bf16) or 4 and the absmaxes' 1/16 (8bit) instead of 16: a bf16-weight parameter moves 24
or about 20 bytes a step with the copies, the update itself 20 or 16.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from protrain.chunks.chunk import ParamSlot
from protrain.optim.flat_adamw import FlatAdamW
from protrain.optim.state_format import KERNEL_FORMAT, moment_bytes_per_param

_MASTER_BYTES = 8  # the fp32 master, read and written


@dataclass
class PieceReads:
    """What one step's pass reads, fixed when the step is queued (``zero_grad`` may run
    before the worker does): per slot, whether its gradient is the landed low-precision
    one, and the multipliers an earlier pass applied that must reach the stored gradient
    first (torch changed ``.grad`` in place)."""

    low: list[bool]
    earlier: list[tuple[float | None, float | None] | None]


def plan_reads(with_grad: list[ParamSlot], inv_scale, clip_coef) -> PieceReads:
    """On the thread that queues the step: fix what the pass reads, and record on each slot
    the multipliers this pass applies (``ParamSlot.grad_pending_mul``)."""
    pending = None if inv_scale is None and clip_coef is None else (inv_scale, clip_coef)
    reads = PieceReads([], [])
    for s in with_grad:
        earlier = s.grad_pending_mul
        reads.low.append(s.grad_low)
        reads.earlier.append(earlier)
        if earlier is not None:
            s.grad_low = False  # the worker moves it into grad_acc before the pass
        s.grad_pending_mul = pending
    return reads


def step_piece(
    kernel: ModuleType,
    adam: FlatAdamW,
    with_grad: list[ParamSlot],
    reads: PieceReads,
    hyper: list[dict],
    inv_scale: float | None,
    clip_coef: float | None,
    stats: dict,
) -> None:
    """One AdamW step of the slots ``with_grad`` (of ``adam``'s piece) at the outer groups'
    hyperparameters ``hyper``: one kernel call per parameter group, as torch steps a group."""
    grad_of = {}
    for s, low, earlier in zip(with_grad, reads.low, reads.earlier):
        if earlier is not None:  # a second step on the same gradient
            s.fold_grad(low, earlier)
        grad_of[id(s)] = (s.grad_staging if low and earlier is None else s.grad_acc).view(-1)
    adam.ensure_state(set(map(id, with_grad)))
    by_group: dict[int, list[ParamSlot]] = {}
    for s in with_grad:
        by_group.setdefault(adam.group_of(s), []).append(s)
    moved = 0.0
    state_bytes = _MASTER_BYTES + 2 * moment_bytes_per_param(adam.state_format)
    for gi, slots in by_group.items():
        steps = [adam.step_count(s) + 1.0 for s in slots]
        grads = [grad_of[id(s)] for s in slots]
        outs = [s.host_view.view(-1) for s in slots]
        _call_kernel(kernel, adam, slots, grads, outs, steps, hyper[gi], inv_scale, clip_coef)
        for s, step in zip(slots, steps):
            adam.set_step_count(s, step)
        moved += sum(
            g.numel() * (g.element_size() + state_bytes + o.element_size())
            for g, o in zip(grads, outs)
        )
    stats["host_update_bytes"] = stats.get("host_update_bytes", 0) + round(moved)
    stats["host_update_params"] = stats.get("host_update_params", 0) + sum(
        s.master.numel() for s in with_grad
    )


def _call_kernel(kernel, adam, slots, grads, outs, steps, h, inv_scale, clip_coef) -> None:
    """One kernel call over ``slots`` (one parameter group): fp32 moments, or the compact
    ones of ``adam``'s state format with each parameter's seed."""
    moments = [adam.moments(s) for s in slots]
    hyper = (h["lr"], h["betas"][0], h["betas"][1], h["weight_decay"], h["eps"])
    masters = [s.master.view(-1) for s in slots]
    exp_avgs = [m.view(-1) for m, _ in moments]
    exp_avg_sqs = [v.view(-1) for _, v in moments]
    if adam.state_format == "fp32":
        kernel.adamw_step(
            masters, exp_avgs, exp_avg_sqs, grads, outs, steps, *hyper, inv_scale, clip_coef
        )
        return
    absmaxes = [adam.absmaxes(s) for s in slots]
    kernel.adamw_step_compact(
        masters, exp_avgs, exp_avg_sqs, [a for a, _ in absmaxes], [b for _, b in absmaxes],
        grads, outs, steps, [adam.seed(s) for s in slots], KERNEL_FORMAT[adam.state_format],
        *hyper, inv_scale, clip_coef,
    )  # fmt: skip
