"""The loss chunk as a searched knob: ``chunked_loss_tokens``, traced once at its smallest.

Where the planner owns the loss (the application's, or a caller's :class:`LossChunks`), the
loss may run over the micro-batch's positions in chunks of ``chunk_tokens``, each chunk's
logits dropped after forward and recomputed in backward
(``protrain.activations.chunked_loss``), or over the whole logits at once (``None``,
"off"). The candidates are "off" and ``floor x 2^k`` below the micro-batch's positions
(:func:`loss_chunk_candidates`). The step is traced at the smallest candidate, the least
memory, so the trace never runs out of memory on logits a smaller chunk would not hold;
the other candidates are derived from it (:func:`at_loss_chunk`):

[Note: the loss's memory and time as functions of the chunk]
- **memory**: the head's intervals (the last block's forward end to its backward start,
  where the loss runs) hold, at their peak, one chunk's logits as fp32 values and their
  fp32 gradient, and where the compute dtype is narrower than fp32 a third fp32 tensor in
  the loss's backward (``logit_bytes``: 12 bytes a logit, 8 for fp32, measured on H100 and
  H200), ``min(chunk, positions) x vocab`` logits ("off": every position). A candidate's
  head intervals are the traced ones
  plus the difference in those bytes. Measured on the CPU (fp32, vocabulary 4,096, 128
  positions; ``tests/plan/test_loss_chunk.py``): the traced head peak grew 7.9 bytes per
  added logit from 32 to 64 tokens and to the whole logits; the model's 8 is an upper bound
  (a few percent over at the whole logits, where the head's other bytes overlap).
- **time**: a chunked loss computes the head and the loss's forward again in backward;
  "off" does not. The trace measures the loss's forward (``ModelProfile.loss_forward_s``)
  and "off" is the traced step less it. Chunks of different sizes run the same work and
  are predicted the same time (their kernel launches are not modelled): the smallest chunk
  is then never slower than a larger one and needs the least memory, so the search takes
  the largest chunk that reaches the smallest one's time.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from protrain.plan.chunk_size import search_chunk_sizes
from protrain.plan.request import PlanRequest
from protrain.plan.search import NoPlanFits, PlanProblem, SearchResult, ranking_step_s
from protrain.plan.world import SINGLE, World
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import LossFn, ModelProfile

# The smallest chunk searched: at a 151,936-token vocabulary, 1,024 positions hold 1.2 GiB
# of fp32 logits and gradient; smaller chunks save little and launch more kernels.
LOSS_CHUNK_FLOOR_TOKENS = 1024


def logit_bytes(compute_itemsize: int) -> int:
    """Bytes per logit at the loss's peak. Where the compute dtype is narrower than fp32:
    three fp32 tensors in the loss's backward (the log-softmax kept for it, the gradient
    into it and the one it makes). Measured on H100 and H200, whole bf16 logits of 1.05 and
    2.1 G logits: the peak allocated grew 11.1-11.3 bytes a logit beyond the traced chunk's,
    and the model's earlier 10 (fp32 logits and gradient, bf16 logits) planned 38.9 GiB at a
    40 GiB budget that ran out of memory. fp32 models: 8 (the CPU measurement
    in the note above)."""
    return 12 if compute_itemsize < 4 else 8


def fixed_chunk_advice(chunk_tokens: int, positions: int, vocab_size: int | None) -> str:
    """One sentence for a trace that ran out of memory with the loss chunk fixed by the user
    (``memory.chunked_loss_tokens``): what it holds at the loss, and what else is allowed."""
    held = min(chunk_tokens, positions)
    cost = ""
    if vocab_size:
        gib = held * vocab_size * logit_bytes(4) / 2**30
        cost = f" holds {held:,} x {vocab_size:,} logits, {gib:.2f} GiB as fp32 with their gradient"
    floor = LOSS_CHUNK_FLOOR_TOKENS
    if chunk_tokens > floor:
        allowed = (
            f"a smaller value (at least {floor}, the smallest chunk the planner searches) holds "
            "fewer, or leave it unset so that the planner chooses the chunk"
        )
    else:  # the planner would trace no smaller chunk: the logits are not what to cut
        allowed = f"that is no more than the smallest chunk the planner searches ({floor})"
    return f" The loss chunk is fixed: memory.chunked_loss_tokens={chunk_tokens}{cost}; {allowed}."


@dataclass(frozen=True)
class LossChunks:
    """A loss the planner owns and may compute in chunks of positions.

    ``loss_at(chunk_tokens)`` is the step's ``loss_fn(model, batch)`` with the logits of
    ``chunk_tokens`` positions at a time (None: the whole logits); ``vocab_size`` the width
    of its logits; ``floor_tokens`` the smallest chunk searched."""

    loss_at: Callable[[int | None], LossFn]
    vocab_size: int
    floor_tokens: int = LOSS_CHUNK_FLOOR_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.floor_tokens, int) or self.floor_tokens < 1:
            raise ValueError(f"floor_tokens={self.floor_tokens!r} is not allowed: use an int >= 1")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size!r} is not allowed: use an int >= 1")


def loss_chunk_candidates(positions: int, floor_tokens: int) -> list[int | None]:
    """None (the whole logits), then ``floor_tokens x 2^k`` below ``positions``, largest
    first (a chunk of every position is the whole logits, recomputed)."""
    out: list[int | None] = [None]
    chunk = floor_tokens
    chunks = []
    while chunk < positions:
        chunks.append(chunk)
        chunk *= 2
    return out + chunks[::-1]


def traced_chunk(candidates: list[int | None]) -> int | None:
    """The candidate the trace runs: the smallest chunk (None when there is none)."""
    chunks = [c for c in candidates if c is not None]
    return min(chunks) if chunks else None


def _positions(chunk: int | None, positions: int) -> int:
    return positions if chunk is None else min(chunk, positions)


def at_loss_chunk(profile: ModelProfile, chunk_tokens: int | None) -> ModelProfile:
    """``profile`` as a trace with the loss in chunks of ``chunk_tokens`` would have
    measured it ([Note: the loss's memory and time as functions of the chunk]);
    ``profile`` itself is unchanged."""
    traced = profile.loss_chunk_tokens
    if chunk_tokens == traced:
        return profile
    if profile.loss_vocab_size is None:
        raise ValueError("this profile's loss is not the planner's: it has no loss chunk")
    itemsize = torch.empty((), dtype=getattr(torch, profile.compute_dtype)).element_size()
    per_position = profile.loss_vocab_size * logit_bytes(itemsize)
    n = profile.loss_tokens
    delta = per_position * (_positions(chunk_tokens, n) - _positions(traced, n))
    intervals = list(profile.intervals)
    for i, iv in enumerate(intervals):
        if iv.kind == "head":  # every head interval: an upper bound (the loss runs in one)
            iv = copy.copy(iv)
            iv.peak_bytes += delta
            intervals[i] = iv
    # "off" computes the loss's forward once; a chunked loss twice. The free-running step's
    # loss forward where measured: the traced step's carried its overheads (on an H100, a
    # Llama-3.2-1B at 8 x 2048 in chunks of 1024: 0.28 s traced, so "off" was predicted
    # 0.25 s for a 0.49 s step whose chunked run took as long).
    loss_s = profile.free_loss_forward_s
    if loss_s is None or profile.free_fwd_bwd_s is None:
        loss_s = profile.loss_forward_s
    recompute = loss_s * ((chunk_tokens is not None) - (traced is not None))
    free, keep = profile.free_fwd_bwd_s, profile.free_keep_fwd_bwd_s
    return dataclasses.replace(
        profile,
        intervals=intervals,
        loss_chunk_tokens=chunk_tokens,
        head_s=max(profile.head_s + recompute, 0.0),
        free_fwd_bwd_s=None if free is None else max(free + recompute, 0.0),
        free_keep_fwd_bwd_s=None if keep is None else max(keep + recompute, 0.0),
        notes=[*profile.notes, f"loss chunk derived from the trace's {traced}"],
    )


def _label(chunk: int | None) -> str:
    return "off (whole logits)" if chunk is None else f"{chunk} tokens"


def search_loss_chunks(
    model: nn.Module,
    profile: ModelProfile,
    hardware: HardwareProfile,
    request: PlanRequest,
    *,
    world: World = SINGLE,
    mode_fixed: bool = True,
) -> tuple[SearchResult, PlanProblem]:
    """The fastest plan over the loss chunk candidates of ``profile`` (each searched over
    chunk sizes and modes: ``protrain.plan.chunk_size.search_chunk_sizes``, which takes the
    same arguments): the smallest chunk first (its plan is the fastest of any chunk's), then
    "off", taken when no slower ([Note: plain PyTorch's layout first] ranks both), else the
    largest chunk as fast as the smallest. Nothing fits at the smallest chunk: nothing
    fits at all, and the error says the loss chunk was at its least."""
    candidates = profile.loss_chunk_candidates or [profile.loss_chunk_tokens]
    if len(candidates) == 1:
        return search_chunk_sizes(
            model, at_loss_chunk(profile, candidates[0]), hardware, request,
            world=world, mode_fixed=mode_fixed,
        )  # fmt: skip
    smallest = traced_chunk(candidates)
    found: dict[int | None, tuple[SearchResult, PlanProblem]] = {}

    def at(chunk: int | None):
        if chunk not in found:
            try:
                found[chunk] = search_chunk_sizes(
                    model, at_loss_chunk(profile, chunk), hardware, request,
                    world=world, mode_fixed=mode_fixed,
                )  # fmt: skip
            except NoPlanFits:
                found[chunk] = None
                if chunk == smallest:
                    raise
        return found[chunk]

    try:
        best = at(smallest)
    except NoPlanFits as exc:
        if exc.kind != "gpu":
            raise
        error = NoPlanFits(
            f"{exc} (with the loss in chunks of {smallest} tokens, the least memory "
            "chunked_loss_tokens gives)",
            exc.smallest_budget_bytes,
        )
        error.binding_knobs = {"chunked_loss_tokens": smallest}
        raise error from None
    best_s = ranking_step_s(best[0].plan)
    chosen = smallest
    off = at(None)
    if off is not None and ranking_step_s(off[0].plan) <= best_s:
        chosen = None
    else:
        for chunk in candidates:  # largest first: the first as fast as the smallest
            if chunk is None or chunk == smallest:
                continue
            r = at(chunk)
            if r is not None and ranking_step_s(r[0].plan) <= best_s * (1 + 1e-9):
                chosen = chunk
                break
    result, problem = found[chosen]
    plan = result.plan
    for c in plan.candidates:
        c["chunked_loss_tokens"] = chosen
    for chunk, r in found.items():  # each other loss chunk's best, for the table
        if chunk != chosen and r is not None:
            c = dict(r[0].plan.candidates[0])
            c["chunked_loss_tokens"] = chunk
            plan.candidates.append(c)
    searched = ", ".join(
        f"{_label(c)} "
        + (f"{found[c][0].plan.predicted_step_s:.4f} s" if found[c] else "none fits")
        for c in candidates
        if c in found
    )
    plan.reasons.append(
        f"loss {_label(chosen)}: the fastest of the loss chunks searched ({searched}); "
        f"traced at {_label(profile.loss_chunk_tokens)}"
    )
    result.work["loss_chunks"] = len(found)
    return result, problem
