"""``protrain.wrap``: plan, then wrap.

The one module above both the planner (``protrain.plan``, which traces under the engine)
and the engine (``protrain.engine``, which executes knobs and knows no planner). With a
plan request (``gpu_budget``) it profiles one step and searches the knobs left None, then
calls the engine's ``wrap`` with the plan's knobs; without one it is the engine's ``wrap``.
:func:`apply_plan` executes a plan already made (the application's plan and re-plan).

The values passed are ``protrain.knobs.Knobs``, ``protrain.knobs.OptimizerSettings`` and
``protrain.plan.PlanRequest``; the flat keywords of ``protrain.wrap(model, n_persist=...,
gpu_budget=..., lr=...)`` are mapped onto them by name (:func:`from_keywords`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from protrain import engine
from protrain.chunks.layout import ChunkLayout
from protrain.distributed import NO_GROUP
from protrain.knobs import Knobs, OptimizerSettings, field_names
from protrain.model.kernels import applied_kernels
from protrain.optim.adamw_8bit import check_optimizer
from protrain.optim.hybrid_adamw import HybridAdamW
from protrain.plan import Plan, PlanRequest, profile_and_plan

__all__ = ["wrap", "apply_plan", "from_keywords"]

log = logging.getLogger(__name__)

# protrain.wrap's keywords for the plan request, and the request's field each one sets
_REQUEST_KEYWORDS = {
    "gpu_budget": "gpu_budget_bytes",
    "cpu_budget": "cpu_budget_bytes",
    "sample_batch": "sample_batch",
    "loss_fn": "loss_fn",
    "loss_chunks": "loss_chunks",
    "clipping": "clipping",
    "device_step_search": "device_step_search",
}


def from_keywords(keywords: dict) -> tuple[Knobs, OptimizerSettings, PlanRequest | None]:
    """``protrain.wrap``'s flat keywords as its three values: the knobs, the optimizer's
    settings (``optimizer`` sets the request's too) and the plan request (None without
    ``gpu_budget``: the request's other keywords are then not read). An unknown keyword is
    refused with the names allowed."""
    knob_names, optim_names = field_names(Knobs), field_names(OptimizerSettings)
    unknown = sorted(set(keywords) - set(knob_names) - set(optim_names) - set(_REQUEST_KEYWORDS))
    if unknown:
        allowed = sorted({*knob_names, *optim_names, *_REQUEST_KEYWORDS})
        raise TypeError(f"protrain.wrap: unknown keyword(s) {unknown}; allowed: {allowed}")
    knobs = Knobs(**{k: v for k, v in keywords.items() if k in knob_names})
    optim = OptimizerSettings(**{k: v for k, v in keywords.items() if k in optim_names})
    asked = {_REQUEST_KEYWORDS[k]: v for k, v in keywords.items() if k in _REQUEST_KEYWORDS}
    if keywords.get("device_step_search") and keywords.get("gpu_budget") is None:
        raise ValueError(
            "protrain.wrap: device_step_search=True is read only by the planner: give "
            "gpu_budget= (and sample_batch=), or set n_device_step yourself"
        )
    if asked.get("gpu_budget_bytes") is None:
        return knobs, optim, None
    return (
        knobs,
        optim,
        PlanRequest(
            knobs=knobs, optimizer=optim.optimizer, optimizer_state=optim.optimizer_state, **asked
        ),
    )


def wrap(
    model: nn.Module,
    knobs: Knobs | None = None,
    *,
    request: PlanRequest | None = None,
    optim: OptimizerSettings | None = None,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    process_group=None,
    grad_reduce: str = "mean",
    discard_offloaded_grads: bool = False,
    **keywords,
) -> tuple[nn.Module, HybridAdamW, ChunkLayout]:
    """Place ``model``'s parameters in chunks and return ``(model, optimizer, layout)``.

    ``knobs`` (``protrain.knobs.Knobs``), ``optim`` (``OptimizerSettings``), ``device``,
    ``compute_dtype``, several ranks, ``grad_reduce`` and ``discard_offloaded_grads`` are
    those of the engine's wrap (:func:`protrain.engine.wrap`, which documents them).
    With a ``request`` (``protrain.plan.PlanRequest``: the budgets, a sample batch of the
    real shape, the knobs the user fixed), the knobs left None are chosen by profiling and
    search (``protrain.plan``); the ones given are kept. ``protrain.plan_of(model)``
    returns the plan. With several ranks the plan is made on the first and every rank runs
    it (or raises its error).

    The flat keywords of earlier releases work as before, mapped onto these values by name
    (:func:`from_keywords`): each knob (``n_persist=``, ``n_buffer=``, ...), each optimizer
    setting (``lr=``, ``optimizer="adamw_8bit"``, ...) and the request's ``gpu_budget``,
    ``cpu_budget`` (default: 90% of what the host has available after the trace,
    ``protrain.plan.host_budget``), ``sample_batch``, ``loss_fn``, ``loss_chunks``,
    ``clipping`` and ``device_step_search`` (without ``gpu_budget`` they are not read).
    """
    knobs, optim, request = _values(knobs, optim, request, keywords)
    plan = None
    check_optimizer(optim.optimizer)  # before a trace
    if request is not None:
        # the engine's own checks first: a bad argument is refused before a trace
        target = engine.wrap_target(
            model, device, compute_dtype, process_group, knobs.distributed_mode, grad_reduce
        )
        plan = _plan(model, request, target, optim)
        knobs = plan.engine_knobs(knobs)
        device, compute_dtype = target.device, target.compute_dtype
        log.info("protrain.wrap: plan\n%s", plan)
    return engine.wrap(
        model,
        knobs,
        device=device,
        compute_dtype=compute_dtype,
        optim=optim,
        process_group=process_group,
        grad_reduce=grad_reduce,
        discard_offloaded_grads=discard_offloaded_grads,
        plan=plan,
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


def _values(
    knobs: Knobs | None,
    optim: OptimizerSettings | None,
    request: PlanRequest | None,
    keywords: dict,
) -> tuple[Knobs, OptimizerSettings, PlanRequest | None]:
    """The knobs, optimizer settings and request of one ``protrain.wrap`` call, given as
    values or as the flat keywords (not both for the same value)."""
    if knobs is not None and not isinstance(knobs, Knobs):
        raise TypeError(
            f"protrain.wrap: the second argument is a protrain.knobs.Knobs, not {knobs!r}; "
            "give n_persist and the other knobs by keyword"
        )
    if keywords:
        if knobs is not None or optim is not None or request is not None:
            raise TypeError(
                "protrain.wrap: give either knobs=/optim=/request= or the flat keywords "
                f"{sorted(keywords)}, not both"
            )
        return from_keywords(keywords)
    optim = optim or OptimizerSettings()
    if request is None:
        return knobs or Knobs(), optim, None
    if knobs is not None and knobs != request.knobs:
        raise ValueError(
            "protrain.wrap: with a request, the knobs the user fixed are request.knobs; "
            "leave the knobs argument out"
        )
    if request.optimizer != optim.optimizer:  # the plan counts the optimizer's device state
        raise ValueError(
            f"protrain.wrap: request.optimizer={request.optimizer!r} but "
            f"optim.optimizer={optim.optimizer!r}; plan for the optimizer that runs"
        )
    return request.knobs, optim, request


def _plan(
    model: nn.Module, request: PlanRequest, target: engine.WrapTarget, optim: OptimizerSettings
) -> Plan:
    """The plan for ``request`` on ``target``: on the first rank, the same on every rank."""
    if request.sample_batch is None:
        raise ValueError("protrain.wrap: gpu_budget needs a sample_batch of the real shape")
    ctx = target.ctx
    check_optimizer(optim.optimizer, ctx.world_size)  # before a trace
    fp16 = target.compute_dtype == torch.float16  # its overflow check needs every gradient
    mode = request.knobs.distributed_mode if ctx.is_distributed else None
    request = replace(
        request,
        clipping=request.clipping or fp16,
        knobs=replace(request.knobs, distributed_mode=mode),
    )
    plan, _ = profile_and_plan(
        model,
        request,
        device=target.device,
        compute_dtype=target.compute_dtype,
        process_group=ctx.group if ctx.is_distributed else NO_GROUP,
    )
    return plan


def apply_plan(
    model: nn.Module,
    plan: Plan,
    knobs: Knobs | None = None,
    *,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    optim: OptimizerSettings | None = None,
    process_group=None,
    grad_reduce: str = "mean",
):
    """Execute ``plan``: the engine's wrap with its chunk and activation knobs over the
    user's ``knobs`` (``tiled_mlp_tokens``, which must be what the profile was traced
    with), with several ranks in the plan's mode.

    Returns ``(model, optimizer, layout, activation_handle)``; ``protrain.close(model)``
    undoes both (``activation_handle.remove()`` alone takes the policies off);
    ``protrain.plan_of(model)`` is ``plan``. ``optim``: the optimizer's settings (None: the
    defaults, with the optimizer the plan was made for); its ``optimizer`` must be the
    plan's, whose device state the plan counted.
    """
    planned_for = getattr(plan, "optimizer", "adamw")
    optim = optim or OptimizerSettings(optimizer=planned_for)
    if optim.optimizer != planned_for:  # its device state is what the plan's memory counted
        raise ValueError(
            f"apply_plan: optimizer={optim.optimizer!r}, but the plan was made for "
            f"optimizer={planned_for!r}; plan again with this optimizer, or leave it out"
        )
    check_plan_kernels(plan, model)
    model, optimizer, layout = engine.wrap(
        model,
        plan.engine_knobs(knobs),
        device=device,
        compute_dtype=compute_dtype,
        optim=optim,
        process_group=process_group,
        grad_reduce=grad_reduce,
        plan=plan,
    )
    return model, optimizer, layout, model._protrain_engine.activations
