"""The chunk size as a searched knob: one trace, re-read for other chunk sizes.

The chunk size decides how much of the model one persistent chunk keeps on the device, how
early backward finishes a chunk's gradients (its host AdamW starts only then) and how much of
the next forward waits for one chunk's update. The measured full-3b row (24 GiB, auto)
trained 5.5% faster with chunks of 760 MiB than with the 1,268 MiB that wasting the fewest
bytes picks, and the runtime model ranked them the same way; so the plan searches it.

A trace is taken at one chunk size. What it measured about compute and activations does not
depend on the chunk size; what depends on it is re-derived here from the model's parameter
shapes, without tracing again (:func:`rechunk`):

- the chunk table and each chunk's first block (``chunk_table_and_index``,
  ``chunk_first_blocks``);
- the chunk of every gradient in backward order (the trace recorded their names);
- the model states and gradient accumulators that the trace's own persistent chunks added to
  its memory readings. They are taken out with the traced table and put back for the new
  one, with the re-chunked profile's ``trace_n_persist`` set to 0 (or to all chunks, when
  the trace offloaded no trainable chunk: the readings then hold no gradient landing
  buffer), so that :class:`~protrain.plan.memory.MemoryModel` reads the same residual
  terms from it as from a trace at that size.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
from torch import nn

from protrain.chunks.layout import _align, choose_chunk_size
from protrain.chunks.shard import shard_multiple
from protrain.plan.memory import MemoryModel
from protrain.plan.request import PlanRequest
from protrain.plan.search import NoPlanFits, PlanProblem, SearchResult, ranking_step_s, search
from protrain.plan.world import MODES, SINGLE, World
from protrain.profile.chunk_table import chunk_table_and_index
from protrain.profile.hardware import HardwareProfile
from protrain.profile.param_index import ParamIndex, param_index
from protrain.profile.trace import ModelProfile, chunk_first_blocks

# Candidates: these multiples of the smallest chunk that holds the largest parameter, with
# the traced size. Above 2x the waste-minimizing default already chose (it searches
# [largest, 2 x largest]); below 1x no layout exists.
_MULTIPLES = (1.0, 1.25, 1.5, 1.75, 2.0)
# Above this many (n_swap, n_checkpoint, n_persist) combinations over all candidate sizes the
# sizes are screened without swap first (see search_chunk_sizes). The full search costs
# about 4 us a combination on the H200 host: qlora-70b's 80 blocks and 20 chunks made
# 418,000 over 6 sizes, 1.81 s (the target is 0.5 s); lora-14b's 118,000 stay below.
_FULL_SEARCH_CELLS = 150_000


def chunk_size_candidates(
    model: nn.Module, profile: ModelProfile, index: ParamIndex | None = None, multiple: int = 1
) -> list[int]:
    """Chunk sizes worth planning for ``model``, the traced one included, ascending; each a
    multiple of ``multiple`` (the sharded mode's ``shard_multiple``: the engine rounds a
    chunk size up to it, so the plan does first)."""
    sizes = (index or param_index(model)).arrays(_dtype(profile))[1].tolist()
    largest = _align(max(sizes))
    out = {choose_chunk_size(sizes)}
    out.update(_align(int(largest * m)) for m in _MULTIPLES)
    out = {-(-size // multiple) * multiple for size in out}
    return sorted(out | {profile.chunks.chunk_size_bytes})


def rechunk(
    profile: ModelProfile,
    model: nn.Module,
    chunk_size_bytes: int,
    index: ParamIndex | None = None,
    traced: MemoryModel | None = None,
) -> ModelProfile:
    """``profile`` as a trace at ``chunk_size_bytes`` would have measured it (see the module
    docstring); ``profile`` itself is unchanged. ``index``: ``model``'s parameter index, and
    ``traced``: ``MemoryModel(profile)``, when the caller has them (the same for every
    size)."""
    if chunk_size_bytes == profile.chunks.chunk_size_bytes:
        return profile
    if len(profile.grad_names) != len(profile.grad_order):
        raise ValueError(
            "this profile has no gradient names (traced before they were recorded): it can "
            "be planned only at its own chunk size"
        )
    index = index or param_index(model)
    if index.block_names is None:
        raise ValueError("this model has no block stack: it can be planned only as traced")
    table, chunk_of = chunk_table_and_index(
        model, compute_dtype=_dtype(profile), chunk_size_bytes=chunk_size_bytes, index=index
    )
    names = profile.grad_names
    try:
        grad_order = [(chunk_of[n], numel) for n, (_, numel) in zip(names, profile.grad_order)]
    except KeyError as e:
        raise ValueError(f"parameter {e.args[0]!r} of the profile is not in the model") from None
    draft = dataclasses.replace(
        profile,
        chunks=table,
        grad_order=grad_order,
        chunk_first_block=chunk_first_blocks(index.block_names, chunk_of, table.n_chunks),
    )
    old = traced if traced is not None else MemoryModel(profile)
    new = MemoryModel(draft)
    trn = np.asarray(profile.chunks.trainable_numel, dtype=np.int64)
    traced_offloaded = bool(trn[profile.trace_n_persist :].sum() > 0)
    n_old = min(profile.trace_n_persist, old.n_chunks)
    n_new = 0 if traced_offloaded else new.n_chunks
    # Memory readings: the traced layout's persistent states and accumulators out, the
    # re-chunked layout's (n_new persistent chunks) in.
    step_start = profile.step_start_bytes
    if step_start is not None:
        step_start += int(new.model_states[n_new]) - int(old.model_states[n_old])
    delta = new.grads[:, n_new] - old.grads[:, n_old]  # per interval the memory model reads
    kinds = ("pre", "fwd", "head", "bwd", "opt")
    read = [i for i, iv in enumerate(profile.intervals) if iv.kind in kinds]
    intervals = list(profile.intervals)
    for i, d in zip(read, delta.tolist()):
        iv = copy.copy(intervals[i])  # not dataclasses.replace: a thousand per size on LoRA
        iv.peak_bytes += d
        intervals[i] = iv
    return dataclasses.replace(
        draft,
        intervals=intervals,
        step_start_bytes=step_start,
        trace_n_persist=n_new,
        trace_n_buffer=0 if n_new == new.n_chunks else table.n_chunks,
        notes=[*profile.notes, f"re-chunked from {profile.chunks.chunk_size_bytes} bytes"],
    )


def search_chunk_sizes(
    model: nn.Module,
    profile: ModelProfile,
    hardware: HardwareProfile,
    request: PlanRequest,
    *,
    world: World = SINGLE,
    mode_fixed: bool = True,
) -> tuple[SearchResult, PlanProblem]:
    """The fastest plan over the candidate chunk sizes and, with several ranks and
    ``mode_fixed`` false, over both modes (``plan/world.py``), with the problem it solved;
    see :func:`_search_sizes`. ``request`` gives the budgets (the host's already this
    rank's share), the knobs the user fixed and what the models count
    (:class:`~protrain.plan.request.PlanRequest`)."""
    if not world.distributed or mode_fixed:
        return _search_sizes(model, profile, hardware, request, world)
    found, errors = {}, []
    for mode in MODES:
        try:
            found[mode] = _search_sizes(model, profile, hardware, request, world.with_mode(mode))
        except NoPlanFits as exc:
            errors.append(exc)
    if not found:
        raise errors[0]  # sharded's: it needs the least memory of the two
    best = min(found, key=lambda m: ranking_step_s(found[m][0].plan))
    result, problem = found[best]
    others = [
        f"{m} {found[m][0].plan.predicted_step_s:.3f} s" if m in found else f"{m} does not fit"
        for m in MODES
        if m != best
    ]
    result.plan.reasons.append(
        f"mode {best} over {world.size} ranks: predicted {result.plan.predicted_step_s:.3f} s "
        f"a step ({'; '.join(others)})"
    )
    return result, problem


def _search_sizes(
    model: nn.Module,
    profile: ModelProfile,
    hardware: HardwareProfile,
    request: PlanRequest,
    world: World,
) -> tuple[SearchResult, PlanProblem]:
    """The fastest plan over the candidate chunk sizes, with the problem it solved.

    Every candidate gets the full search (:func:`protrain.plan.search.search`) while that
    is cheap: at most ``_FULL_SEARCH_CELLS`` (n_swap, n_checkpoint, n_persist) combinations
    over all sizes (full-3b: about 19,000; lora-14b: about 118,000; not qlora-70b's 418,000).
    Beyond that
    each candidate is screened by a search without swap (``n_swap = 0``: at 100 blocks a
    fiftieth of the pairs) and the full search runs at the size that screened fastest, so
    that the whole costs little more than one search (a 100-block, 252-chunk profile on a
    2-core machine like CI's: 0.43 s for one search, 0.62 s screened over its 7 candidate
    sizes, 1.70 s with the full search at each; ``benchmarks/search_time.py``). Where no
    size has a plan without swap, the sizes are screened at four swap counts (an eighth to
    half of the blocks) instead; every size gets the full search when the user fixed
    ``n_swap``, or when nothing fits at any screened count. Only the traced size is planned when the user gave the chunk size
    (``request.knobs.chunk_size_bytes``) or a chunk count (``n_persist``, ``n_buffer``), which mean
    something only at one size, or when the profile has no gradient names. With no plan at
    any size: if some size's plans fit the GPU but not the host budget, the host error of
    the size that needs the least host memory; else the error of the size that needs the
    least GPU budget."""
    fixed = request.knobs.fixed_searched()
    sizes = [profile.chunks.chunk_size_bytes]
    if (
        request.knobs.chunk_size_bytes is None
        and not {"n_persist", "n_buffer"} & set(fixed)
        and len(profile.grad_names) == len(profile.grad_order)
    ):
        index = param_index(model)  # one walk of the modules for every size
        multiple = shard_multiple(world.size) if world.distributed else 1
        sizes = chunk_size_candidates(model, profile, index, multiple)
        traced = MemoryModel(profile)
        profiles = {size: rechunk(profile, model, size, index, traced) for size in sizes}
    else:
        profiles = {sizes[0]: profile}
    # One problem per size: its memory and runtime models do not depend on the fixed knobs,
    # and building them (the host optimizer's critical path for every n_persist) costs
    # more than a screening search.
    problems = {
        size: PlanProblem(
            p,
            hardware,
            gpu_budget_bytes=request.gpu_budget_bytes,
            cpu_budget_bytes=request.cpu_budget_bytes,
            fixed_knobs=fixed,
            clipping=request.clipping,
            world=world,
            device_step_search=request.device_step_search,
            optimizer=request.optimizer,
            optimizer_state=request.optimizer_state,
        )
        for size, p in profiles.items()
    }

    def problem_at(size: int, knobs: dict) -> PlanProblem:
        return problems[size].with_fixed(knobs)

    full = sizes
    pairs = _n_pairs(len(profile.blocks), fixed)
    cells = sum(pairs * (p.chunks.n_chunks + 1) for p in profiles.values())
    how = "searched"
    if len(sizes) > 1 and "n_swap" not in fixed and cells > _FULL_SEARCH_CELLS:
        n_blocks = len(profile.blocks)
        # without swap first; where nothing fits without it, at a few swap counts (an
        # eighth to half of the blocks: qlora-70b at 24 GiB swaps a fifth)
        for swaps in ([0], sorted({max(1, round(n_blocks * i / 8)) for i in range(1, 5)})):
            screened = []
            for size in sizes:
                for n_swap in swaps:
                    try:
                        knobs = {**fixed, "n_swap": n_swap}
                        step = ranking_step_s(search(problem_at(size, knobs)).plan)
                    except NoPlanFits:
                        continue
                    screened.append((step, size))
            if screened:
                full = [min(screened)[1]]
                how = "screened without swap" if swaps == [0] else f"screened at swap {swaps}"
                break
    best, errors = None, []
    for size in full:
        problem = problem_at(size, fixed)
        try:
            result = search(problem)
        except NoPlanFits as e:
            errors.append(e)
            continue
        if best is None or ranking_step_s(result.plan) < ranking_step_s(best[0].plan):
            best = (result, problem)
    if best is None:
        # A size whose plans fit the GPU but not the host says more than the GPU budget
        # another size would need: raising the GPU budget would not help there.
        host = [e for e in errors if e.kind == "host"]
        known = [e for e in errors if e.smallest_budget_bytes is not None]
        if host:
            raise min(host, key=lambda e: e.least_host_bytes or 0)
        raise min(known, key=lambda e: e.smallest_budget_bytes) if known else errors[0]
    result, problem = best
    if len(sizes) > 1:
        mib = 1 << 20
        result.plan.reasons.append(
            f"chunk size {result.plan.chunk_size_bytes / mib:.2f} MiB: the fastest of "
            f"{len(sizes)} candidates {how} ({', '.join(f'{s / mib:.2f}' for s in sizes)} "
            f"MiB), traced at {profile.chunks.chunk_size_bytes / mib:.2f} MiB"
        )
    result.work["chunk_sizes"] = len(sizes)
    return result, problem


def _n_pairs(n_blocks: int, fixed: dict) -> int:
    """The (n_swap, n_checkpoint) pairs the search evaluates, the fixed ones kept."""
    swaps = [fixed["n_swap"]] if "n_swap" in fixed else range(n_blocks + 1)
    ckpts = [fixed["n_checkpoint"]] if "n_checkpoint" in fixed else range(n_blocks + 1)
    return sum(1 for s in swaps for c in ckpts if s + c <= n_blocks)


def _dtype(profile: ModelProfile):
    return getattr(torch, profile.compute_dtype)
