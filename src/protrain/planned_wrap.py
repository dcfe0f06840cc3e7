"""``protrain.wrap``: plan, then wrap.

The one module above both the planner (``protrain.plan``, which traces under the engine)
and the engine (``protrain.engine``, which executes knobs and knows no planner). With a
``gpu_budget`` it profiles one step and searches the knobs left None, then calls the
engine's ``wrap`` with the plan's knobs; without one it is the engine's ``wrap``.
:func:`apply_plan` executes a plan already made (the application's plan and re-plan).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from protrain import engine
from protrain.chunks.layout import ChunkLayout
from protrain.distributed import NO_GROUP
from protrain.model.kernels import applied_kernels
from protrain.optim.adamw_8bit import check_optimizer
from protrain.optim.hybrid_adamw import HybridAdamW

__all__ = ["wrap", "apply_plan", "plan_knobs"]

log = logging.getLogger(__name__)


def plan_knobs(plan) -> dict:
    """The engine's knobs of a ``protrain.plan.Plan``: chunks, buffers, activations, mode.
    With every chunk persistent there is no pool, so ``n_buffer`` is left to the engine."""
    return {
        "n_persist": plan.n_persist,
        "n_buffer": plan.n_buffer if plan.n_persist < plan.n_chunks else None,
        "chunk_size_bytes": plan.chunk_size_bytes,
        "n_swap": plan.n_swap,
        "n_checkpoint": plan.n_checkpoint,
        "distributed_mode": plan.distributed_mode,
        "n_device_step": plan.n_device_step,
    }


def wrap(
    model: nn.Module,
    n_persist: int | None = None,
    n_buffer: int | None = None,
    device: torch.device | str | None = None,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    param_groups: list[dict] | None = None,
    compute_dtype: torch.dtype | None = None,
    chunk_size_bytes: int | None = None,
    n_swap: int | None = None,
    n_checkpoint: int | None = None,
    offload_checkpoint: bool = False,
    tiled_mlp_tokens: int | None = None,
    gpu_budget: int | str | None = None,
    cpu_budget: int | str | None = None,
    sample_batch: dict | None = None,
    loss_fn=None,
    loss_chunks=None,
    loss_scaling: dict | None = None,
    host_threads: int | None = None,
    clipping: bool = True,
    discard_offloaded_grads: bool = False,
    process_group=None,
    distributed_mode: str | None = None,
    grad_reduce: str = "mean",
    n_device_step: int | None = None,
    device_step_search: bool = False,
    optimizer: str = "adamw",
) -> tuple[nn.Module, HybridAdamW, ChunkLayout]:
    """Place ``model``'s parameters in chunks and return ``(model, optimizer, layout)``.

    The knobs (``n_device_step`` among them), the optimizer settings (``optimizer`` among
    them: ``"adamw"`` or ``"adamw_8bit"``, which the plan counts), ``loss_scaling``,
    ``host_threads``,
    ``discard_offloaded_grads`` and several ranks are those of the engine's wrap
    (:func:`protrain.engine.wrap`, which documents them).
    With ``gpu_budget`` (bytes or a string such as ``"24GiB"``) and a ``sample_batch`` of
    the real shape, the knobs left as None are chosen by profiling and search
    (``protrain.plan``); the ones given are kept. ``protrain.plan_of(model)`` returns the plan.
    ``cpu_budget`` bounds the plan's host memory (default: 90% of what the host has
    available after the trace, ``protrain.plan.host_budget``). ``loss_fn``: the loss the
    trace runs (default: the model's own). ``loss_chunks`` (a
    ``protrain.plan.loss_chunk.LossChunks``, in place of ``loss_fn``): the caller's loss in
    chunks of positions, the chunk searched; train with the plan's
    ``chunked_loss_tokens`` (None: the whole logits). ``clipping=False`` plans for training without
    clipping, with ``step_in_backward``. ``device_step_search``: the plan also chooses how
    many offloaded chunks step on the device (``n_device_step``, kept where given). With
    several ranks the plan is made on the first
    and every rank runs it (or raises its error). Without ``gpu_budget``, ``cpu_budget``,
    ``sample_batch``, ``loss_fn``, ``loss_chunks`` and ``clipping`` are not read.
    """
    knobs = {
        "n_persist": n_persist,
        "n_buffer": n_buffer,
        "chunk_size_bytes": chunk_size_bytes,
        "n_swap": n_swap,
        "n_checkpoint": n_checkpoint,
        "distributed_mode": distributed_mode,
        "n_device_step": n_device_step or 0,
    }
    plan = None
    check_optimizer(optimizer)  # before a trace
    if device_step_search and gpu_budget is None:
        raise ValueError(
            "protrain.wrap: device_step_search=True is read only by the planner: give "
            "gpu_budget= (and sample_batch=), or set n_device_step yourself"
        )
    if gpu_budget is not None:
        # the engine's own checks first: a bad argument is refused before a trace
        target = engine.wrap_target(
            model, device, compute_dtype, process_group, distributed_mode, grad_reduce
        )
        if sample_batch is None:
            raise ValueError("protrain.wrap: gpu_budget needs a sample_batch of the real shape")
        import protrain.plan as planner

        ctx = target.ctx
        check_optimizer(optimizer, ctx.world_size)  # before a trace
        # several ranks: planned on the first, the same plan (and its mode) on every rank
        plan, _ = planner.profile_and_plan(
            model,
            sample_batch,
            gpu_budget_bytes=gpu_budget,
            cpu_budget_bytes=cpu_budget,
            device=target.device,
            compute_dtype=target.compute_dtype,
            chunk_size_bytes=chunk_size_bytes,
            fixed_knobs={
                "n_persist": n_persist,
                "n_buffer": n_buffer,
                "n_swap": n_swap,
                "n_checkpoint": n_checkpoint,
                "n_device_step": n_device_step,
            },
            tiled_mlp_tokens=tiled_mlp_tokens,
            clipping=clipping or target.compute_dtype == torch.float16,
            process_group=ctx.group if ctx.is_distributed else NO_GROUP,
            distributed_mode=distributed_mode if ctx.is_distributed else None,
            loss_chunks=loss_chunks,
            device_step_search=device_step_search,
            optimizer=optimizer,
            **({"loss_fn": loss_fn} if loss_fn is not None else {}),
        )
        knobs = plan_knobs(plan)
        device, compute_dtype = target.device, target.compute_dtype
        log.info("protrain.wrap: plan\n%s", plan)
    return engine.wrap(
        model,
        device=device,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        param_groups=param_groups,
        compute_dtype=compute_dtype,
        offload_checkpoint=offload_checkpoint,
        tiled_mlp_tokens=tiled_mlp_tokens,
        loss_scaling=loss_scaling,
        host_threads=host_threads,
        discard_offloaded_grads=discard_offloaded_grads,
        process_group=process_group,
        grad_reduce=grad_reduce,
        plan=plan,
        optimizer=optimizer,
        **knobs,
    )


def check_plan_kernels(plan, model: nn.Module) -> None:
    """Refuse to run ``plan`` on a model whose fused kernels (``protrain.model.kernels``)
    differ from those its step was traced with: its memory and time are not the model's."""
    get_base = getattr(model, "get_base_model", None)
    runs = list(applied_kernels(get_base() if callable(get_base) else model))
    traced = list(getattr(plan, "kernels", None) or [])
    if runs != traced:
        raise ValueError(
            f"the plan was traced with kernels [{', '.join(traced)}], but the model runs "
            f"[{', '.join(runs)}]; plan again with the model's kernels (model.kernels)"
        )


def apply_plan(
    model: nn.Module,
    plan,
    *,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    tiled_mlp_tokens: int | None = None,
    **wrap_kwargs,
):
    """Execute ``plan``: the engine's wrap with its chunk and activation knobs (with several
    ranks, in the plan's mode; ``process_group`` may be among ``wrap_kwargs``).

    Returns ``(model, optimizer, layout, activation_handle)``; ``protrain.close(model)``
    undoes both (``activation_handle.remove()`` alone takes the policies off);
    ``protrain.plan_of(model)`` is ``plan``. ``wrap_kwargs`` are the optimizer settings of
    the engine's wrap (lr, betas, eps, weight_decay, param_groups, grad_reduce; ``optimizer``
    defaults to the one the plan was made for, and another is refused).
    ``tiled_mlp_tokens`` must be what the profile was traced with.
    """
    planned_for = getattr(plan, "optimizer", "adamw")
    chosen = wrap_kwargs.pop("optimizer", planned_for)
    if chosen != planned_for:  # its device state is what the plan's memory counted
        raise ValueError(
            f"apply_plan: optimizer={chosen!r}, but the plan was made for "
            f"optimizer={planned_for!r}; plan again with this optimizer, or leave it out"
        )
    check_plan_kernels(plan, model)
    model, optimizer, layout = engine.wrap(
        model,
        device=device,
        compute_dtype=compute_dtype,
        tiled_mlp_tokens=tiled_mlp_tokens,
        plan=plan,
        optimizer=chosen,
        **plan_knobs(plan),
        **wrap_kwargs,
    )
    return model, optimizer, layout, model._protrain_engine.activations
