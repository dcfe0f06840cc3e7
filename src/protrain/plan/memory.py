"""Predicted peak device memory: a sum of measured terms.

``peak = model_states(n_persist) + buffer_pool(n_buffer) + activations(n_swap, n_checkpoint)
+ offload_grad_transient(n_persist) + other_resident + allocator_overhead``

- **model states**: for each persistent chunk, its bytes, and per trainable parameter in it
  the fp32 master and the two fp32 Adam moments (12 bytes per parameter) plus Adam's 4-byte
  step tensor per trainable tensor; exact, from the layout. With ``optimizer="adamw_8bit"``
  the moments are bitsandbytes' 8-bit state (``optim/adamw_8bit.py``): 2 bytes a parameter,
  an fp32 absmax per 256 elements of a tensor, the two quantization maps once, no step
  tensor (a Python int), and fp32 moments for tensors under its ``MIN_8BIT_SIZE``. The
  table has each chunk's trainable elements and tensors, not each tensor's size, so this
  count is a bound (exact for a chunk of one trainable tensor): every tensor's last block
  counted whole, and up to ``MIN_8BIT_SIZE - 1`` elements per tensor counted as small (at
  most 24 KiB a tensor over), never more than fp32 moments. The host's moments are in
  ``optimizer_state``'s format (``optim/state_format.py``: 8, 4 or 2 + 1/32 bytes a
  parameter) either way.
- **buffer pool**: ``n_buffer`` chunks.
- **activations**: the traced step (every block checkpointed) gives the peak of every interval
  between block hooks, relative to the step's start (see ``protrain.profile.trace``). A plan's
  policies change those peaks by measured per-block amounts: each block ``j`` before the
  interval retains ``R_j`` instead of its checkpoint input ``I_j`` (``keep``: its saved bytes
  ``S_j``; ``swap``: nothing on the device); in its own forward a kept or swapped block peaks
  at its measured keep peak instead of its checkpoint peak; in its own backward it does not
  hold the checkpoint input (unless that input is among its saved tensors). A swapped
  block's device copy lives until its transfer ends, so with any swap the largest swapped
  ``S_j`` is added to block intervals: the swapper's one group in flight. The engine makes
  a persistent chunk's fp32 gradient accumulators in backward and frees them at
  ``zero_grad``: the trace cuts backward at every accumulation and records the order, so
  each interval knows exactly which parameters have their 4 bytes per element; those of
  the trace's persistent chunks are taken out of its peaks, and the plan's put back. The activation side's peak is the largest
  interval.
- **offload gradient transient**: the fp32 piece (at most 2^26 elements of the largest
  offloaded trainable parameter) the engine makes on the device when it casts an offloaded
  gradient before copying it to the host, and when it copies updated fp32 masters in before
  casting them into the chunk; counted when the plan offloads trainable chunks and the trace
  did not (otherwise the trace measured it).
- **other resident bytes** (CUDA): allocated at the traced step's start beyond the trace's
  model states (module buffers, library workspaces).
- **gradient reduce buckets** (several ranks), in the activation side's backward intervals
  (the loss head's included): backward copies each chunk's gradients into a bucket of the
  chunk's size and reduces it on its own stream (``distributed/grad_reducer.py``): the
  bucket being filled, the one being reduced, and a reduce-scatter's output shard (sharded
  mode) are live at once. A peak in forward does not hold them.
- **device step** (``n_device_step`` > 0, ``optim/device_step.py``): the staging sets of the
  pipeline (fp32 gradients, masters and two moments, and the cast weights, of one piece per
  set: ``staging_bytes``), its only device memory: the device-stepped chunks' gradients are
  accumulated on the host as every offloaded chunk's, so nothing grows with their
  parameters but the piece, up to ``PIECE_NUMEL``.
- **allocator overhead** (CUDA): the traced step's reserved peak minus its allocated peak,
  both raw (buffer pool included), in a step that ran on the cache of one step like it (the
  trace empties the cache after its first step).
"""

from __future__ import annotations

import numpy as np

from protrain.optim.adamw_8bit import BLOCK, MIN_8BIT_SIZE, QMAP_BYTES, check_optimizer
from protrain.optim.device_step import PIECE_NUMEL, staging_bytes
from protrain.optim.state_format import moment_bytes_per_param
from protrain.plan.world import SINGLE, World
from protrain.profile.trace import ModelProfile

KEEP, CHECKPOINT, SWAP = 0, 1, 2
ADAM_DEVICE_BYTES_PER_PARAM = 12  # fp32 master, exp_avg, exp_avg_sq
ADAM_STEP_BYTES_PER_TENSOR = 4  # fused AdamW's fp32 step count per parameter tensor
GRAD_PIECE_NUMEL = 1 << 26  # runtime.grad_offload casts offloaded gradients in such pieces
_ALIGN = 64


def device_optimizer_bytes(
    trainable_numel: np.ndarray, trainable_tensors: np.ndarray, optimizer: str = "adamw"
) -> np.ndarray:
    """Per persistent chunk: the device bytes of its fp32 masters and optimizer state (see
    the module note: exact for ``"adamw"``, a bound for ``"adamw_8bit"``); the 8-bit
    quantization maps, allocated once, are not in it."""
    trn = np.asarray(trainable_numel, dtype=np.int64)
    tensors = np.asarray(trainable_tensors, dtype=np.int64)
    check_optimizer(optimizer)
    if optimizer == "adamw":
        return ADAM_DEVICE_BYTES_PER_PARAM * trn + ADAM_STEP_BYTES_PER_TENSOR * tensors
    absmax = 8 * (trn // BLOCK + tensors)  # two fp32 per block; each tensor's tail a block
    small = 6 * np.minimum(trn, tensors * (MIN_8BIT_SIZE - 1))  # fp32 moments: 8, not 2
    bound = np.minimum(6 * trn + absmax + small, 12 * trn)  # never more than fp32 moments
    # a chunk of one trainable tensor: exact
    one = np.where(trn < MIN_8BIT_SIZE, 12 * trn, 6 * trn + 8 * (-(-trn // BLOCK)))
    return np.where(tensors == 1, one, bound)


def _align(n: np.ndarray) -> np.ndarray:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def policy_matrix(n_blocks: int, n_swap: np.ndarray, n_checkpoint: np.ndarray) -> np.ndarray:
    """One row of block policies per (n_swap, n_checkpoint) pair: the rule of
    ``protrain.activations.policy.place_policies``, for many pairs at once."""
    s = np.asarray(n_swap, dtype=np.int64)
    m = s + np.asarray(n_checkpoint, dtype=np.int64)
    cols = np.arange(n_blocks)[None, :]
    pol = np.where(cols < m[:, None], CHECKPOINT, KEEP).astype(np.int8)
    k = np.arange(n_blocks)[None, :]
    safe_s = np.maximum(s, 1)[:, None]
    pos = (2 * k * m[:, None] + s[:, None]) // (2 * safe_s)
    valid = k < s[:, None]
    rows = np.broadcast_to(np.arange(len(s))[:, None], pos.shape)
    pol[rows[valid], pos[valid]] = SWAP
    return pol


class MemoryModel:
    """The terms above, precomputed from a profile for fast evaluation of many knobs."""

    def __init__(
        self,
        profile: ModelProfile,
        world: World = SINGLE,
        optimizer: str = "adamw",
        optimizer_state: str = "fp32",
    ):
        self.profile = profile
        self.world = world
        self.optimizer = optimizer  # optim/adamw_8bit.py: the persistent chunks' state
        t = profile.chunks
        self.chunk_bytes = t.chunk_size_bytes
        self.n_chunks = t.n_chunks
        trn = np.asarray(t.trainable_numel, dtype=np.int64)
        self._trn = trn
        tensors = np.asarray(t.trainable_tensors, dtype=np.int64)
        # model_states[k]: the first k chunks persistent
        self.model_states = np.concatenate(
            [[0], np.cumsum(self.chunk_bytes + device_optimizer_bytes(trn, tensors, optimizer))]
        )
        if optimizer == "adamw_8bit":  # the quantization maps, once the first 8-bit tensor is
            big = np.asarray(t.max_trainable_numel, dtype=np.int64) >= MIN_8BIT_SIZE
            self.model_states[1:] += np.where(np.cumsum(big) > 0, QMAP_BYTES, 0)
        # the trace's own model states: it steps with torch's AdamW
        traced_model_states = np.concatenate(
            [[0], np.cumsum(self.chunk_bytes + device_optimizer_bytes(trn, tensors))]
        )
        # host: offloaded chunk copies, fp32 master + accumulator + low-precision landing
        # place per trainable parameter, Adam moments (in the state format) + step on the host
        itemsize = np.asarray(t.trainable_bytes, dtype=np.int64) // np.maximum(trn, 1)
        moments = np.ceil(moment_bytes_per_param(optimizer_state) * trn).astype(np.int64)
        host_chunk = self.chunk_bytes + _align(4 * trn) * 2 + _align(itemsize * trn) + moments
        host_chunk += ADAM_STEP_BYTES_PER_TENSOR * tensors
        if optimizer_state == "8bit":  # a bound: each tensor's last absmax block counted whole
            host_chunk += 8 * tensors
        # sharded: a rank holds its shard of each offloaded chunk's host state (World)
        host_chunk = -(-host_chunk // world.shards)
        self.host_suffix = np.concatenate([np.cumsum(host_chunk[::-1])[::-1], [0]])
        # the largest offloaded gradient piece when chunks k.. are offloaded
        piece = np.minimum(np.asarray(t.max_trainable_numel, dtype=np.int64), GRAD_PIECE_NUMEL)
        suffix_max = np.concatenate([np.maximum.accumulate(piece[::-1])[::-1], [0]])
        traced_offloaded_trainable = bool(trn[profile.trace_n_persist :].sum() > 0)
        self.grad_piece = (
            np.zeros_like(suffix_max)
            if traced_offloaded_trainable or profile.device == "cpu"
            else 4 * suffix_max
        )
        self.allocator_overhead = int(profile.allocator_overhead_bytes)
        self.reduce_buckets = 0
        if world.distributed and trn.sum() > 0:
            self.reduce_buckets = 2 * self.chunk_bytes + self.chunk_bytes // world.shards
        # CUDA: what was resident at the traced step's start beyond the trace's model states
        # (module buffers, library workspaces): measured, and the same for every plan.
        self.other_resident = 0
        if profile.step_start_bytes is not None:
            traced_states = int(traced_model_states[min(profile.trace_n_persist, self.n_chunks)])
            self.other_resident = max(0, profile.step_start_bytes - traced_states)
        self._prepare_activations()

    def _prepare_activations(self) -> None:
        p = self.profile
        b = p.blocks
        self.n_blocks = len(b)
        self.saved = np.asarray([x.saved_bytes for x in b], dtype=np.int64)
        self.inp = np.asarray([x.input_bytes for x in b], dtype=np.int64)
        in_saved = np.asarray([x.input_in_saved for x in b], dtype=bool)
        self.fwd_keep_extra = np.asarray(
            [x.fwd_peak_keep_bytes - x.fwd_peak_checkpoint_bytes for x in b], dtype=np.int64
        )
        self.bwd_keep_extra = np.where(in_saved, 0, -self.inp)
        ivs = [iv for iv in p.intervals if iv.kind in ("pre", "fwd", "head", "bwd", "opt")]
        self.iv_kind = np.asarray([iv.kind for iv in ivs])
        self.iv_block = np.asarray([iv.block for iv in ivs], dtype=np.int64)
        # grads[k, n]: bytes of persistent gradient accumulators live in interval k when the
        # first n chunks are persistent: 4 per parameter accumulated before k in a chunk < n
        order = np.asarray(p.grad_order, dtype=np.int64).reshape(-1, 2)
        step = np.zeros((len(order) + 1, self.n_chunks + 2), dtype=np.int64)
        step[np.arange(1, len(order) + 1), order[:, 0] + 1] = order[:, 1]
        done = np.cumsum(np.cumsum(step, axis=0), axis=1)[:, : self.n_chunks + 1]
        done_k = np.asarray([iv.grads_done for iv in ivs], dtype=np.int64)
        done_k = np.where(np.asarray([iv.kind == "opt" for iv in ivs]), len(order), done_k)
        self.grads = 4 * done[done_k]
        traced = self.grads[:, min(p.trace_n_persist, self.n_chunks)]
        self.iv_base = np.asarray([iv.peak_bytes for iv in ivs], dtype=np.int64) - traced
        # several ranks: gradient buckets live while backward (the head's too) makes gradients
        in_backward = np.isin(self.iv_kind, ("bwd", "head"))
        self.iv_base = self.iv_base + np.where(in_backward, self.reduce_buckets, 0)
        self.is_fwd = self.iv_kind == "fwd"
        self.is_bwd = self.iv_kind == "bwd"
        self.is_head = self.iv_kind == "head"
        # which blocks' retention counts before each interval (prefix length)
        self.iv_prefix = np.where(
            self.is_fwd | self.is_bwd, self.iv_block, np.where(self.is_head, self.n_blocks, 0)
        )
        self.iv_own = np.where(self.is_fwd | self.is_bwd, self.iv_block, 0)
        # Segments: the intervals that a plan's policies change by the same bytes (same kind,
        # same retained prefix, same own block; a block's backward is cut at every gradient
        # accumulation, so a LoRA model has several per block). A plan's activation term is
        # computed per segment, and the measured rest (interval base plus persistent
        # gradients, for every n_persist) is folded into its segment's maximum once.
        code = np.select([self.is_fwd, self.is_bwd, self.is_head], [1, 2, 3], 0)
        key = np.stack([code, self.iv_prefix, self.iv_own], axis=1)
        _, first, seg_of = np.unique(key, axis=0, return_index=True, return_inverse=True)
        seg_of = seg_of.reshape(-1)
        n_seg = len(first)
        self.seg_peak = np.full((n_seg, self.n_chunks + 1), np.iinfo(np.int64).min // 4)
        np.maximum.at(self.seg_peak, seg_of, self.iv_base[:, None] + self.grads)
        self.seg_base = np.full(n_seg, np.iinfo(np.int64).min // 4)
        np.maximum.at(self.seg_base, seg_of, self.iv_base)
        self.seg_fwd, self.seg_bwd = self.is_fwd[first], self.is_bwd[first]
        self.seg_prefix, self.seg_own = self.iv_prefix[first], self.iv_own[first]
        self.seg_head = self.is_head[first]
        self.seg_of = seg_of  # per interval, its segment
        # per segment, its first interval whose base is the segment's largest (the search's
        # lower bound picks intervals as it did before segments)
        at_max = self.iv_base == self.seg_base[seg_of]
        self.seg_first_max = np.full(n_seg, len(seg_of))
        np.minimum.at(self.seg_first_max, seg_of[at_max], np.flatnonzero(at_max))

    # ---- terms ----------------------------------------------------------------------

    def segment_activations(self, pol: np.ndarray) -> np.ndarray:
        """The policies' activation bytes in each segment (see ``_prepare_activations``),
        one row per policy row; add :attr:`seg_peak` (measured base and persistent
        gradients) for the segment's peak: :meth:`peak_over_persist`."""
        keep, swap = pol == KEEP, pol == SWAP
        delta = np.where(keep, self.saved - self.inp, 0) + np.where(swap, -self.inp, 0)
        before = np.concatenate([np.zeros((len(pol), 1), np.int64), np.cumsum(delta, 1)], 1)
        own = (keep | swap)[:, self.seg_own]
        own_extra = np.where(
            self.seg_fwd, self.fwd_keep_extra[self.seg_own], self.bwd_keep_extra[self.seg_own]
        )
        in_flight = np.where(swap, self.saved, 0).max(axis=1, initial=0)[:, None]
        blockwise = self.seg_fwd | self.seg_bwd
        out = before[:, self.seg_prefix]
        out = out + np.where(own & blockwise, own_extra, 0) + np.where(blockwise, in_flight, 0)
        return out

    def peak_over_persist(self, seg_row: np.ndarray, n_persist: np.ndarray) -> np.ndarray:
        """Activation-side peak (activations + persistent gradients) for each ``n_persist``,
        given one row of :meth:`segment_activations`."""
        return (seg_row[:, None] + self.seg_peak[:, n_persist]).max(axis=0)

    def activation_peak(self, n_swap, n_checkpoint, n_persist) -> np.ndarray:
        """Activation-side peak bytes for each (n_swap, n_checkpoint) pair at ``n_persist``."""
        n_swap = np.atleast_1d(np.asarray(n_swap, dtype=np.int64))
        n_checkpoint = np.atleast_1d(np.asarray(n_checkpoint, dtype=np.int64))
        pol = policy_matrix(self.n_blocks, n_swap, n_checkpoint)
        seg = self.segment_activations(pol)
        return (seg + self.seg_peak[:, n_persist][None, :]).max(axis=1)

    def swap_host_bytes(self, pol: np.ndarray) -> np.ndarray:
        return np.where(pol == SWAP, self.saved, 0).sum(axis=1)

    def device_step_terms(self, n_persist: int, n_device_step: int) -> dict[str, int]:
        """The device step's bytes (see the module note): {} when it steps nothing."""
        idx = np.flatnonzero(self._trn[n_persist:] > 0) + n_persist
        chunks = idx[max(len(idx) - n_device_step, 0) :] if n_device_step else idx[:0]
        # sharded: a rank steps its own shard of each chunk
        numel = -(-int(self._trn[chunks].sum()) // self.world.shards)
        if not numel:
            return {}
        piece = min(PIECE_NUMEL, -(-numel // 16) * 16)
        return {"device_step_staging": staging_bytes(piece)}

    def terms(
        self, n_persist: int, n_buffer: int, n_swap: int, n_checkpoint: int, n_device_step=0
    ) -> dict:
        """Every term of one plan, in bytes (their sum is the predicted peak)."""
        return {
            "model_states": int(self.model_states[n_persist]),
            "buffer_pool": int(n_buffer * self.chunk_bytes),
            "activations_and_gradients": int(
                self.activation_peak(n_swap, n_checkpoint, n_persist)[0]
            ),
            "offload_grad_transient": int(self.grad_piece[n_persist]),
            "other_resident": self.other_resident,
            "allocator_overhead": self.allocator_overhead,
            **self.device_step_terms(n_persist, n_device_step),
        }

    def host_bytes(self, n_persist: int, n_swap: int, n_checkpoint: int) -> int:
        pol = policy_matrix(self.n_blocks, np.array([n_swap]), np.array([n_checkpoint]))
        return int(self.host_suffix[n_persist] + self.swap_host_bytes(pol)[0])
