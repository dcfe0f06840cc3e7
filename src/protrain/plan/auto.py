"""Profile plus search in one call: what ``protrain.wrap(gpu_budget=...)`` and the
application's ``memory: {auto: true}`` use. Deciding only: executing a plan is
``protrain.planned_wrap`` (above both the planner and the engine)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import numpy as np
import torch
from torch import nn

from protrain.devices import resolve_device
from protrain.distributed.agree import on_main_patiently
from protrain.distributed.process_group import NO_GROUP, resolve_context
from protrain.knobs import Knobs
from protrain.plan.host_budget import SHARE, default_cpu_budget
from protrain.plan.loss_chunk import (
    fixed_chunk_advice,
    logit_bytes,
    loss_chunk_candidates,
    search_loss_chunks,
    traced_chunk,
)
from protrain.plan.memory import ADAM_DEVICE_BYTES_PER_PARAM, ADAM_STEP_BYTES_PER_TENSOR
from protrain.plan.plan import KNOBS, Plan
from protrain.plan.request import PlanRequest
from protrain.plan.search import NoPlanFits, PlanProblem
from protrain.plan.world import MODES, SINGLE, World
from protrain.profile.chunk_table import ChunkTable, chunk_table
from protrain.profile.hardware import HardwareProfile, measure_hardware
from protrain.profile.trace import ModelProfile, hf_loss, trace_model

log = logging.getLogger(__name__)


def trace_persist(table: ChunkTable, states_budget_bytes: int) -> int | None:
    """Most leading chunks whose model states (chunk, fp32 master, Adam moments, and the
    fp32 gradient accumulators backward makes) fit ``states_budget_bytes``; None: all.
    Persistent chunks also keep the host free of their masters and optimizer state."""
    trn = np.asarray(table.trainable_numel, dtype=np.int64)
    per_chunk = (
        table.chunk_size_bytes
        + (ADAM_DEVICE_BYTES_PER_PARAM + 4) * trn
        + ADAM_STEP_BYTES_PER_TENSOR * np.asarray(table.trainable_tensors, dtype=np.int64)
    )
    fits = int(np.searchsorted(np.cumsum(per_chunk), states_budget_bytes, side="right"))
    return None if fits >= table.n_chunks else fits


def vocab_size(model: nn.Module) -> int | None:
    """The width of the model's logits: its config's vocabulary, else its output embedding's
    rows (None when neither is known)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        out = getattr(model, "get_output_embeddings", lambda: None)()
        vocab = getattr(getattr(out, "weight", None), "shape", [None])[0]
    return None if vocab is None else int(vocab)


def full_logits_bytes(model: nn.Module, batch_size: int, seq_len: int, compute_dtype) -> int:
    """Bytes of the full-sequence logits a plain loss makes: the compute-dtype logits and
    their fp32 upcast (0 when the vocabulary size is unknown)."""
    vocab = vocab_size(model)
    if vocab is None:
        return 0
    return int(batch_size * seq_len * vocab * (torch.empty((), dtype=compute_dtype).itemsize + 4))


def profile_model(
    model: nn.Module,
    request: PlanRequest,
    *,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
) -> ModelProfile:
    """Trace under the engine with as many persistent chunks as fit in half the budget less
    the full-sequence logits of a plain loss (the other half for the trace's activations,
    its buffers and gradients), the rest offloaded; a trace that runs out of memory anyway
    is retried once with every chunk offloaded, and says so.

    Read from ``request``: the sample batch, the GPU budget, the chunk size and tiled MLPs
    of its knobs, and the loss. ``loss_chunks`` (the planner owns the loss; ``loss_fn`` is
    then not read): the step is traced with the loss in its smallest chunk and the profile
    carries the chunks to search (``protrain.plan.loss_chunk``). ``fixed_loss_chunk_tokens``:
    the chunk of ``loss_fn`` where the user fixed it (``memory.chunked_loss_tokens``), named
    by the error when even the offloaded trace runs out of memory."""
    device = resolve_device(device)
    sample_batch, gpu_budget_bytes = request.sample_batch, request.gpu_budget_bytes
    loss_chunks, loss_fn = request.loss_chunks, request.loss_fn or hf_loss
    if sample_batch is None:
        raise ValueError(
            "the plan request has no sample_batch: give a micro-batch of the real shape"
        )
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    table = chunk_table(
        model, compute_dtype=compute_dtype, chunk_size_bytes=request.knobs.chunk_size_bytes
    )
    logits = 0
    candidates: list[int | None] = []
    if loss_chunks is not None:
        positions = _loss_positions(sample_batch)
        candidates = loss_chunk_candidates(positions, loss_chunks.floor_tokens)
        traced = traced_chunk(candidates)
        loss_fn = loss_chunks.loss_at(traced)
        itemsize = torch.empty((), dtype=compute_dtype).element_size()
        logits = loss_chunks.vocab_size * logit_bytes(itemsize) * (traced or positions)
    elif loss_fn is hf_loss:  # a chunked loss never holds the full-sequence logits
        ids = sample_batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            logits = full_logits_bytes(model, ids.shape[0], ids.shape[1], compute_dtype)
    n_persist = trace_persist(table, max(gpu_budget_bytes // 2 - logits, 0))
    attempts = [n_persist] if n_persist == 0 else [n_persist, 0]
    for i, n in enumerate(attempts):
        traced = False
        t0 = time.perf_counter()
        try:
            profile = trace_model(
                model,
                sample_batch,
                device=device,
                compute_dtype=compute_dtype,
                knobs=Knobs(
                    n_persist=n,
                    chunk_size_bytes=table.chunk_size_bytes,
                    tiled_mlp_tokens=request.knobs.tiled_mlp_tokens,
                ),
                loss_fn=loss_fn,
                gpu_budget_bytes=gpu_budget_bytes,
            )
            traced = True
        except torch.OutOfMemoryError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
            failed_s = time.perf_counter() - t0
        # Cleaned up outside the handler: the exception's traceback holds the trace's tensors.
        # After a trace that ran, too: its layout (more persistent chunks than the plan, say)
        # left blocks in the caching allocator, and training would start with them reserved.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if traced:
            if loss_chunks is not None:
                profile.loss_chunk_tokens = traced_chunk(candidates)
                profile.loss_vocab_size = loss_chunks.vocab_size
                profile.loss_tokens = _loss_positions(sample_batch)
                profile.loss_chunk_candidates = candidates
            if i:  # the plan time counts both traces: say so, and what the first one cost
                first = "all" if attempts[0] is None else attempts[0]
                profile.notes.append(
                    f"traced with every chunk offloaded after the trace with n_persist={first} "
                    f"ran out of memory in {failed_s:.1f} s ({reason})"
                )
            return profile
        if i + 1 < len(attempts):
            log.warning(
                "protrain trace with n_persist=%s ran out of memory (%s); retrying with every "
                "chunk offloaded (n_persist=0)",
                "all" if n is None else n,
                reason,
            )
    hint = ""
    if request.fixed_loss_chunk_tokens is not None and loss_chunks is None:
        positions = _loss_positions(sample_batch)
        hint = fixed_chunk_advice(request.fixed_loss_chunk_tokens, positions, vocab_size(model))
    elif logits and loss_chunks is None:
        hint = (
            f" The full-sequence logits of a plain loss take {logits / 2**30:.2f} GiB at this "
            "batch: a chunked loss (memory.chunked_loss_tokens) never holds them."
        )
    # the advice before the allocator's text, which runs to several hundred characters
    raise NoPlanFits(
        "the traced step ran out of memory with every chunk offloaded and every block "
        f"checkpointed, so no plan fits the GPU budget of {gpu_budget_bytes / 2**30:.2f} GiB; "
        f"lower the batch or sequence, or give a larger budget.{hint} (The trace's error: "
        f"{reason})",
        None,
    )


def _loss_positions(batch: dict) -> int:
    """The positions the loss scores in one micro-batch: the labels' (else the inputs')."""
    for key in ("labels", "input_ids"):
        t = batch.get(key)
        if isinstance(t, torch.Tensor):
            return int(t.numel())
    raise ValueError("the sample batch has neither labels nor input_ids: no loss to chunk")


def profile_and_plan(
    model: nn.Module,
    request: PlanRequest,
    *,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    hardware: HardwareProfile | None = None,
    profile: ModelProfile | None = None,
    process_group=None,
) -> tuple[Plan, PlanProblem | None]:
    """The plan for ``request`` (``plan/request.py`` says what it holds) and the problem it
    solved (keep the problem for :mod:`closed_loop`). ``hardware`` and ``profile``: given
    instead of measured and traced.

    Several ranks (``process_group``, else the default group when initialized): every rank
    calls this at once. They measure the hardware together; the first rank traces its
    model and searches, for each rank's share (``plan/world.py``: ``gpu_budget_bytes`` is
    each GPU's, ``cpu_budget_bytes`` the host's, shared by its ranks), over both modes
    unless ``request.knobs.distributed_mode`` fixes one; every rank returns that plan (or
    raises its error), the problem on the first rank only (None elsewhere).

    With ``request.loss_chunks`` the plan's ``chunked_loss_tokens`` is the loss chunk to
    train with (None: the whole logits). The trace steps torch's AdamW whatever
    ``request.optimizer`` is."""
    device = resolve_device(device)
    ctx = resolve_context(process_group)
    mode = request.knobs.distributed_mode
    if mode is not None and mode not in MODES:
        raise ValueError(f"distributed_mode={mode!r} is not allowed: use one of {MODES}")
    hardware = hardware or measure_hardware(
        device, process_group=ctx.group if ctx.is_distributed else NO_GROUP
    )
    if not ctx.is_distributed:
        return _plan_here(model, request, device, compute_dtype, hardware, profile)
    world = World(ctx.world_size, ctx.local_world_size, mode or "sharded")
    problems: list[PlanProblem] = []

    def on_first_rank() -> Plan:
        plan, problem = _plan_here(
            model, request, device, compute_dtype, hardware, profile, world, mode is not None
        )
        problems.append(problem)
        return plan

    # the trace and search of a large model may outlast the group's collective timeout
    poll_device = None if "gloo" in ctx.backend else device  # NCCL alone: a CUDA tensor
    plan = on_main_patiently(ctx, on_first_rank, poll_device)
    return plan, (problems[0] if problems else None)


def _plan_here(
    model: nn.Module,
    request: PlanRequest,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    hardware: HardwareProfile,
    profile: ModelProfile | None,
    world: World = SINGLE,
    mode_fixed: bool = True,
) -> tuple[Plan, PlanProblem]:
    """:func:`profile_and_plan` on this process: trace (unless given), then search."""
    t0 = time.perf_counter()
    cpu_budget = request.cpu_budget_bytes
    if cpu_budget is not None:
        cpu_budget //= world.local_size  # the host's, shared by its ranks
    if profile is None:
        profile = profile_model(model, request, device=device, compute_dtype=compute_dtype)
    host_defaulted = cpu_budget is None
    if host_defaulted:  # after the trace: its arena is given back
        cpu_budget = default_cpu_budget()
        if cpu_budget is not None:
            cpu_budget //= world.local_size
        if cpu_budget is None:
            log.info("protrain plan: no cpu_budget given and the host's memory is unknown: "
                     "host memory is not limited")  # fmt: skip
        else:
            log.info(
                "protrain plan: no cpu_budget given: planning with %.1f GiB of host memory "
                "(%.0f%% of what this host has available%s; set cpu_budget to change it)",
                cpu_budget / 2**30,
                SHARE * 100,
                f", shared by {world.local_size} ranks" if world.local_size > 1 else "",
            )
    fixed = request.knobs.fixed_searched()
    log.info(
        "protrain plan: knobs fixed by the user: %s; searching %s",
        ", ".join(f"{k}={v}" for k, v in fixed.items()) or "none",
        ", ".join(k for k in KNOBS if k not in fixed) or "nothing",
    )
    here = dataclasses.replace(request, cpu_budget_bytes=cpu_budget)  # this rank's share
    t1 = time.perf_counter()
    try:
        result, problem = search_loss_chunks(
            model, profile, hardware, here, world=world, mode_fixed=mode_fixed
        )
    except NoPlanFits as exc:
        if host_defaulted and exc.kind == "host":
            error = NoPlanFits(
                f"{exc}. No cpu_budget was given, so the plan may use {SHARE:.0%} of the host "
                "memory available now; free host memory, or set cpu_budget (memory.cpu_budget "
                "in a config) if more will be free when training runs",
                None,
                kind="host",
            )
            error.least_host_bytes = exc.least_host_bytes
            raise error from None
        raise
    log.info(
        "protrain plan in %.1f s (search %.3f s, work %s):\n%s",
        time.perf_counter() - t0,
        time.perf_counter() - t1,
        result.work,
        result.plan,
    )
    return result.plan, problem


def plan_for(model: nn.Module, request: PlanRequest, device=None) -> Plan:
    """The fastest plan that fits: :func:`profile_and_plan` without the problem."""
    return profile_and_plan(model, request, device=device)[0]
