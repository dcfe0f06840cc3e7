"""The engine's API: ``wrap`` with explicit knobs and the calls that go with it.
``protrain.wrap`` is ``protrain/planned_wrap.py``, which plans the knobs for a budget (with
``protrain.plan``) and then calls this ``wrap``; the engine never imports the planner.

Ownership, in one place:

- ``wrap(model, ...)`` returns ``(model, optimizer, layout)``. The model is the very module
  passed in, its parameters now views into chunk storage and its modules carrying hooks.
  The :class:`Engine` behind it holds every resource (chunk storage on the device, the
  pinned host arena, streams, the CPU worker thread, the hooks); it is reachable as
  ``model._protrain_engine``.
- ``protrain.close(model)`` (or ``optimizer.close()``, the same call) gives every resource
  back and leaves a plain module: each parameter holds its trained value (the fp32 master for
  trainable ones) in its original dtype on its original device (buffers follow when all
  parameters came from one device), with no hooks. The optimizer
  is unusable afterwards. Wrapping a wrapped model is an error; wrapping after close works.
- ``protrain.state_dict(model)`` returns a normal state dict with the model's own names
  (trainable parameters as their fp32 masters, frozen ones in the dtype they had, buffers),
  on the CPU; ``protrain.load_state_dict(model, sd)`` writes one back into masters, host copies
  and device copies. Use these for checkpoints and exports while wrapped.

The training step is plain PyTorch::

    loss = model(**batch).loss; optimizer.scale_loss(loss).backward()   # repeat to accumulate
    optimizer.clip_grad_norm_(1.0); optimizer.step(); optimizer.zero_grad()

``scale_loss`` is the identity in bf16 and fp32; in fp16 it multiplies by the dynamic loss
scale, and ``clip_grad_norm_``/``step`` unscale, skip steps with inf or nan gradients and
update the scale as ``torch.amp.GradScaler`` does (``optim/loss_scaler.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from protrain.activations import apply_activation_knobs, place_policies
from protrain.chunks.buffers import (
    min_resident_chunks,
    recompute_extra_chunks,
    tied_head_chunk,
)
from protrain.chunks.layout import ChunkLayout, params_in_order, plan_layout
from protrain.chunks.manager import ChunkManager
from protrain.chunks.shard import shard_multiple
from protrain.devices import resolve_device
from protrain.distributed import ChunkCollectives, DistContext, resolve_context
from protrain.distributed.grad_reducer import GradReducer
from protrain.knobs import Knobs, OptimizerSettings
from protrain.model.blocks import discover_blocks
from protrain.model.readers import DirectReads, direct_reads
from protrain.optim.adamw_8bit import check_optimizer
from protrain.optim.device_step import DeviceStep
from protrain.optim.hybrid_adamw import HybridAdamW, check_hyperparameters
from protrain.optim.loss_scaler import LossScaler
from protrain.quant.four_bit import lift_quant_state
from protrain.runtime.grad_offload import GradSink
from protrain.runtime.hooks import RuntimeHooks
from protrain.runtime.host_worker import HostWorker, default_host_threads

__all__ = [
    "wrap",
    "close",
    "state_dict",
    "load_state_dict",
    "full_tensor",
    "own_values",
    "plan_of",
    "wrap_target",
    "Engine",
    "WrapTarget",
]

log = logging.getLogger(__name__)
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Engine:
    """Everything one ``wrap`` call created; :meth:`close` gives it all back."""

    def __init__(self, model, manager, hooks, worker, optimizer, layout):
        self.model = model
        self.manager = manager
        self.hooks = hooks
        self.worker = worker
        self.optimizer = optimizer
        self.layout = layout
        self.plan = None  # the protrain.plan.Plan the knobs came from (protrain.wrap's)
        self.activations = None  # the activation-policy handle, when knobs were given
        self.closed = False

    def _slot_by_id(self):
        return {id(s.param): s for s in self.manager.slots()}

    @torch.no_grad()
    def state_dict(self, copy: bool = True, names=None) -> dict[str, torch.Tensor]:
        """See :func:`protrain.state_dict`."""
        self._check_open()
        self.optimizer.check_between_steps("protrain.state_dict()")
        self.optimizer.synchronize()
        slots = self._slot_by_id()
        wanted = None if names is None else set(names)
        whole = self._whole_sharded(wanted)
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if wanted is not None and name not in wanted:
                continue
            s = slots.get(id(t))
            if s is None:
                out[name] = t.detach().to("cpu", copy=copy)
            elif id(s) in whole:  # put together from every rank's shard
                value = whole[id(s)]
                out[name] = value if s.master is not None else value.to(s.orig_dtype)
            elif s.master is not None:
                out[name] = s.master.to("cpu", copy=copy)
            else:
                src = s.host_view if s.host_view is not None else s.device_view
                out[name] = src.to("cpu", s.orig_dtype, copy=copy)
        return out

    def _whole_sharded(self, wanted: set[str] | None) -> dict[int, torch.Tensor]:
        """``id(slot) -> whole value`` of the parameters of sharded chunks holding a wanted
        name: a collective (every rank asks for the same names)."""
        manager = self.manager
        if not manager.sharded:
            return {}
        out = {}
        for c in manager.offloaded:
            names = {n for s in c.slots for n in s.placement.names}
            if wanted is None or names & wanted:
                out.update(manager.whole_values(c))
        return out

    @torch.no_grad()
    def full_tensor(self, name: str) -> torch.Tensor:
        """See :func:`full_tensor`."""
        self._check_open()
        self.optimizer.check_between_steps("protrain.full_tensor()")
        self.optimizer.synchronize()
        s = self._slots_by_name().get(name)
        if s is None:  # a buffer, or a parameter the engine does not hold
            return self.model.state_dict(keep_vars=True)[name].detach().to("cpu")
        if s.shard is not None:  # this rank's elements of a sharded chunk, from every rank
            own = s.master if s.master is not None else s.host_view
            c = self.manager.chunks[s.chunk]
            value = self.manager.collectives.gather_param(c, s, own)
            return value.to(s.orig_dtype)  # already a tensor of its own
        if s.master is not None:
            value = s.master
        else:
            value = s.host_view if s.host_view is not None else s.device_view
        return value.to("cpu", s.orig_dtype)

    @torch.no_grad()
    def own_values(self, names=None) -> dict[str, torch.Tensor]:
        """See :func:`own_values`."""
        self._check_open()
        self.optimizer.check_between_steps("protrain.own_values()")
        self.optimizer.synchronize()
        wanted = None if names is None else set(names)
        out = {}
        for name, s in self._slots_by_name().items():
            if wanted is not None and name not in wanted:
                continue
            value = s.master
            if value is None:
                value = s.host_view if s.host_view is not None else s.device_view
            out[name] = value
        return out

    def _slots_by_name(self) -> dict[str, object]:
        return {n: s for s in self.manager.slots() for n in s.placement.names}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True) -> None:
        self._check_open()
        self.optimizer.check_between_steps("protrain.load_state_dict()")
        self.optimizer.synchronize()
        self.manager.release_all()
        slots = self._slot_by_id()
        own = self.model.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(sd))
        unexpected = sorted(set(sd) - set(own))
        if strict and (missing or unexpected):
            raise KeyError(
                f"protrain.load_state_dict: missing keys {missing[:10]}, "
                f"unexpected keys {unexpected[:10]}"
            )
        for name, value in sd.items():
            t = own.get(name)
            if t is None:
                continue
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(
                    f"protrain.load_state_dict: {name} has shape {tuple(value.shape)}, "
                    f"the model's is {tuple(t.shape)}"
                )
            s = slots.get(id(t))
            if s is None:
                t.data.copy_(value)
                continue
            if s.shard is not None:  # this rank's elements of a sharded chunk
                lo, hi = s.shard
                value = value.reshape(-1)[lo:hi]
            if s.master is not None:
                s.master.copy_(value)
            (s.host_view if s.host_view is not None else s.device_view).copy_(value)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("protrain: this engine is closed")

    def close(self, originals: dict[nn.Parameter, torch.Tensor] | None = None) -> None:
        """See :func:`close`. ``originals``: parameters whose storage the caller kept from
        before wrap and vouches for (the profiler's trace, which wrapped with ``lr=0`` and
        changed no weight): they get it back as is, instead of a copy from the chunks (full
        fine-tuning 8B: 32 GB of fp32 copies, most of the trace's 15 s close)."""
        if self.closed:
            return
        if self.activations is not None:
            self.activations.remove()
            self.activations = None
        try:
            self.optimizer.check_between_steps("close()")
        except RuntimeError as exc:  # closing still gives everything back
            if originals is None:  # weights given back half stepped; else not given back
                log.warning("%s; the model is left half stepped", exc)
            self.optimizer._abandon_started_updates(stale=False)
        try:
            self.optimizer.synchronize()
        finally:
            _give_back(self.model, self.manager, self.worker, self.hooks, originals or {})
            self.optimizer._release()
            if getattr(self.model, "_protrain_engine", None) is self:
                del self.model._protrain_engine
            if getattr(self.model.__dict__.get("zero_grad"), "_protrain_route", False):
                del self.model.__dict__["zero_grad"]
            self.closed = True


def _route_zero_grad(model: nn.Module, optimizer: HybridAdamW) -> None:
    """``model.zero_grad()`` clears the engine's gradients too, as torch's idiom expects after
    ``step()``: they live in the chunks' accumulators, not in ``param.grad``, so
    ``nn.Module.zero_grad`` alone would leave them for the next backward to add onto."""
    module_zero_grad = type(model).zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)
        module_zero_grad(model, set_to_none)  # what the engine does not hold

    zero_grad._protrain_route = True
    model.__dict__["zero_grad"] = zero_grad


def _give_back(model: nn.Module, manager, worker, hooks, originals=None) -> None:
    """Undo what wrap built, whatever part of it exists: hooks off, every parameter back in
    its own storage with its trained value (``originals``: the storage to give back as is),
    host memory and the worker thread released."""
    if hooks is not None:
        hooks.remove()
    manager.restore_params({id(p): data for p, data in (originals or {}).items()})
    with torch.no_grad():
        devices = {s.orig_device for s in manager.slots()}
        if len(devices) == 1:
            model.to(devices.pop())  # buffers back where the parameters were
    if worker is not None:
        worker.shutdown(wait=True)
    manager.close()


def _normalize_groups(model, param_groups, trainable: list[nn.Parameter]) -> list[dict]:
    if param_groups is None:
        return [{"params": list(trainable)}]
    groups, seen = [], set()
    names = {id(p): n for n, p in model.named_parameters()}
    for i, g in enumerate(param_groups):
        if "params" not in g:
            raise ValueError(f"param_groups[{i}] has no 'params' key")
        ps = list(g["params"])
        for p in ps:
            if id(p) not in names:
                raise ValueError(f"param_groups[{i}] holds a tensor that is not a model parameter")
            if not p.requires_grad:
                raise ValueError(
                    f"param_groups[{i}] holds {names[id(p)]}, which does not require grad"
                )
            if id(p) in seen:
                raise ValueError(f"{names[id(p)]} appears in more than one parameter group")
            seen.add(id(p))
        _refuse_group_flags(i, g)
        groups.append({**g, "params": ps})
    left_out = [names[id(p)] for p in trainable if id(p) not in seen]
    if left_out:
        raise ValueError(
            f"parameters {left_out[:5]} require grad but are in no parameter group; "
            "add them to a group or set requires_grad=False"
        )
    return groups


# torch.optim.AdamW's flags that change its math; the engine's AdamW runs the default of each
_GROUP_FLAGS = {"maximize": False, "amsgrad": False, "decoupled_weight_decay": True}


def _refuse_group_flags(i: int, group: dict) -> None:
    """A group's AdamW flag the engine does not run is refused, not ignored (``maximize``
    ignored would minimize)."""
    for flag, runs in _GROUP_FLAGS.items():
        if flag in group and bool(group[flag]) != runs:
            raise ValueError(
                f"param_groups[{i}] sets {flag}={group[flag]!r}: the engine's AdamW runs "
                f"{flag}={runs} only; remove the key from the group"
            )


def _buffers_needed(model: nn.Module, layout: ChunkLayout, recompute: bool) -> int:
    """Most offloaded chunks one module or one block needs resident at once; with
    ``recompute`` (checkpointed blocks), what their recompute holds besides."""
    chunk_of = {
        n: c.index
        for c in layout.chunks
        if not c.persistent
        for pl in c.placements
        for n in pl.names
    }
    if not recompute:
        return min_resident_chunks(model, chunk_of)
    extra = recompute_extra_chunks(tied_head_chunk(model, chunk_of) is not None)
    return min_resident_chunks(model, chunk_of, recompute_extra=extra)


def _refuse_uncovered(reads: DirectReads, layout: ChunkLayout) -> None:
    """Refuse an offloaded parameter that no module call brings to the device: read while
    its chunk is released, it fails or crashes the process mid-step."""
    offloaded = {n for c in layout.chunks if not c.persistent for pl in c.placements
                 for n in pl.names}  # fmt: skip
    for name, holder in reads.uncovered.items():
        if name in offloaded:
            raise ValueError(
                f"protrain.wrap: parameter {name!r} would be offloaded, but no module call "
                f"brings it in: it belongs to a {holder}, which has no forward, and no module "
                "around it has one. The engine makes an offloaded parameter resident when a "
                "module holding it is called (or a module around it, for a ParameterList, a "
                "ParameterDict, a parametrization or a peft tuner layer). Keep the parameter "
                "in a module that is called, or in a persistent chunk (a larger n_persist)"
            )


@dataclass(frozen=True)
class WrapTarget:
    """Where and how a model will be wrapped: the device, the compute dtype and the ranks."""

    device: torch.device
    compute_dtype: torch.dtype
    ctx: DistContext


def wrap_target(
    model: nn.Module,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    process_group=None,
    distributed_mode: str | None = None,
    grad_reduce: str = "mean",
) -> WrapTarget:
    """The checks and defaults :func:`wrap` applies first (the model not wrapped yet, 4-bit
    state lifted, the device, the ranks, the mode). ``protrain.wrap`` runs them before it
    plans, so that a bad argument is refused before a trace."""
    if getattr(model, "_protrain_engine", None) is not None:
        raise RuntimeError(
            "protrain.wrap: this model is already wrapped; call protrain.close(model) first"
        )
    # 4-bit and 8-bit layers keep their quantization state outside parameters; the chunks
    # must carry it (protrain.quant.four_bit, protrain.quant.eight_bit).
    lift_quant_state(model)
    device = resolve_device(device)
    ctx = resolve_context(process_group)
    if distributed_mode not in (None, "sharded", "replicated"):
        raise ValueError(
            f"distributed_mode={distributed_mode!r} is not allowed: use 'sharded' or 'replicated'"
        )
    if grad_reduce not in ("mean", "sum"):
        raise ValueError(f"grad_reduce={grad_reduce!r} is not allowed: use 'mean' or 'sum'")
    if compute_dtype is None:
        compute_dtype = default_compute_dtype(model, device)
    return WrapTarget(device, compute_dtype, ctx)


def default_compute_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """bfloat16 for a model whose floating parameters are all bfloat16 (it computes as it
    would unwrapped); otherwise bfloat16 on CUDA and float32 elsewhere. An fp16 model is not
    followed: fp16 compute needs the loss scaled (``optimizer.scale_loss``), which a caller
    asks for by naming ``compute_dtype``."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes == {torch.bfloat16} or device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def _say_masters(params) -> None:
    """Low-precision trainable parameters are stepped through fp32 masters: say so once, as
    an AdamW over the parameters themselves would step them in their own dtype."""
    low = sorted({str(p.dtype).removeprefix("torch.") for _, p in params
                  if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)})  # fmt: skip
    if low:
        log.info(
            "protrain.wrap: trainable parameters in %s are stepped through fp32 masters and "
            "moments (mixed precision), not in their own dtype as an AdamW over them would",
            " and ".join(low),
        )


def wrap(
    model: nn.Module,
    knobs: Knobs | None = None,
    *,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    optim: OptimizerSettings | None = None,
    process_group=None,
    grad_reduce: str = "mean",
    discard_offloaded_grads: bool = False,
    plan=None,
) -> tuple[nn.Module, HybridAdamW, ChunkLayout]:
    """Place ``model``'s parameters in chunks with the ``knobs`` given (``protrain.knobs``;
    None: every default) and return ``(model, optimizer, layout)``. The engine takes knobs,
    never a budget: ``protrain.wrap`` (``protrain/planned_wrap.py``) plans for a
    ``gpu_budget`` and then calls this. ``optim``: the optimizer's settings (None: the
    defaults of :class:`OptimizerSettings`).

    ``n_persist``: chunks kept on the compute device (None: all). ``n_buffer``: offloaded
    chunks resident at once (None: a small default, at least what one module or block
    needs). ``compute_dtype``: float32, bfloat16 or float16 (None: :func:`default_compute_dtype`);
    trainable parameters keep fp32 masters either way (logged where they are not fp32).
    float16 comes with dynamic loss scaling: back-propagate ``optimizer.scale_loss(loss)``;
    ``loss_scaling`` takes ``torch.amp.GradScaler``'s ``init_scale`` (2**16),
    ``growth_factor`` (2), ``backoff_factor`` (0.5) and ``growth_interval`` (2000), the
    factors powers of two. ``host_threads``: intra-op threads of the host AdamW
    (default: :func:`default_host_threads`).
    Activations: ``n_swap`` and ``n_checkpoint`` blocks placed by the paper's rule
    (``protrain.activations.place_policies``; checkpointed blocks hold their inputs on the
    host with ``offload_checkpoint``), ``tiled_mlp_tokens`` for tiled MLPs.
    ``discard_offloaded_grads``: for the profiler's traced steps, which step with
    ``optimizer.step_without_host_updates()`` only; offloaded gradients land in one shared
    scratch area (see [Note: discarded gradients] in ``chunks/manager.py``).
    Several ranks (``torch.distributed`` initialized, or ``process_group`` given; every rank
    calls ``wrap`` on the same model with the same knobs): ``distributed_mode="sharded"``
    (the default) splits every offloaded chunk across the ranks, each rank keeping and
    updating its own shard (``protrain.distributed``); ``"replicated"`` keeps whole chunks
    on every rank. Either way gradients are reduced chunk by chunk during backward:
    averaged over ranks with ``grad_reduce="mean"`` (as DDP), summed with ``"sum"`` (for a
    loss already divided by the tokens of the whole global batch).
    ``n_device_step``: offloaded chunks (the last ones in forward order) whose AdamW runs on
    the device, their masters and moments streamed over the link, instead of on the host
    (``protrain/optim/device_step.py``); in the sharded mode each rank steps its own shards.
    ``optimizer``: ``"adamw"`` (fp32 moments) or ``"adamw_8bit"``: the persistent chunks'
    moments are bitsandbytes' blockwise 8-bit state, stepped by its AdamW8bit; offloaded
    chunks keep fp32 moments on the host (``protrain/optim/adamw_8bit.py`` says why).
    ``plan``: the decision these knobs came from, kept for :func:`plan_of`; the engine does
    not read it.
    Every knob is checked before anything is moved; a bad one raises ``ValueError``.
    """
    knobs, optim = knobs or Knobs(), optim or OptimizerSettings()
    n_device_step = 0 if knobs.n_device_step is None else knobs.n_device_step
    target = wrap_target(model, device, compute_dtype, process_group, knobs.distributed_mode,
                         grad_reduce)  # fmt: skip
    device, compute_dtype, ctx = target.device, target.compute_dtype, target.ctx
    collectives = ChunkCollectives(ctx, device) if ctx.is_distributed else None
    sharded = collectives is not None and knobs.distributed_mode != "replicated"
    scaler = _checked_scaler(model, knobs, optim, target)
    params = params_in_order(model)
    meta = [names[0] for names, p in params if p.is_meta]
    if meta:
        raise ValueError(
            f"protrain.wrap: parameters {meta[:3]} are on the meta device; materialize them "
            "(e.g. model.to_empty(device='cpu') and initialize) before wrapping"
        )
    trainable = [p for _, p in params if p.requires_grad]
    _say_masters(params)
    groups = _normalize_groups(model, optim.param_groups, trainable)
    hyper = dict(lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
    check_hyperparameters(hyper, groups)
    layout, reads = _chunk_layout(model, params, knobs, target, sharded)

    trainable_index = {p: i for i, p in enumerate(p for g in groups for p in g["params"])}
    manager = ChunkManager(
        layout,
        params,
        device,
        trainable_index,
        discard_offloaded_grads=discard_offloaded_grads,
        collectives=collectives,
        sharded=sharded,
    )
    worker = hooks = None
    try:
        model.to(device)  # buffers; parameters are already views of device storage
        # The worker's CPU kernels run with host_threads intra-op threads.
        worker = HostWorker(optim.host_threads or default_host_threads(ctx.local_world_size))
        sink = GradSink(manager, worker)
        device_step = DeviceStep(manager, n_device_step)  # checks the count against the layout
        sink.device_step = device_step if n_device_step else None
        if collectives is not None:
            sink.reducer = GradReducer(
                manager, collectives, sink.deliver, mean=grad_reduce == "mean"
            )
        hooks = RuntimeHooks(model, manager, sink, reads)
        optimizer = HybridAdamW(
            groups,
            manager,
            worker,
            optim,
            scaler=scaler,
            sink=sink,
            device_step=device_step,
        )
    except BaseException:  # nothing half-built stays on the model
        _give_back(model, manager, worker, hooks)
        raise
    engine = Engine(model, manager, hooks, worker, optimizer, layout)
    engine.plan = plan
    _route_zero_grad(model, optimizer)
    optimizer._close_fn = engine.close
    model._protrain_engine = engine
    log.info("protrain.wrap: %s", layout)
    if knobs.with_activations:
        try:
            engine.activations = apply_activation_knobs(
                model,
                knobs.n_swap or 0,
                knobs.n_checkpoint or 0,
                device=device,
                offload_checkpoint_inputs=knobs.offload_checkpoint,
                tiled_mlp_tokens=knobs.tiled_mlp_tokens,
            )
        except BaseException:
            engine.close()
            raise
    return model, optimizer, layout


def _checked_scaler(
    model: nn.Module, knobs: Knobs, optim: OptimizerSettings, target: WrapTarget
) -> LossScaler:
    """The knobs and optimizer settings checked before anything moves; the loss scaler
    (enabled for float16 only)."""
    compute_dtype = target.compute_dtype
    if knobs.with_activations:
        _check_activation_knobs(
            model, knobs.n_swap or 0, knobs.n_checkpoint or 0, knobs.offload_checkpoint
        )
    if compute_dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"compute_dtype={compute_dtype} is not supported: use torch.float32, "
            "torch.bfloat16 or torch.float16"
        )
    fp16 = compute_dtype == torch.float16
    if optim.loss_scaling is not None and not fp16:
        raise ValueError(
            f"loss_scaling is for compute_dtype=torch.float16 only (got {compute_dtype})"
        )
    scaler = LossScaler(target.device, enabled=fp16, **(optim.loss_scaling or {}))
    n_device_step = 0 if knobs.n_device_step is None else knobs.n_device_step
    if not isinstance(n_device_step, int) or isinstance(n_device_step, bool) or n_device_step < 0:
        raise ValueError(f"n_device_step={n_device_step!r} is not allowed: use an integer >= 0")
    check_optimizer(optim.optimizer, target.ctx.world_size)
    threads = optim.host_threads
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"host_threads={threads!r} is not allowed: use an integer >= 1")
    return scaler


def _chunk_layout(
    model: nn.Module,
    params: list[tuple[list[str], nn.Parameter]],
    knobs: Knobs,
    target: WrapTarget,
    sharded: bool,
) -> tuple[ChunkLayout, DirectReads]:
    """The chunk layout of ``params`` for the knobs, with the model's direct parameter
    reads (refused where a chunk would not cover them); ``n_buffer`` raised to what one
    module or block needs when it was not given, refused when it was given too small."""
    n_buffer, recompute = knobs.n_buffer, bool(knobs.n_checkpoint)
    layout = plan_layout(
        params,
        compute_dtype=target.compute_dtype,
        device=target.device,
        n_persist=knobs.n_persist,
        n_buffer=n_buffer,
        chunk_size_bytes=knobs.chunk_size_bytes,
        size_multiple=shard_multiple(target.ctx.world_size) if sharded else 1,
    )
    reads = direct_reads(model)
    _refuse_uncovered(reads, layout)
    need = min(_buffers_needed(model, layout, recompute), layout.n_chunks - layout.n_persist)
    if need > layout.n_buffer:
        if n_buffer is not None:
            what = " (recomputed blocks hold more)" if recompute else ""
            raise ValueError(
                f"n_buffer={n_buffer} is not allowed: a module or block of this model needs "
                f"{need} offloaded chunks resident at once{what}; use n_buffer >= {need}"
            )
        layout.n_buffer = need
    return layout, reads


def _check_activation_knobs(
    model: nn.Module, n_swap: int, n_checkpoint: int, offload_checkpoint: bool
) -> None:
    """The activation knobs checked against the model's blocks before anything moves."""
    place_policies(
        len(discover_blocks(model).blocks),
        n_swap,
        n_checkpoint,
        offload_checkpoint_inputs=offload_checkpoint,
    )


def plan_of(model: nn.Module):
    """The ``protrain.plan.Plan`` that ``protrain.wrap(gpu_budget=...)`` chose (None for
    explicit knobs)."""
    return _engine(model).plan


def _engine(model: nn.Module) -> Engine:
    engine = getattr(model, "_protrain_engine", None)
    if engine is None:
        raise RuntimeError("protrain: this model is not wrapped (or was closed)")
    return engine


def close(model: nn.Module, keep_weights: bool = True) -> nn.Module:
    """Give back every resource of the engine wrapping ``model``; return the plain model.
    ``keep_weights=False``: the weights were written elsewhere and are not needed again
    (the end of a run): every parameter is left empty (no elements) instead of holding its
    value, so that nothing is gathered or copied."""
    engine = _engine(model)
    if keep_weights:
        engine.close()
    else:
        engine.close(originals={
            s.param: torch.empty(0, dtype=s.orig_dtype, device=s.orig_device)
            for s in engine.manager.slots()
        })  # fmt: skip
    return model


def full_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """One entry of :func:`state_dict` (a parameter in its original dtype, the fp32 master's
    value for a trainable one; or a buffer), whole, on the CPU, on every rank. With sharded
    chunks a collective: every rank asks for the same names in the same order; only this
    parameter's elements are gathered, so an export written one tensor at a time never holds
    the whole model on any rank. What already lives on the host in that dtype is given as a
    view of the engine's memory (as ``state_dict(copy=False)``): to be written out at once."""
    return _engine(model).full_tensor(name)


def own_values(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """This rank's own values of the parameters the engine holds (``names``: only those), no
    collective: the fp32 master of a trainable parameter (of a sharded chunk: the elements
    this rank owns, flat), else its storage. Views of the engine's memory, to read at once
    (a check over every rank's own shards)."""
    return _engine(model).own_values(names)


def state_dict(
    model: nn.Module, copy: bool = True, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Full-precision state dict of a wrapped model, with the model's own names, on the CPU.

    ``names``: only these entries (an adapter's, say), none of the others read or copied.
    ``copy=False``: what already lives on the host in that dtype (offloaded masters, frozen
    host weights) is given as views of the engine's own memory instead of copies, which the
    next step or ``close()`` changes or unmaps: for writing out at once (a checkpoint save),
    where copies would double the host memory of the model states (12 bytes a parameter in
    full fine-tuning with the optimizer's). Tied weights are then two names for one view,
    which ``safetensors.torch.save_file`` refuses: save one of the names."""
    return _engine(model).state_dict(copy=copy, names=names)


def load_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load a state dict (e.g. from :func:`state_dict`) into a wrapped model."""
    _engine(model).load_state_dict(sd, strict=strict)
