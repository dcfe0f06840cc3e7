"""One traced training step of the real model at the real batch, under the chunk engine.

What is measured, and how:

- **Keep pass** (forward only, no backward): every block runs as ``keep`` while a
  ``saved_tensors_hooks`` pair records the unique storages each block's forward saves for
  backward (parameters excluded). The saved tensors are held only until the block's forward
  ends, so the pass needs one block's activations at a time, and it also gives the block's
  forward peak under ``keep`` (above the memory at block entry).
- **Traced steps** (forward, backward, optimizer step) with every block checkpointed, the
  policy that needs the least memory. The last of ``steps`` steps is kept; the first ones
  warm up kernels and create the persistent chunks' optimizer state. On CUDA the caching
  allocator is emptied after the first step and one more step runs (at least one step
  between the emptying and the kept one), so that the kept step's reserved bytes are those
  of its own pattern (the allocator term). Hooks at block boundaries take the time (after a device
  synchronize) and the memory clock (:mod:`protrain.profile.memory_clock`): the peak of every
  interval between two hooks, from the step's start through the embedding, each block's
  forward, the head and loss, each block's backward (from the gradient of its output to the
  gradient of the previous block's output, cut again at every parameter's gradient
  accumulation, so that the gradient bytes the engine holds are constant inside an
  interval) and the optimizer step.

The engine runs the trace (``protrain.wrap`` with ``lr=0``, so no weight changes, then the
engine's close, which gives the host weights back in the storages the trace kept instead of
copying them out of the chunks): a model that does not fit is traced with every chunk offloaded
(``n_persist=0``), one block's chunks at a time. Its optimizer steps the persistent chunks
on the device and leaves the offloaded chunks' host updates out, but still makes their
next gathers write back as after an update (``HybridAdamW.step_without_host_updates``): the
device sees a training step's traffic and memory, and the host update, which the runtime
model takes from the hardware profile, costs the trace neither its seconds nor its Adam
moments. Memory readings leave out offloaded chunks
resident in the buffer pool and everything allocated before the step (model states): the
interval peaks are activation and transient bytes, which the plan's memory model combines
with its model-state terms.

A block's recompute time is its measured forward time: recomputation is the same forward
at the same shape. Its backward time is its backward intervals less that recompute. On CUDA
every time leaves out the compute stream's stalls on parameter gathers (the engine's CUDA
event timing of those waits), so a trace with offloaded chunks still measures compute.

- **Free-running step**: the synchronizations at every cut expose the host's kernel launch
  time that an unsynchronized step hides under device work, so the intervals sum to more
  than a real step's compute. One step without the tracer's hooks is timed with
  three synchronizations only (first block's forward, last block's forward, end of backward):
  its forward and backward seconds (gather stalls left out) are the totals the runtime model
  uses; the per-block intervals only apportion them. It runs outside the memory clock: on
  the CPU the clock is a ``TorchDispatchMode`` that sees every op, and that bookkeeping
  costs more than a small model's compute (a tiny Llama's traced step took several times
  its real one), so on the CPU too the totals are a real step's.
- **Free-running step without recompute** ([Note: the plain layout measured]): when every
  chunk is persistent in the trace and the activations of a step with no block recomputed
  fit the device, the free-running step runs once more with no block checkpointed.

For the picture of the step (:mod:`protrain.profile.timeline`), and read by no plan: the
offloaded chunks resident in the buffer pool at every cut and when the step began, and the
device bytes of the persistent chunks with their optimizer state
(``persistent_state_bytes``).

``chunk_first_block`` maps each chunk to the first block whose forward uses it (-1: used
before the first block, e.g. the embedding; ``n_blocks``: only after the last one): when
the next forward needs the chunk, and when backward has finished its gradients.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from protrain.activations import apply_activation_knobs
from protrain.activations.swap import is_parameter_like
from protrain.chunks.buffers import output_head
from protrain.devices import resolve_device
from protrain.distributed.process_group import NO_GROUP
from protrain.engine import wrap as engine_wrap
from protrain.knobs import Knobs, OptimizerSettings
from protrain.model.blocks import discover_blocks
from protrain.model.kernels import applied_kernels
from protrain.profile.chunk_table import ChunkTable, chunk_table_and_index
from protrain.profile.memory_clock import MemoryClock
from protrain.profile.param_index import block_param_names, param_index

log = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, dict], torch.Tensor]


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The loss of a Hugging Face model called with ``labels`` in the batch (no KV cache)."""
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        return model(**batch, use_cache=False).loss
    return model(**batch).loss


@dataclass
class BlockProfile:
    name: str
    fwd_s: float
    bwd_s: float
    recompute_s: float
    saved_bytes: int  # keep: unique storages saved for backward
    input_bytes: int  # checkpoint: the held input
    input_in_saved: bool  # the input's storage is among the saved ones
    fwd_peak_keep_bytes: int  # peak above block entry, forward under keep
    fwd_peak_checkpoint_bytes: int  # peak above block entry, forward under checkpoint


@dataclass
class Interval:
    """One stretch of the traced step between two hooks; bytes relative to the step start."""

    kind: str  # "pre", "fwd", "head", "bwd", "opt"
    block: int  # the block of "fwd"/"bwd", else -1
    start_s: float
    end_s: float
    peak_bytes: int
    end_bytes: int
    gathers: int  # offloaded chunks gathered during it
    reserved_overhead_bytes: int  # reserved minus allocated at its peak (CUDA)
    # Trainable parameters whose gradient was accumulated before the interval began: the
    # first ``grads_done`` entries of ``ModelProfile.grad_order``. Backward intervals are
    # cut at every accumulation, so this is constant inside an interval.
    grads_done: int = 0
    # Seconds the compute stream stalled on parameter gathers inside the interval (CUDA
    # events; 0 on the CPU): not compute, so the runtime model leaves it out.
    copy_wait_s: float = 0.0
    # Offloaded chunks resident in the buffer pool at the interval's end (the picture's
    # gathers and pool bytes; the memory readings leave the pool out).
    resident_chunks: list[int] = field(default_factory=list)

    @property
    def compute_s(self) -> float:
        return max(self.end_s - self.start_s - self.copy_wait_s, 0.0)


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@dataclass
class ModelProfile:
    blocks: list[BlockProfile]
    intervals: list[Interval]
    chunks: ChunkTable
    batch_size: int
    seq_len: int
    device: str
    compute_dtype: str
    trace_n_persist: int
    trace_n_buffer: int
    step_s: float
    pre_fwd_s: float  # step start to the first block (embedding)
    head_s: float  # last block's forward end to the last block's backward start (head, loss)
    post_bwd_s: float  # after block 0's backward interval (0: that interval runs to the end)
    optimizer_step_s: float
    allocator_overhead_bytes: int
    # CUDA: allocated bytes (buffer pool excluded) when the traced step began: model states,
    # buffers, library workspaces. None on the CPU, whose counter sees only new storages.
    step_start_bytes: int | None = None
    # (chunk index, numel) of each trainable parameter, in the order backward accumulated them
    grad_order: list[tuple[int, int]] = field(default_factory=list)
    # the parameter name of each ``grad_order`` entry: what lets the plan re-chunk the
    # profile for another chunk size (:mod:`protrain.plan.chunk_size`)
    grad_names: list[str] = field(default_factory=list)
    trace_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # Free-running step (see the module docstring); None when not measured.
    free_pre_fwd_s: float | None = None  # step start to the first block's forward
    free_blocks_fwd_s: float | None = None  # the blocks' forward, first to last
    free_fwd_bwd_s: float | None = None  # step start to the end of backward (checkpoint-all)
    # the last block's forward end to the loss: what a chunked loss computes again in
    # backward, as the step runs (``loss_forward_s`` is the traced step's, with its overheads)
    free_loss_forward_s: float | None = None
    # step start to the end of backward with no block recomputed, every chunk persistent:
    # [Note: the plain layout measured]; None when not measured
    free_keep_fwd_bwd_s: float | None = None
    chunk_first_block: list[int] = field(default_factory=list)  # per chunk, see docstring
    # Seconds of each part of the trace (index_and_wrap, keep_pass, traced_steps,
    # free_running_step, close): where the plan time goes.
    trace_phases_s: dict[str, float] = field(default_factory=dict)
    # Of "index_and_wrap": the chunk build's parts (host arena allocated, pinned,
    # parameters copied in; see ``ChunkManager.build_s``).
    wrap_build_s: dict[str, float] = field(default_factory=dict)
    # Device bytes of the trace's persistent chunks and their optimizer state (see
    # ``persistent_state_bytes``), and the offloaded chunks resident when the traced step
    # began: with the intervals, the picture's model states (``protrain.profile.timeline``).
    model_state_bytes: int | None = None
    start_resident_chunks: list[int] = field(default_factory=list)
    # The loss head's forward (the last block's forward end to the loss), seconds: what a
    # chunked loss computes again in backward (``protrain.plan.loss_chunk``).
    loss_forward_s: float = 0.0
    # The planner-owned loss the step was traced with (``protrain.plan.loss_chunk``): its
    # chunk of tokens (None: the whole logits at once, or a loss the planner does not own)
    # and the vocabulary of its logits (None: the loss is not the planner's to chunk).
    loss_chunk_tokens: int | None = None
    loss_vocab_size: int | None = None
    loss_tokens: int = 0  # positions the loss scores per micro-batch (labels' numel)
    loss_chunk_candidates: list[int | None] = field(default_factory=list)  # searched values
    # The output head (``get_output_embeddings()``) ran after the last block's forward, as a
    # causal LM's does: with a tied head (``chunks.tied_head_chunk``), when the engine
    # gathers that chunk again ([Note: a tied head] in plan/runtime.py). False in saved
    # profiles without it: no tied head counted.
    head_after_blocks: bool = False
    # The fused kernels the traced model ran (``protrain.model.kernels``): the plan records
    # them and the engine refuses to run it on a model with others.
    kernels: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelProfile:
        d = dict(d)
        d["blocks"] = [BlockProfile(**b) for b in d["blocks"]]
        d["intervals"] = [Interval(**i) for i in d["intervals"]]
        d["chunks"] = ChunkTable(**d["chunks"])
        d["grad_order"] = [tuple(x) for x in d.get("grad_order", [])]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> ModelProfile:
        return cls.from_dict(json.loads(s))


def _first_float_tensor(args, kwargs) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    return None


def _first_grad_output(out) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, (list, tuple)):
        for o in out:
            t = _first_grad_output(o)
            if t is not None:
                return t
    if isinstance(out, dict):
        return _first_grad_output(list(out.values()))
    return None


def _batch_shape(batch: dict) -> tuple[int, int]:
    ids = batch.get("input_ids")
    if ids is None:
        ids = next(v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2)
    return int(ids.shape[0]), int(ids.shape[1])


class _Sync:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _keep_pass(model, blocks, batch, loss_fn, clock: MemoryClock, sync: _Sync):
    """Forward under keep, saved storages counted per block and held one block at a time."""
    n = len(blocks)
    saved = [0] * n
    peak_keep = [0] * n
    input_bytes = [0] * n
    input_in_saved = [False] * n
    fwd_s = [0.0] * n
    current = {"i": -1, "held": [], "ids": {}, "t0": 0.0, "entry": 0, "input_ptr": None}

    def pack(t: torch.Tensor):
        i = current["i"]
        if i >= 0 and not is_parameter_like(t):
            st = t.untyped_storage()
            current["ids"].setdefault(st.data_ptr(), st.nbytes())
            current["held"].append(t)
        return None  # nothing is kept for a backward that never runs

    def unpack(_):
        raise RuntimeError("protrain trace: the keep pass has no backward")

    def pre(i):
        def hook(module, args, kwargs):
            x = _first_float_tensor(args, kwargs)
            t0 = sync()
            current.update(i=i, held=[], ids={}, t0=t0, entry=clock.now())
            if x is not None:
                input_bytes[i] = x.untyped_storage().nbytes()
                current["input_ptr"] = x.untyped_storage().data_ptr()
            clock.reset_peak()

        return hook

    def post(i):
        def hook(module, args, kwargs, out):
            t1 = sync()
            fwd_s[i] = t1 - current["t0"]
            peak_keep[i] = clock.peak() - current["entry"]
            saved[i] = sum(current["ids"].values())
            input_in_saved[i] = current["input_ptr"] in current["ids"]
            current.update(i=-1, held=[], ids={}, input_ptr=None)

        return hook

    handles = []
    for i, b in enumerate(blocks):
        handles.append(b.module.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(b.module.register_forward_hook(post(i), with_kwargs=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = loss_fn(model, batch)
        del loss
    finally:
        for h in handles:
            h.remove()
    return saved, peak_keep, input_bytes, input_in_saved, fwd_s


class _HeadAfterBlocks:
    """Hooks that see whether the output head runs after the last block's forward."""

    def __init__(self, model: nn.Module, blocks) -> None:
        self.seen = False
        self._last_done = False
        self.handles = []
        head = output_head(model)
        if head is None or not blocks:
            return
        self.handles.append(blocks[-1].module.register_forward_hook(self._block_done))
        self.handles.append(head.register_forward_pre_hook(self._head))

    def _block_done(self, *_) -> None:
        self._last_done = True

    def _head(self, *_) -> None:
        self.seen = self.seen or self._last_done

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class _StepTracer:
    """Hooks that cut one step into intervals and read time and memory at each cut."""

    def __init__(
        self,
        blocks,
        clock: MemoryClock,
        sync: _Sync,
        gathers: Callable[[], int],
        trainable: list[tuple[str, nn.Parameter, int]],
        copy_wait: Callable[[], float] = lambda: 0.0,
        resident: Callable[[], list[int]] = list,
    ):
        self.blocks = blocks
        self.copy_wait = copy_wait
        self.resident = resident
        self.clock = clock
        self.sync = sync
        self.gathers = gathers
        self.handles = []
        self.reset()
        for i, b in enumerate(blocks):
            self.handles.append(b.module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(b.module.register_forward_hook(self._post(i), with_kwargs=True))
        for name, p, chunk in trainable:
            self.handles.append(
                p.register_post_accumulate_grad_hook(self._accumulated(chunk, p.numel(), name))
            )

    def reset(self) -> None:
        self.intervals: list[Interval] = []
        self.fwd_entry: dict[int, tuple[float, int]] = {}
        self.fwd_s: dict[int, float] = {}
        self.fwd_peak: dict[int, int] = {}
        self.cut_kind, self.cut_block = "pre", -1
        self.base = 0
        self.t_start = 0.0
        self.grad_order: list[tuple[int, int]] = []
        self.grad_names: list[str] = []
        self.pending_wait = 0.0
        self.max_allocated = self.max_reserved = 0  # raw, over the step (CUDA)

    def start(self) -> None:
        self.t_start = self.sync()
        self.base = self.clock.now()
        self.cut_t, self.cut_g = self.t_start, self.gathers()
        self.cut_grads = 0
        self.copy_wait()  # drop the stalls from before the step
        self.pending_wait = 0.0
        self.start_resident = self.resident()
        self.clock.reset_peak()

    def since_cut(self) -> float:
        """Seconds of compute since the last cut (the running interval so far)."""
        t = self.sync()
        self.pending_wait += self.copy_wait()
        return max(t - self.cut_t - self.pending_wait, 0.0)

    def cut(self, next_kind: str, next_block: int, *, sync: bool = True) -> tuple[float, int]:
        """Close the running interval and open the next; return (time, bytes) at the cut."""
        t = self.sync() if sync else time.perf_counter()
        wait = self.pending_wait + (self.copy_wait() if sync else 0.0)
        self.pending_wait = 0.0
        now = self.clock.now() - self.base
        peak = self.clock.peak() - self.base
        g = self.gathers()
        allocated, reserved = self.clock.raw_peaks()
        self.max_allocated = max(self.max_allocated, allocated)
        self.max_reserved = max(self.max_reserved, reserved)
        self.intervals.append(
            Interval(
                kind=self.cut_kind,
                block=self.cut_block,
                start_s=self.cut_t - self.t_start,
                end_s=t - self.t_start,
                peak_bytes=max(peak, now),
                end_bytes=now,
                gathers=g - self.cut_g,
                reserved_overhead_bytes=reserved - allocated,
                grads_done=self.cut_grads,
                copy_wait_s=wait,
                resident_chunks=self.resident(),
            )
        )
        self.cut_kind, self.cut_block, self.cut_t, self.cut_g = next_kind, next_block, t, g
        self.cut_grads = len(self.grad_order)
        self.clock.reset_peak()
        return t, now

    def _pre(self, i):
        def hook(module, args, kwargs):
            if self.cut_kind in ("bwd", "head"):
                return  # a recomputation inside backward: part of the backward interval
            self.fwd_entry[i] = self.cut("fwd", i)

        return hook

    def _post(self, i):
        def hook(module, args, kwargs, out):
            t0, entry = self.fwd_entry.get(i, (None, 0))
            if t0 is None or self.cut_kind != "fwd" or self.cut_block != i:
                return
            t = self.sync()
            wait = self.copy_wait()
            self.pending_wait += wait
            self.fwd_s[i] = max(t - t0 - wait, 0.0)
            self.fwd_peak[i] = self.clock.peak() - self.base - entry
            y = _first_grad_output(out)
            if y is not None:
                y.register_hook(self._grad_of_output(i))
            if i == len(self.blocks) - 1:
                self.cut("head", -1)

        return hook

    def _accumulated(self, chunk: int, numel: int, name: str):
        def hook(param):
            # After the engine's own hook has taken the gradient: a new interval, same block.
            self.grad_order.append((chunk, numel))
            self.grad_names.append(name)
            self.cut(self.cut_kind, self.cut_block, sync=False)

        return hook

    def _grad_of_output(self, i):
        def hook(grad):
            self.cut("bwd", i)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _free_running_step(model, blocks, batch, loss_fn, optimizer, sync, copy_wait):
    """One step timed at four synchronizations only; (pre, blocks' forward, fwd+bwd, loss
    forward) s. The loss forward is the last block's forward end to the loss."""
    marks: dict[str, tuple[float, float]] = {}

    def mark(name):
        if name not in marks:
            t = sync()
            marks[name] = (t, copy_wait())

    h0 = blocks[0].module.register_forward_pre_hook(lambda *_: mark("first"))
    h1 = blocks[-1].module.register_forward_hook(lambda *_: mark("last"))
    try:
        t0 = sync()
        copy_wait()  # drop the stalls from before the step
        loss = loss_fn(model, batch)
        t_loss = sync()
        w_loss = copy_wait()
        loss.backward()
        del loss
        t3 = sync()
        w3 = copy_wait()
        _optimizer_step(optimizer)
    finally:
        h0.remove()
        h1.remove()
    (t1, w1), (t2, w2) = marks["first"], marks["last"]
    pre = max(t1 - t0 - w1, 0.0)
    blocks_fwd = max(t2 - t1 - w2, 0.0)
    loss_fwd = max(t_loss - t2 - w_loss, 0.0)
    return pre, blocks_fwd, max(t3 - t0 - w1 - w2 - w_loss - w3, 0.0), loss_fwd


# The free-running step is the step model's compute: one sample of it is noisy. Llama-3.2-1B
# at batch 1 (a 0.075-0.096 s step) on three H100 hosts: 0.096, 0.136 and
# 0.124 s, so the same plan was predicted 0.077, 0.113 and 0.112 s. The fastest of up to
# FREE_RUNS is kept, the runs after the first only while they cost little.
FREE_RUNS = 3
FREE_RUNS_BUDGET_S = 2.0


def _fastest_free_running_step(model, blocks, batch, loss_fn, optimizer, sync, copy_wait):
    """:func:`_free_running_step` up to ``FREE_RUNS`` times, while the runs so far took under
    ``FREE_RUNS_BUDGET_S``; the run of the least fwd+bwd seconds."""
    runs = [_free_running_step(model, blocks, batch, loss_fn, optimizer, sync, copy_wait)]
    while len(runs) < FREE_RUNS and sum(r[2] for r in runs) < FREE_RUNS_BUDGET_S:
        runs.append(_free_running_step(model, blocks, batch, loss_fn, optimizer, sync, copy_wait))
    return min(runs, key=lambda r: r[2])


# [Note: the plain layout measured]
# The free-running step recomputes every block, and the runtime model takes a block's
# recompute as its forward seconds. Where the host's launch time bounds the step, the
# checkpointing's own work adds more than that: Llama-3.2-1B at batch 1 on an H100
# stepped in 0.077 s with no recompute and 0.117 s with every block recomputed, against
# 0.021 s of blocks' forward. When every chunk is persistent in the trace (the plan's
# layout has no gathers to add) the step with no block recomputed is measured as well, if
# its activations fit: the traced peak plus every block's saved bytes (the keep pass) and
# a quarter more, within the device's cap. The runtime model then takes it as the step with
# nothing recomputed and the difference of the two runs as the recompute of all blocks
# (``plan/runtime.py``), so both ends of the activation policies are measured steps.
_KEEP_ALL_MARGIN = 1.25


def _keep_all_fits(
    device: torch.device, traced_peak: int, saved: list[int], budget: int | None = None
) -> bool:
    """Whether a step with no block recomputed fits: see [Note: the plain layout measured].
    ``traced_peak``: the checkpointed step's allocated peak (model states included);
    ``budget``: the plan's device budget, bytes (None: the device's own limit only)."""
    need = traced_peak + _KEEP_ALL_MARGIN * sum(saved)
    if budget is not None and need > budget:
        return False
    if device.type != "cuda":
        return True
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _d: 1.0)(device)
    limit = min(total * fraction, torch.cuda.memory_reserved(device) + free)
    return need <= limit


def _keep_all_free_running_step(model, blocks, batch, loss_fn, optimizer, sync, copy_wait):
    """The fastest free-running step's fwd+bwd seconds with no block recomputed; None if
    it ran out of memory after all (the engine's buffers stay as they were: every chunk is
    persistent)."""
    try:
        return _fastest_free_running_step(
            model, blocks, batch, loss_fn, optimizer, sync, copy_wait
        )[2]
    except torch.OutOfMemoryError:
        optimizer.zero_grad()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.warning("protrain trace: the step with no block recomputed ran out of memory")
        return None


def _optimizer_step(optimizer) -> None:
    """The traced steps' optimizer step: the persistent chunks' on the device, none on the
    host (see ``HybridAdamW.step_without_host_updates``; ``lr=0`` changes no weight)."""
    optimizer.step_without_host_updates()
    optimizer.zero_grad()
    optimizer.synchronize()


def persistent_state_bytes(manager) -> int:
    """Device bytes of the persistent chunks and their optimizer state: each chunk's buffer,
    and per trainable parameter its fp32 master (measured), AdamW's two moments of the
    master's size and its 4-byte step (torch's fused AdamW keeps these per parameter)."""
    total = 0
    for c in manager.chunks:
        if not c.persistent:
            continue
        total += c.device_buffer.untyped_storage().nbytes()
        for s in c.trainable_slots:
            total += 3 * s.master.untyped_storage().nbytes() + 4
    return total


def chunk_first_blocks(
    block_names: list[list[str]], chunk_of: dict[str, int], n_chunks: int
) -> list[int]:
    """Per chunk, the first block whose parameters it holds (-1 before the first block's,
    ``len(block_names)`` after the last one's): chunks are packed in execution order.
    ``block_names``: per block, its parameters' full names (``param_index.block_param_names``)."""
    first = [None] * n_chunks
    for i, names in enumerate(block_names):
        for full in names:
            c = chunk_of.get(full)
            if c is not None and first[c] is None:
                first[c] = i
    out, nxt = [0] * n_chunks, len(block_names)
    for c in reversed(range(n_chunks)):  # a chunk with no block parameters: by its place
        if first[c] is not None:
            nxt = first[c]
            out[c] = first[c]
        else:
            out[c] = -1 if all(f is None for f in first[:c]) else nxt
    return out


_TRACED_KNOBS = ("n_persist", "n_buffer", "chunk_size_bytes", "tiled_mlp_tokens")


class _Phases:
    """Seconds by part of the trace, each part timed from the end of the one before."""

    def __init__(self) -> None:
        self.start = self.mark = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self.mark, 3)
        self.mark = now


def _trace_knobs(knobs: Knobs | None) -> Knobs:
    """The knobs a trace runs with: the layout's and tiled MLPs'; the activation policies
    and the rest are the trace's to measure, so giving one is refused."""
    knobs = knobs or Knobs()
    default = Knobs()
    other = {
        k: v for k, v in vars(knobs).items() if k not in _TRACED_KNOBS and v != getattr(default, k)
    }
    if other:
        raise ValueError(
            f"trace_model: knobs {other} are not traced; give only {', '.join(_TRACED_KNOBS)}"
        )
    return knobs


def trace_model(
    model: nn.Module,
    sample_batch: dict,
    *,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    knobs: Knobs | None = None,
    loss_fn: LossFn = hf_loss,
    steps: int = 2,
    gpu_budget_bytes: int | None = None,
) -> ModelProfile:
    """Trace ``model`` at ``sample_batch`` under the chunk engine; return its profile.
    The trace runs on this process alone, whatever process group is initialized: with
    several ranks one rank traces, what a rank computes being the same on every rank.

    ``knobs``: the engine's ``n_persist``/``n_buffer``/``chunk_size_bytes`` during the
    trace (None: every chunk persistent) and its ``tiled_mlp_tokens`` (tiled MLPs, as
    training will run them); the caller picks ``n_persist=0`` for a model that does not
    fit. The model is unchanged afterwards (wrapped with ``lr=0`` and closed again).
    ``loss_fn`` is the training loss (e.g. a chunked loss). ``gpu_budget_bytes``: the
    plan's device budget, which the step with nothing recomputed must fit to be measured
    ([Note: the plain layout measured]).
    """
    phase = _Phases()
    device = resolve_device(device)
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    knobs = _trace_knobs(knobs)
    tiled_mlp_tokens = knobs.tiled_mlp_tokens
    layout = discover_blocks(model)
    blocks = layout.blocks
    index = param_index(model)
    table, chunk_of = chunk_table_and_index(
        model, compute_dtype=compute_dtype, chunk_size_bytes=knobs.chunk_size_bytes, index=index
    )
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sample_batch.items()}
    bsz, seq = _batch_shape(batch)
    # The weights on the host, kept to be given back as they are: no weight changes in the
    # trace, and close() would otherwise copy every one back out of the chunks. On the
    # host only: kept device weights would take memory from the traced step.
    originals = {p: p.data for p in model.parameters() if p.device.type == "cpu"}
    model, optimizer, chunk_layout = _wrap_for_trace(model, table, knobs, device, compute_dtype)
    engine = model._protrain_engine
    manager = engine.manager
    chunk_bytes = chunk_layout.chunk_size_bytes
    phase("index_and_wrap")

    def pool_bytes() -> int:
        return len(manager.resident) * chunk_bytes

    sync = _Sync(device)
    handle = None
    try:
        keep, head_after_blocks = _keep_pass_clocked(
            model, layout, batch, loss_fn, sync, pool_bytes, tiled_mlp_tokens
        )
        saved = keep[0]
        phase("keep_pass")
        handle = apply_activation_knobs(
            model, 0, len(blocks), device=device, layout=layout, tiled_mlp_tokens=tiled_mlp_tokens
        )
        trainable = [(n, p, chunk_of[n]) for n, p in model.named_parameters() if p.requires_grad]
        copy_wait = _copy_wait(manager, device)
        tracer, loss_forward_s, t_end = _traced_steps(
            model, optimizer, blocks, batch, loss_fn, trainable, copy_wait, sync, steps, pool_bytes
        )
        # The step's reserved peak minus its allocated peak, both raw (buffer pool
        # included): what the allocator holds beyond the most the step ever had allocated.
        # One interval's own figure overstated it: in the optimizer step, the released pool
        # buffers (3 x 1.24 GiB on a 3B model) count as cache.
        overhead = max(tracer.max_reserved - tracer.max_allocated, 0)
        model_states = persistent_state_bytes(manager)
        phase("traced_steps")
        # Outside the memory clock: on the CPU its dispatch mode sees every op, and that
        # bookkeeping costs more than a small model's compute (see the module docstring).
        free_pre, free_blocks, free_total, free_loss = _fastest_free_running_step(
            model, blocks, batch, loss_fn, optimizer, sync, copy_wait
        )
        phase("free_running_step")
        free_keep = None
        if not manager.offloaded and _keep_all_fits(
            device, tracer.max_allocated, saved, gpu_budget_bytes
        ):
            handle.remove()
            handle = apply_activation_knobs(
                model, 0, 0, device=device, layout=layout, tiled_mlp_tokens=tiled_mlp_tokens
            )
            free_keep = _keep_all_free_running_step(
                model, blocks, batch, loss_fn, optimizer, sync, copy_wait
            )
            phase("free_running_step_keep")
    finally:
        if handle is not None:
            handle.remove()
        engine.close(originals)
        del originals
    phase("close")

    iv = tracer.intervals
    block_profiles = _block_profiles(blocks, tracer, *keep)
    head, pre, opt = (next(x for x in iv if x.kind == k) for k in ("head", "pre", "opt"))
    phase("summarize")  # the profile built from the trace: the parts then cover trace_s
    profile = ModelProfile(
        kernels=list(applied_kernels(_causal_lm(model))),
        blocks=block_profiles,
        intervals=iv,
        chunks=table,
        batch_size=bsz,
        seq_len=seq,
        device=str(device),
        compute_dtype=str(compute_dtype).removeprefix("torch."),
        trace_n_persist=chunk_layout.n_persist,
        trace_n_buffer=chunk_layout.n_buffer,
        step_s=t_end - tracer.t_start,
        pre_fwd_s=pre.compute_s,
        head_s=head.compute_s,
        post_bwd_s=0.0,
        optimizer_step_s=opt.end_s - opt.start_s,
        allocator_overhead_bytes=overhead,
        grad_order=list(tracer.grad_order),
        grad_names=list(tracer.grad_names),
        step_start_bytes=tracer.base if device.type == "cuda" else None,
        trace_s=phase.mark - phase.start,
        free_pre_fwd_s=free_pre,
        free_blocks_fwd_s=free_blocks,
        free_fwd_bwd_s=free_total,
        free_loss_forward_s=free_loss,
        free_keep_fwd_bwd_s=free_keep,
        chunk_first_block=chunk_first_blocks(block_param_names(blocks), chunk_of, table.n_chunks),
        trace_phases_s=phase.seconds,
        wrap_build_s=dict(manager.build_s),
        model_state_bytes=model_states,
        start_resident_chunks=tracer.start_resident,
        loss_forward_s=loss_forward_s,
        head_after_blocks=head_after_blocks,
    )
    log.info(
        "traced %d blocks at batch %d x %d in %.1f s (traced step %.3f s; free-running "
        "forward + backward %.3f s; seconds by part: %s; of the wrap: %s)",
        *(len(blocks), bsz, seq, profile.trace_s, profile.step_s, free_total),
        *(phase.seconds, manager.build_s),
    )
    return profile


def _wrap_for_trace(
    model: nn.Module,
    table: ChunkTable,
    knobs: Knobs,
    device: torch.device,
    compute_dtype: torch.dtype,
):
    """The engine's own wrap at the traced layout, with ``lr=0``: the profiler sits below
    "plan, then wrap" (``planned_wrap.py``). With offloaded chunks and no ``n_buffer``,
    one buffer more than a module or block needs."""
    n_persist, n_buffer = knobs.n_persist, knobs.n_buffer
    if n_persist is not None and n_persist < table.n_chunks and n_buffer is None:
        need = max(table.min_buffers, 2)
        n_buffer = min(table.n_chunks - n_persist, need + 1)
    return engine_wrap(
        model,
        Knobs(n_persist=n_persist, n_buffer=n_buffer, chunk_size_bytes=table.chunk_size_bytes),
        device=device,
        compute_dtype=compute_dtype,
        optim=OptimizerSettings(lr=0.0),
        discard_offloaded_grads=True,  # stepped without host updates: never read
        process_group=NO_GROUP,
    )


def _traced_steps(
    model, optimizer, blocks, batch, loss_fn, trainable, copy_wait, sync, steps, pool_bytes
):
    """The traced steps under the memory clock, every block checkpointed: the last step's
    tracer, its loss forward seconds and its end time.

    On CUDA one more step, and the caching allocator emptied after the first: the keep
    pass and the first step (kernels, the persistent chunks' optimizer state) leave
    blocks cached that training with the plan never has, and reserved minus allocated
    read over them overstated the allocator term (qlora-70b: 6.21 GiB traced against
    2.8-3.8 GiB in training). The kept step then runs on the cache that a traced step
    of its own left, as every training step after the first does. (The free-running step in
    its place, one step fewer, put the allocator term at 3.5-4.9 GiB on full-8b against
    training's 2.3-2.8, and its totals would include refilling an emptied cache.)"""
    manager = model._protrain_engine.manager
    device = sync.device
    cuda = device.type == "cuda"
    with MemoryClock(device, exclude=pool_bytes) as clock:
        for i in range(max(steps + 1, 3) if cuda else max(steps, 1)):
            if cuda and i == 1:
                torch.cuda.empty_cache()
            tracer = _StepTracer(
                blocks,
                clock,
                sync,
                lambda: manager.stats["gathers"],
                trainable,
                copy_wait,
                resident=lambda: sorted(manager.resident),
            )
            try:
                tracer.start()
                loss = loss_fn(model, batch)
                # the head's interval so far: the loss's forward (0: no head cut)
                loss_forward_s = tracer.since_cut() if tracer.cut_kind == "head" else 0.0
                loss.backward()
                del loss
                tracer.cut("opt", -1)
                _optimizer_step(optimizer)
                t_end, _ = tracer.cut("end", -1)
            finally:
                tracer.remove()
    return tracer, loss_forward_s, t_end


def _keep_pass_clocked(model, layout, batch, loss_fn, sync, pool_bytes, tiled_mlp_tokens):
    """The keep pass under the memory clock (with tiled MLPs where training tiles them):
    per block its saved bytes, forward peak, input bytes, whether its input is among the
    saved, forward seconds; and whether the output head ran after the blocks."""
    device, blocks, handle = sync.device, layout.blocks, None
    try:
        with MemoryClock(device, exclude=pool_bytes) as clock:
            if tiled_mlp_tokens is not None:
                handle = apply_activation_knobs(
                    model, 0, 0, device=device, layout=layout, tiled_mlp_tokens=tiled_mlp_tokens
                )
            head_order = _HeadAfterBlocks(model, blocks)
            try:
                keep = _keep_pass(model, blocks, batch, loss_fn, clock, sync)
            finally:
                head_order.remove()
    finally:
        if handle is not None:
            handle.remove()
    return keep, head_order.seen


def _copy_wait(manager, device: torch.device) -> Callable[[], float]:
    """Seconds the compute stream waited on chunk copies so far (0 off CUDA): copies are
    always timed there (``chunks/copy_times.py``)."""
    if device.type == "cuda" and hasattr(manager, "copy_wait_s"):
        return manager.copy_wait_s
    return lambda: 0.0


def _block_profiles(
    blocks, tracer, saved, peak_keep, input_bytes, input_in_saved, keep_fwd_s
) -> list[BlockProfile]:
    """Each block's profile: its backward is the traced interval's compute less the
    recomputed forward; what the keep pass measured about its saved activations. The
    backward interval of block 0 runs to the end of backward: what follows block 0's own
    backward (embedding gradients) has no hook of its own and stays in it."""
    bwd_compute: dict[int, float] = {}
    for x in tracer.intervals:
        if x.kind == "bwd":
            bwd_compute[x.block] = bwd_compute.get(x.block, 0.0) + x.compute_s
    out = []
    for i, b in enumerate(blocks):
        fwd_s = tracer.fwd_s.get(i, keep_fwd_s[i])
        out.append(
            BlockProfile(
                name=b.name,
                fwd_s=fwd_s,
                bwd_s=max(bwd_compute.get(i, 0.0) - fwd_s, 0.0),
                recompute_s=fwd_s,
                saved_bytes=saved[i],
                input_bytes=input_bytes[i],
                input_in_saved=input_in_saved[i],
                fwd_peak_keep_bytes=peak_keep[i],
                fwd_peak_checkpoint_bytes=tracer.fwd_peak.get(i, 0),
            )
        )
    return out
