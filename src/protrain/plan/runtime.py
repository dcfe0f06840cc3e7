"""Predicted step time: a sum of measured compute, copy traffic, optimizers and stalls.

- **compute**: the trace's free-running step (:mod:`protrain.profile.trace`), forward plus
  backward with no recompute, plus the recompute of every checkpointed block (the blocks'
  measured forward, apportioned by the per-block intervals). A profile without the
  free-running step uses the sum of its intervals.
- **copy traffic** (host-device, shared by parameter gathers and activation swap), per
  phase, since each phase's copies can only hide under that phase's compute. Forward:
  host-to-device, every offloaded chunk once (trainable parameters as their fp32 masters,
  which the engine casts on the device after a host update); device-to-host, the bf16
  write-back of each updated chunk's trainable parameters and the swapped activations
  going out. Backward (with
  the loss head and recomputation): host-to-device, the offloaded chunks again except the
  ``n_buffer`` still resident when backward begins and those before the first trainable
  parameter (a LoRA model's embedding: backward never runs there), and the swapped
  activations coming back; device-to-host, the fp32 gradients of offloaded trainable
  parameters. A head tied to an offloaded embedding changes both phases' gathers (see
  [Note: a tied head]). A phase's copy seconds: the larger
  of each direction at its measured bandwidth and the total at the measured
  both-directions bandwidth. With a spare buffer to prefetch into (``n_buffer`` above what
  one module needs, or every offloaded chunk resident) a phase takes the longer of its
  compute and its copies; without one, they add. [Note: the host AdamW's rate]
The hardware profile measures the host AdamW alone (``cpu_adam_params_per_s``) and while
pinned copies keep both directions of the link busy (``cpu_adam_busy_params_per_s``): the
copies share the host's memory bandwidth. In a step the copies run for part of the host
step only, so a parameter costs ``f / busy + (1 - f) / alone`` seconds, ``f`` the share of
the step the link is busy: the plan's copies (every offloaded chunk gathered in forward and
backward, its update written back, its gradients out) at the measured rates, over the longer
of the compute and the host step at the idle rate, per ``n_persist``. The busy rate alone
under-states the host AdamW: it ran at 3.3-4.1 G parameters a second on an H200 host (busy
3.0, alone 5.3) and 4.0-4.4 on an H100 (3.5, 4.8), and full fine-tuning's steps were
predicted 3-15% too slow there. Re-predicted from the kept profiles with the blend, the
H200 matrix rows' median step error is 4.6% (5.4% with the busy rate alone), full
fine-tuning's 6.7% (8.7%) over 42 rows.

[Note: copies of the one-pass host update]
Where the hardware profile says the engine's host update is the one-pass kernel
(``host_update == "one_pass"``, ``optim/host_one_pass.py``), an offloaded chunk's gradients
leave the device in the compute dtype and the pass writes the updated weights, in the compute
dtype, into the chunk's host copy: the forward gathers copy the chunk's own bytes (not fp32
masters), nothing is written back, and the gradients out are half the bytes. The clip rides
in the same pass (no separate clip term). ``host_bytes_per_param`` counts a step's host
memory traffic per offloaded parameter (32 for bf16 on the one pass, about 40 on torch's
path); over the host's measured memory roof (``host_memory_bytes_per_s``) it gives the floor
no schedule gets under (``host_floor``), which the plan's reasons name when the host
update outlasts the compute.

[Note: the copy pipeline] is the per-chunk
  alternative, measured and not adopted.
- **device optimizer**: fused AdamW over the persistent chunks' trainable parameters at the
  measured device rate, after backward and before the next forward.
- **host optimizer stall** (see the note): how long the next forward waits for offloaded
  chunks whose host AdamW step, and the copy of their updated masters, are not done when
  it needs them. The host AdamW rate: see [Note: the host AdamW's rate]. With clipping, the host step first multiplies the
  chunk's fp32 gradients by the clip coefficient: one more pass, at its own measured rate
  (``cpu_clip_params_per_s``; 0.16-0.42 s a step on full-3b).
- **device-stepped chunks** (``n_device_step``, see [Note: device-stepped chunks]).

[Note: the copy pipeline]
Per phase totals hide a gather that arrives after the compute needs it while the phase's
copies still fit its compute (forward of checkpointed blocks is short; the first chunk
waits for its whole gather). ``copy_pipeline_s`` follows each gather through the buffer
pool as the engine runs it (``chunks/manager.py``, [Note: prefetch by recorded use]): the
gathers of a phase run one after another on one stream, chunk ``j``'s from when its buffer
is free. The first ``n_buffer`` of the phase's offloaded chunks start at its start (forward:
``begin_forward`` prefetches them; backward: resident at the turn); a later one takes the
buffer of the chunk ``n_buffer`` before it, released when the compute first uses the chunk
``n_buffer - 2`` before it: the release waits for the compute already enqueued (the gather
stream waits on an event), and a block over a chunk boundary keeps the earlier chunk until
the use order moves past the later one. So with 2 buffers no gather runs ahead of the
compute. The compute reaches chunk ``j`` at its first block's start in that phase (forward:
the blocks before it; backward: the head and the blocks after its last block, a chunk's last
block taken as the one where the next chunk begins), as shares of the phase's compute
(recompute and swap waits spread in proportion), plus every wait before; the phase waits
``max_j(gather_end_j - needed_j)``, at least its copies less its compute. In forward the host
stall already holds the gathers after late updates, so forward counts the larger of the two.
The d2h traffic, collectives' own timing, a tied head's extra gather and device-stepped
chunks' cast weights are left to the phase totals. One loop over chunks, vectorized over
candidates. On the CPU copies are synchronous: the phase rule stands.

It is not the step's rule: ``step_s(..., copy_pipeline=True)`` counts it (its breakdown's
``copy_exposed`` is then the pipeline's), the search never pays for it. It predicts the
measured copy waits (``wait_copy_s``) of 19 H200 matrix rows within 0.02 s on 17 (the
phase rule, 0 s on all, on 11; off: mistral7b-lora-20-b3 0.278 s against 0.178,
qwen7b-lora-20-b1 0.065 against 0.153). Over
the 72 measured rows with profiles it takes the LoRA rows' median
step error from 4.3% to 3.7% (mistral7b-lora-20-b3 -14.5% to +10.2%), but full
fine-tuning's from 8.7% to 9.6% and the median from 6.6% to 7.0%: those rows were
over-predicted by the host stall (full-3b on H200: 0.74 s predicted, 0.62 s waited), which
the uncounted copy waits had offset. With that stall corrected ([Note: the host AdamW's
rate]) it still takes full fine-tuning's median from 6.2% to 7.2% (all rows 5.3% to 5.2%).

[Note: device-stepped chunks]
The last ``n_device_step`` offloaded trainable chunks step on the device
(``optim/device_step.py``): their fp32 gradients go to the host in backward as every
offloaded chunk's (``grads_out``, 4 bytes a parameter), and after backward their gradients,
masters and moments cross the link in (16 bytes a parameter) and the masters and moments
back out (12 bytes, plus the cast weights); the next gather copies the cast weights in (not
the fp32 masters) and nothing is written back. The stream runs at the measured link rates
(the longer of each direction and the duplex total) or the device AdamW rate, whichever is
slower, chunk after chunk, each from when its gradients are on the host: with clipping once
every gradient is (as the host steps), without, once its own largest gradient's copy ends
after its backward (as ``step_in_backward`` starts it); its bytes are counted with the
forward's copies, which they share the link with. The host worker no longer steps these
chunks (their host AdamW time leaves the critical path); each arrives for the next forward
when its device step and its gather are done. Memory: the staging sets alone
(``plan/memory.py``), no bytes a parameter.

[Note: a tied head]
A causal LM's head that shares the input embedding's weight (``ChunkTable.tied_head_chunk``,
``ModelProfile.head_after_blocks``) uses chunk ``h``, the embedding's, after the last block.
Where ``h`` is offloaded and not among the last ``n_buffer`` chunks, the engine's prefetch
(``chunks/manager.py``, [Note: prefetch by recorded use]) never evicts it in forward, since
the pass uses it again, but a gather of a chunk the prefetch could not bring in evicts the
least recently used chunk, which is ``h``. So:

- with ``n_buffer >= max(min_buffers, 2) + 2`` (room to prefetch besides ``h`` and a block
  over two chunks), ``h`` stays resident through forward: no extra forward gather (a model
  whose blocks never straddle chunks would need one buffer less: not modelled);
- otherwise ``h`` is evicted and gathered again for the head: one forward gather more, of
  its compute-dtype bytes (the host copy is current by then, nothing is written back).

Either way ``h`` is resident at the turn with the last ``n_buffer - 1`` chunks, so backward
gathers one chunk more (``n - n_buffer``). Where backward uses ``h`` at its end (it holds
a trainable parameter: full fine-tuning, or LoRA on its blocks) and ``h`` stayed resident
in forward, it also stays through backward (the same rule), one gather fewer. Measured on
the CPU (``tests/engine/test_copy_times.py``); on CUDA a prefetch also skips a chunk whose
host update is still running, and the gather that follows evicts ``h``: more gathers than
counted where updates lag. Memory: the buffer pool holds ``n_buffer`` chunks either way.

[Note: swapped blocks run at the pace of their copies]
A swapped block cannot spread its copies over the rest of the phase: in forward, at most
one block's worth of copies is in flight (the memory model reserves that much), so the
block's forward ends no earlier than its saved bytes reach the host; in backward its saved
bytes come back while the block after it (in backward order) runs, one group ahead. So each
swapped block takes ``max(forward, saved / d2h)`` and ``max(backward, saved / h2d)``, and
the excess is added to compute, each part to its own phase's compute; the swap bytes still count in the phase's copy traffic,
which they share with gathers. Swapped blocks are spread among the checkpointed ones
(``place_policies``); the term counts only a swapped block's own compute as hiding its
copies, not its neighbours'. Without this term, six measured plans with 3 to 11 swapped
blocks ran 25-32% slower than predicted on an H200, and the planner chose swap where
checkpointing was faster; with it, the planner chooses no swap on those configurations,
so its accuracy on plans that do swap is not yet measured.

[Note: several ranks]
A plan is per rank (``plan/world.py``); each rank computes its own micro-batch, so compute is
the trace's. In the sharded mode a rank copies only its shard of each offloaded chunk (and of
its gradients and updated masters) over its link, steps only its shard on the host (at the
host rate measured with every rank of the host measuring at once), and the collectives move
the rest: an all-gather per offloaded-chunk gather, a reduce-scatter per offloaded trainable
chunk in backward, an all-reduce per persistent trainable chunk; in the replicated mode
copies and host steps are whole and every trainable chunk is all-reduced. Collective
seconds are bus bytes (``(N-1)/N`` of the chunk; twice that for an all-reduce) at the
measured bus bandwidth (the all-gather's measured beside copies both ways). A chunk's
gather is its shard's copy and then its all-gather, so a phase's collectives are added to
its copies, and the sum overlaps compute as copies alone do; a sharded chunk's gather after
its host update adds its all-gather to the host optimizer's critical path.

On a CPU device nothing overlaps: the "device" is the host, its copies and its optimizer
run on the same cores as compute, so every term adds.

[Note: the host optimizer's critical path]
The engine steps offloaded chunks one after another on one host thread, at the measured
host AdamW rate; a chunk's next gather waits for its step and then copies its fp32 masters
in (the copies follow one another on the link). Times are counted from the end of
backward; the next forward starts after the device optimizer, and reaches chunk ``j`` after
the forward compute of the blocks before ``chunk_first_block[j]``.

- With clipping, steps are released once every gradient is on the host (the global norm
  needs them all; the last to arrive is the first offloaded chunk's largest tensor, at the
  measured device-to-host rate).
- Without clipping, each piece of a chunk's step is released when its own gradients are on
  the host ([Note: chunks complete in backward] in ``runtime/grad_offload.py``): the blocks
  a chunk spans (from its first block to the next chunk's) are split into as many
  consecutive groups as the update has pieces (``_UPDATE_PIECE_NUMEL`` parameters each),
  each group's share of the work released when backward has finished the group's first
  block, its last in backward (the backward compute still to run after that point hides
  it). Recompute is not counted as hiding time.

The worker runs one task at a time, the released one of lowest forward position first
(``_lowest_first``, as ``runtime/host_worker.py`` does), ending chunk ``i``'s last task at
``done_i``. A gather copies the masters of each update piece as soon as it is written, so
chunk ``j`` arrives at ``A_j = max over i <= j of (done_i + tail_i + gather_{i+1} + ... +
gather_j)``, ``tail_i`` being the copy of the last piece and of the chunk's frozen bytes
(a LoRA chunk's base weights), and the forward stalls
``max_j(A_j - forward_until_j) - device_optimizer`` (never below 0).
This depends on ``n_persist`` only (not on ``n_buffer`` or the activation policies), so it is
one vector, computed once in O(chunks^2 log chunks).
"""

from __future__ import annotations

import heapq

import numpy as np

from protrain.optim.hybrid_adamw import _UPDATE_PIECE_NUMEL
from protrain.optim.state_format import host_state_bytes_per_param
from protrain.plan.memory import CHECKPOINT, SWAP
from protrain.plan.world import SINGLE, World
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import ModelProfile


def _compute_parts(profile: ModelProfile):
    """(keep-all forward + backward s, per-block forward s, per-block backward s, pre s)."""
    b = profile.blocks
    fwd = np.asarray([x.fwd_s for x in b], dtype=np.float64)
    bwd = np.asarray([x.bwd_s for x in b], dtype=np.float64)
    if profile.free_fwd_bwd_s is None:
        rec = np.asarray([x.recompute_s for x in b], dtype=np.float64)
        base = profile.pre_fwd_s + fwd.sum() + profile.head_s + bwd.sum() + profile.post_bwd_s
        return base, fwd, bwd, rec, profile.pre_fwd_s

    def share(x: np.ndarray, total: float) -> np.ndarray:
        s = x.sum()
        return total * (x / s if s > 0 else np.full(len(x), 1.0 / max(len(x), 1)))

    blocks_fwd = profile.free_blocks_fwd_s
    pre = profile.free_pre_fwd_s
    fwd_free = share(fwd, blocks_fwd)
    keep = profile.free_keep_fwd_bwd_s
    if keep is None:
        # The free-running step ran every block checkpointed: its backward held each
        # forward again.
        base = profile.free_fwd_bwd_s - blocks_fwd
        recompute = fwd_free
    else:  # both ends measured: [Note: the plain layout measured] in profile/trace.py
        base = keep
        recompute = share(fwd, max(profile.free_fwd_bwd_s - keep, 0.0))
    bwd_total = max(base - pre - blocks_fwd - profile.head_s, 0.0)
    return base, fwd_free, share(bwd, bwd_total), recompute, pre


class RuntimeModel:
    def __init__(
        self,
        profile: ModelProfile,
        hardware: HardwareProfile,
        *,
        clipping: bool = True,
        world: World = SINGLE,
        optimizer_state: str = "fp32",
    ):
        self.hw = hardware
        self.optimizer_state = optimizer_state
        self.clipping = clipping
        self.world = world
        t = profile.chunks
        base, block_fwd, block_bwd, recompute, pre = _compute_parts(profile)
        self.base_compute_s = float(base)
        self.fwd_compute_s = float(pre + block_fwd.sum())
        self.host_adam_rate = hardware.cpu_adam_busy_params_per_s or hardware.cpu_adam_params_per_s
        # [Note: copies of the one-pass host update]
        self.one_pass = hardware.host_update == "one_pass"
        # seconds per offloaded trainable parameter of the host step: AdamW, and with
        # clipping on torch's path the multiplication by the clip coefficient before it (the
        # one pass clips as it reads the gradient)
        clip_rate = hardware.cpu_clip_params_per_s if clipping and not self.one_pass else None
        self.host_s_per_param = 1.0 / self.host_adam_rate + (1.0 / clip_rate if clip_rate else 0.0)
        self.recompute_s = recompute
        self.saved = np.asarray([x.saved_bytes for x in profile.blocks], dtype=np.int64)
        self.block_fwd_s, self.block_bwd_s = block_fwd, block_bwd
        # [Note: swapped blocks run at the pace of their copies]
        concurrent = hardware.device != "cpu"
        out_s = self.saved / hardware.d2h_bytes_per_s - block_fwd
        in_s = self.saved / hardware.h2d_bytes_per_s - block_bwd
        self.swap_out_wait_s = np.maximum(out_s, 0.0) if concurrent else np.zeros_like(out_s)
        self.swap_in_wait_s = np.maximum(in_s, 0.0) if concurrent else np.zeros_like(in_s)
        self.min_buffers = t.min_buffers
        self.n_chunks = n = t.n_chunks
        used = np.asarray(t.used_bytes, dtype=np.int64)
        trn = np.asarray(t.trainable_numel, dtype=np.int64)
        frozen = used - np.asarray(t.trainable_bytes, dtype=np.int64)

        def prefix(x):
            return np.concatenate([[0], np.cumsum(x)])

        # Copies per rank; only offloaded chunks' differences are read ([Note: several ranks])
        sh = world.shards
        tb = np.asarray(t.trainable_bytes, dtype=np.int64)
        # per chunk: forward gather bytes (the one pass's compute-dtype copy, or fp32 masters
        # cast on the device), the cast weights written back after it, the gradients out
        self._fwd_in_chunk = frozen + (tb if self.one_pass else 4 * trn)
        self._write_back_chunk = np.zeros_like(tb) if self.one_pass else tb
        self._grad_out_chunk = tb if self.one_pass else 4 * trn
        self.fwd_in = prefix(self._fwd_in_chunk) / sh
        self.used = prefix(used) / sh
        self.write_back = prefix(self._write_back_chunk) / sh
        self.grads_out = prefix(self._grad_out_chunk) / sh
        self.trainable = prefix(trn)
        self.trainable_chunks = prefix(trn > 0)
        # Backward gathers no chunk before the first one with a trainable parameter: what
        # runs there needs no gradient (the engine gathers for a module's backward only).
        self.first_backward_chunk = int(np.argmax(trn > 0)) if (trn > 0).any() else n
        # [Note: a tied head]: the head's chunk, where the engine gathers it again
        h = t.tied_head_chunk if profile.head_after_blocks else None
        self.head_chunk = -1 if h is None else int(h)
        self.head_chunk_bytes = 0.0 if h is None else float(self.used[h + 1] - self.used[h])
        self._collective_s(t.chunk_size_bytes)
        self.host_s_per_param_at = self._host_seconds_per_param(hardware, clip_rate)

        # Per chunk: when the next forward needs it, and how much backward follows its grads.
        n_blocks = len(profile.blocks)
        first = np.asarray(profile.chunk_first_block or [-1] * n, dtype=np.int64)
        fwd_before = np.concatenate([[0.0], np.cumsum(block_fwd)])  # before block k
        bwd_before = np.concatenate([[0.0], np.cumsum(block_bwd)])
        k = np.clip(first, 0, n_blocks)
        needed_at = np.where(first < 0, 0.0, pre + fwd_before[k])
        bwd_after = np.where(first < 0, 0.0, bwd_before[k])  # blocks < first run after it
        # Without clipping: when each piece of each chunk's step is released, as seconds of
        # backward still to run (see the note); one task per group of blocks.
        task_chunk, task_bwd_after, task_share = [], [], []
        for i in range(n):
            f = int(first[i])
            if f < 0 or f >= n_blocks:
                groups = [[None]]
            else:
                nxt = int(first[i + 1]) if i + 1 < n else n_blocks - 1
                blocks = list(range(f, min(max(nxt, f), n_blocks - 1) + 1))
                pieces = max(1, -(-int(trn[i]) // _UPDATE_PIECE_NUMEL))
                groups = [g.tolist() for g in np.array_split(blocks, min(pieces, len(blocks)))]
            n_in = sum(len(g) for g in groups)
            for g in groups:
                task_chunk.append(i)
                task_bwd_after.append(bwd_after[i] if g[0] is None else bwd_before[g[0]])
                task_share.append(len(g) / n_in)
        self._task_chunk = np.asarray(task_chunk, dtype=np.int64)
        self._task_bwd_after = np.asarray(task_bwd_after, dtype=np.float64)
        self._bwd_after = bwd_after
        self._task_share = np.asarray(task_share, dtype=np.float64)
        self._trn, self._frozen = trn, frozen
        self._trainable_bytes = np.asarray(t.trainable_bytes, dtype=np.int64)
        self._needed_at = needed_at
        # [Note: the copy pipeline]: per chunk, where each phase first uses it, as a share of
        # the phase's compute, and its gather's seconds in each phase
        self._fwd_at = needed_at / self.fwd_compute_s if self.fwd_compute_s > 0 else 0 * needed_at
        # the last block using chunk j: the one where chunk j + 1 begins (a chunk boundary
        # inside a block), the last block for the last chunk; backward reaches it after the
        # head and the blocks after it
        last = np.append(first[1:], n_blocks)
        last = np.where(first >= n_blocks, n_blocks, np.clip(last, first, n_blocks - 1))
        bwd_total = bwd_before[n_blocks]
        bwd_at = np.where(
            last >= n_blocks,
            0.0,
            profile.head_s + bwd_total - bwd_before[np.minimum(last + 1, n_blocks)],
        )
        bwd_phase = self.base_compute_s - self.fwd_compute_s
        self._bwd_at = bwd_at / bwd_phase if bwd_phase > 0 else 0 * bwd_at
        self._fwd_gather_s = np.diff(self.fwd_in) / hardware.h2d_bytes_per_s + self.gather_coll_s
        self._bwd_gather_s = np.diff(self.used) / hardware.h2d_bytes_per_s + self.gather_coll_s
        self._last_numel = np.asarray(t.max_trainable_numel, dtype=np.int64)
        self.host_stall_s = self._host_stall()

    def _collective_s(self, chunk_bytes: int) -> None:
        """Seconds of one chunk's all-gather, reduce-scatter and all-reduce ([Note: several
        ranks]); 0 for one rank."""
        w, hw = self.world, self.hw
        self.gather_coll_s = self.reduce_scatter_s = self.all_reduce_s = 0.0
        if not w.distributed:
            return
        bus = chunk_bytes * (w.size - 1) / w.size

        def seconds(nbytes: float, *rates: float | None) -> float:
            rate = next((r for r in rates if r), None)
            if rate is None:
                raise ValueError(
                    "the hardware profile has no collective bandwidths: measure it with the "
                    "process group initialized (protrain.profile.measure_hardware)"
                )
            return nbytes / rate

        self.all_reduce_s = seconds(2 * bus, hw.collective_bytes_per_s)
        if w.mode == "sharded":
            self.gather_coll_s = seconds(
                bus, hw.all_gather_busy_bytes_per_s, hw.all_gather_bytes_per_s
            )
            self.reduce_scatter_s = seconds(bus, hw.reduce_scatter_bytes_per_s)

    def _host_seconds_per_param(self, hw: HardwareProfile, clip_rate: float | None):
        """Host step seconds a trainable parameter, for every ``n_persist``
        ([Note: the host AdamW's rate])."""
        n, sh = self.n_chunks, self.world.shards
        plain = hw.cpu_adam_params_per_s
        busy = hw.cpu_adam_busy_params_per_s or plain
        clip_s = 1.0 / clip_rate if clip_rate else 0.0
        if hw.device == "cpu" or busy == plain:
            return np.full(n + 1, self.host_s_per_param)
        # every offloaded chunk gathered in forward and in backward, its update written
        # back and its gradients copied out: the link's busy seconds a step
        h2d = (self.fwd_in[n] - self.fwd_in) + (self.used[n] - self.used)
        d2h = (self.write_back[n] - self.write_back) + (self.grads_out[n] - self.grads_out)
        link = np.maximum(
            np.maximum(h2d / hw.h2d_bytes_per_s, d2h / hw.d2h_bytes_per_s),
            (h2d + d2h) / hw.duplex_bytes_per_s,
        )
        host = (self.trainable[n] - self.trainable) / sh * (1.0 / plain + clip_s)
        span = np.maximum(self.base_compute_s, host)
        busy_share = np.clip(np.divide(link, span, out=np.zeros_like(link), where=span > 0), 0, 1)
        return busy_share / busy + (1.0 - busy_share) / plain + clip_s

    def _tied_head(self, n_persist, n_buffer) -> tuple[np.ndarray, np.ndarray]:
        """(the head's chunk is gathered again, the head's chunk stays resident through
        forward) per plan, boolean arrays; both False without a tied head or where the
        chunk is persistent or among the last ``n_buffer`` ([Note: a tied head])."""
        n_buffer = np.asarray(n_buffer)
        h = self.head_chunk
        active = (h >= np.asarray(n_persist)) & (h < self.n_chunks - n_buffer) & (h >= 0)
        # a block over a chunk boundary keeps both chunks (the prefetch protects a chunk the
        # pass uses again) whatever min_buffers says: full fine-tuning's is 1
        stays = n_buffer >= max(self.min_buffers, 2) + 2
        return active, active & stays

    def _backward_span(self, n_persist, n_buffer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The chunks backward gathers, ``lo:hi`` less the head's where ``kept``: the
        offloaded ones from the first with a trainable parameter, up to those still resident
        from forward (the engine's prefetch leaves each offloaded chunk to be gathered once a
        phase: [Note: prefetch by recorded use] in ``chunks/manager.py``); the last
        ``n_buffer``, or with a tied head its chunk and the last ``n_buffer - 1`` ([Note: a
        tied head]); arrays broadcast."""
        n_persist = np.asarray(n_persist)
        n_off = self.n_chunks - n_persist
        active, stays = self._tied_head(n_persist, n_buffer)
        lo = np.maximum(n_persist, self.first_backward_chunk)
        resident = np.minimum(np.asarray(n_buffer), n_off) - active
        hi = np.maximum(self.n_chunks - resident, lo)
        kept = stays & (self.head_chunk >= lo) & (self.head_chunk < hi)
        return lo, hi, kept

    def forward_gathers(self, n_persist, n_buffer) -> np.ndarray:
        """Gathers of offloaded chunks in forward: each once, and a tied head's chunk again
        where it does not stay resident ([Note: a tied head])."""
        active, stays = self._tied_head(n_persist, n_buffer)
        return self.n_chunks - np.asarray(n_persist) + (active & ~stays)

    def backward_gathers(self, n_persist, n_buffer) -> np.ndarray:
        """Gathers of offloaded chunks in backward (see :meth:`_backward_span`)."""
        lo, hi, kept = self._backward_span(n_persist, n_buffer)
        return hi - lo - kept

    def collective_seconds(self, n_persist, n_buffer) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) collective seconds per rank; arrays broadcast."""
        n = self.n_chunks
        n_persist = np.asarray(n_persist)
        gathers_b = self.backward_gathers(n_persist, n_buffer)
        trn_off = self.trainable_chunks[n] - self.trainable_chunks[n_persist]
        trn_persist = self.trainable_chunks[n_persist]
        fwd = self.forward_gathers(n_persist, n_buffer) * self.gather_coll_s
        if self.world.mode == "sharded":
            bwd = (
                gathers_b * self.gather_coll_s
                + trn_off * self.reduce_scatter_s
                + trn_persist * self.all_reduce_s
            )
        else:
            bwd = (trn_off + trn_persist) * self.all_reduce_s
        return fwd, bwd

    def _host_stall(self) -> np.ndarray:
        """Seconds the next forward waits on the host optimizer, for every ``n_persist``."""
        hw, n = self.hw, self.n_chunks
        sh = self.world.shards
        if hw.device == "cpu":  # nothing overlaps: the host step is the host's time
            return (self.trainable[n] - self.trainable) * self.host_s_per_param / sh
        trn, frozen, last_numel = self._trn, self._frozen, self._last_numel
        # per chunk, the same for every n_persist
        self._host_s = trn / sh  # seconds per (seconds a parameter): scaled per n_persist
        self._gather_s = self._fwd_in_chunk / sh / hw.h2d_bytes_per_s + self.gather_coll_s
        # the copy after the last piece of an update (the pieces before hide under it), and
        # the chunk's frozen bytes, which the gather copies once the forward asks for it
        last_piece = np.minimum(trn, np.maximum(last_numel, _UPDATE_PIECE_NUMEL))
        per_param = self._param_bytes(self._fwd_in_chunk - frozen)
        grad_bytes = self._param_bytes(self._grad_out_chunk)
        self._tail_s = (
            frozen + per_param * last_piece
        ) / sh / hw.h2d_bytes_per_s + self.gather_coll_s
        self._grad_tail_s = grad_bytes * last_numel / hw.d2h_bytes_per_s
        tc = self._task_chunk
        self._piece_release = self._grad_tail_s[tc] - self._task_bwd_after
        self._piece_work = self._host_s[tc] * self._task_share
        self._gc = np.concatenate([[0.0], np.cumsum(self._gather_s)])
        stall = np.zeros(n + 1)
        for n_p in range(n):
            stall[n_p] = self._stall_at(n_p, np.zeros(0, dtype=np.int64))
        return stall

    def _param_bytes(self, chunk_bytes: np.ndarray) -> np.ndarray:
        """Bytes a trainable parameter of each chunk, from the chunk's bytes of them."""
        trn = self._trn
        return np.divide(chunk_bytes, trn, out=np.zeros(len(trn)), where=trn > 0)

    def host_bytes_per_param(self, n_persist: int) -> float:
        """Host memory bytes a step moves per offloaded trainable parameter: the update's
        own (gradient read, fp32 master and moments read and written, the copy out) and the
        copies' (the gradient landed, the weights the gather reads); see [Note: copies of
        the one-pass host update]."""
        off = slice(int(n_persist), None)
        n = float(self._trn[off].sum())
        if n == 0:
            return 0.0
        grad = float(self._grad_out_chunk[off].sum()) / n
        if self.one_pass:  # landed, read; the state; written, read by the gather
            state = 2 * host_state_bytes_per_param(self.optimizer_state)
            return 2 * grad + state + 2 * float(self._trainable_bytes[off].sum()) / n
        clip = 8.0 if self.clipping else 0.0  # torch's separate pass over the fp32 gradients
        # landed and read in fp32; the state; the master read by the gather; the write-back
        wb = float(self._write_back_chunk[off].sum()) / n
        return 2 * grad + 24 + clip + 4 + wb

    def host_floor_s(self, n_persist: int) -> float | None:
        """The shortest host step the host's memory roof allows for the offloaded trainable
        parameters at ``n_persist`` (None: the roof was not measured)."""
        roof = self.hw.host_memory_bytes_per_s
        if not roof:
            return None
        params = float(self.trainable[self.n_chunks] - self.trainable[int(n_persist)])
        return params / self.world.shards * self.host_bytes_per_param(n_persist) / roof

    def _stall_at(self, n_p: int, on_device: np.ndarray) -> float:
        """Seconds the next forward waits for offloaded chunks at ``n_persist = n_p``, the
        chunks ``on_device`` stepped on the device (see [Note: device-stepped chunks])."""
        hw, n = self.hw, self.n_chunks
        sh = self.world.shards
        spp = self.host_s_per_param_at[n_p]
        host_s, gather_s, tail_s, gc = self._host_s * spp, self._gather_s, self._tail_s, self._gc
        dev_opt_s = self.trainable[n_p] / hw.device_adam_params_per_s
        stepped = self._trn > 0
        dev_done = np.full(n, -np.inf)
        if len(on_device):  # one after another once their gradients are out, cast weights in
            stepped[on_device] = False
            dev_done[on_device] = self._device_done(on_device, n_p)
            own = (self._frozen + self._trainable_bytes)[on_device] / sh / hw.h2d_bytes_per_s
            gather_s, tail_s = gather_s.copy(), tail_s.copy()
            gather_s[on_device] = tail_s[on_device] = own + self.gather_coll_s
            gc = np.concatenate([[0.0], np.cumsum(gather_s)])
        # Without clipping each piece is released when its own gradients are on the host,
        # during backward (negative: before its end); with clipping all at once.
        if self.clipping:
            release = np.full(n, self._grad_tail_s[n_p])
            done = _lowest_first(release, host_s, stepped & (np.arange(n) >= n_p))
        else:
            tc = self._task_chunk
            ends = _lowest_first(
                self._piece_release, self._piece_work * spp, stepped[tc] & (tc >= n_p)
            )
            done = np.full(n, -np.inf)
            np.maximum.at(done, tc, ends)
        done = np.maximum(done, dev_done)[n_p:]
        # A_j = max over i <= j of (done_i + tail_i + gathers i+1..j)
        arrive = np.maximum.accumulate(done + tail_s[n_p:] - gc[n_p + 1 :]) + gc[n_p + 1 :]
        late = np.max(arrive - self._needed_at[n_p:]) - dev_opt_s
        return max(late, 0.0) if np.isfinite(late) else 0.0

    # ---- device-stepped chunks ([Note: device-stepped chunks]) -------------------------

    def _device_done(self, chunks: np.ndarray, n_persist: int) -> np.ndarray:
        """When each device-stepped chunk's step ends (seconds from the end of backward):
        one after another, each from when its gradients are on the host: with clipping
        every gradient (the host steps' release at ``n_persist``), else its own (during
        backward, last chunk first)."""
        dur = self.device_step_chunk_s(chunks)
        if self.clipping:
            release = np.full(len(chunks), self._grad_tail_s[int(n_persist)])
        else:
            release = self._grad_tail_s[chunks] - self._bwd_after[chunks]
        done, t = np.empty(len(chunks)), -np.inf
        for j in np.argsort(release, kind="stable"):
            t = max(t, release[j]) + dur[j]
            done[j] = t
        return done

    def device_step_chunks(self, n_persist: int, n_device_step: int) -> np.ndarray:
        """The chunks a device step takes: the last ``n_device_step`` offloaded trainable
        ones (an index array; fewer if there are fewer)."""
        idx = np.flatnonzero(self._trn[int(n_persist) :] > 0) + int(n_persist)
        return idx[max(len(idx) - int(n_device_step), 0) :] if n_device_step else idx[:0]

    def trainable_numel(self, chunks: np.ndarray) -> int:
        """Trainable parameters of ``chunks`` (whole, not per rank)."""
        return int(self._trn[chunks].sum())

    def host_step_chunk_s(self, chunks: np.ndarray) -> np.ndarray:
        """Seconds of each chunk's host step (AdamW, and the clip pass with clipping)."""
        spp = self.host_s_per_param_at[int(chunks.min())] if len(chunks) else 0.0
        return self._trn[chunks] * spp / self.world.shards

    def device_step_bytes(self, chunks: np.ndarray) -> tuple[float, float]:
        """(host-to-device, device-to-host) bytes per rank a device step of ``chunks``
        streams: gradients, masters and both moments in, masters and both moments and the
        cast weights out."""
        trn = float(self._trn[chunks].sum())
        tb = float(self._trainable_bytes[chunks].sum())
        return 16 * trn / self.world.shards, (12 * trn + tb) / self.world.shards

    def device_step_chunk_s(self, chunks: np.ndarray) -> np.ndarray:
        """Seconds of each chunk's device step: its link traffic at the measured rates or
        its device AdamW, whichever is longer (the pieces pipeline the two)."""
        hw, sh = self.hw, self.world.shards
        trn = self._trn[chunks].astype(np.float64)
        h2d, d2h = 16 * trn / sh, (12 * trn + self._trainable_bytes[chunks]) / sh
        link = np.maximum(
            np.maximum(h2d / hw.h2d_bytes_per_s, d2h / hw.d2h_bytes_per_s),
            (h2d + d2h) / hw.duplex_bytes_per_s,
        )
        return np.maximum(link, trn / sh / hw.device_adam_params_per_s)

    def swap_wait_s(self, pol: np.ndarray, phase: str | None = None) -> np.ndarray:
        """Seconds the swapped blocks wait for their own copies, per row of policies: in
        ``"forward"``, in ``"backward"``, or both (``None``)."""
        wait = {"forward": self.swap_out_wait_s, "backward": self.swap_in_wait_s}.get(
            phase, self.swap_out_wait_s + self.swap_in_wait_s
        )
        return np.where(pol == SWAP, wait, 0.0).sum(1)

    def pair_terms(self, pol: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(compute seconds, swap bytes each way) for each row of block policies; compute
        includes the swapped blocks' wait for their own copies."""
        compute = self.base_compute_s + np.where(pol == CHECKPOINT, self.recompute_s, 0.0).sum(1)
        compute = compute + self.swap_wait_s(pol)
        swap = np.where(pol == SWAP, self.saved, 0).sum(1)
        return compute, swap

    def copy_pipeline_s(self, n_persist, n_buffer, compute_f, compute_b):
        """(forward, backward) seconds the compute waits on gathers, per chunk through the
        buffer pool ([Note: the copy pipeline]); arrays broadcast (one loop over chunks)."""
        shape = np.broadcast_shapes(
            *(np.shape(x) for x in (n_persist, n_buffer, compute_f, compute_b))
        )
        p, b, cf, cb = (
            np.broadcast_to(x, shape).ravel() for x in (n_persist, n_buffer, compute_f, compute_b)
        )
        n = self.n_chunks
        q = np.arange(n)[:, None]
        lo, hi, kept = self._backward_span(p, b)
        # forward: chunks in order, the offloaded ones from n_persist, buffer slot k - n_persist
        fwd = _pipeline(self._fwd_gather_s, self._fwd_at[:, None] * cf, q >= p, q - p, b)
        # backward: chunks in reverse, those lo..hi gathered (the others resident or unused)
        chunk = n - 1 - q
        gathered = (chunk >= lo) & (chunk < hi) & ~(kept & (chunk == self.head_chunk))
        bwd_at = self._bwd_at[::-1, None] * cb
        bwd = _pipeline(self._bwd_gather_s[::-1], bwd_at, gathered, q + 0 * p, b)
        return fwd.reshape(shape), bwd.reshape(shape)

    def step_s(
        self,
        n_persist,
        n_buffer,
        compute_s,
        swap_bytes,
        fwd_wait_s=0.0,
        *,
        breakdown=False,
        n_device_step: int = 0,
        copy_pipeline: bool = False,
    ):
        """Step seconds; arrays broadcast. ``fwd_wait_s``: the part of ``compute_s`` that
        swapped blocks wait in forward (:meth:`swap_wait_s`), which only forward copies can
        overlap. ``breakdown=True`` returns the terms as well. ``n_device_step`` (with a
        scalar ``n_persist``): see [Note: device-stepped chunks]. ``copy_pipeline=True``:
        the copies' exposed time by the per-chunk pipeline, not by each phase's totals (not
        the planner's rule: [Note: the copy pipeline])."""
        dev = np.zeros(0, dtype=np.int64)
        if n_device_step:
            dev = self.device_step_chunks(int(n_persist), n_device_step)
        n_persist = np.asarray(n_persist)
        n_buffer = np.asarray(n_buffer)
        n = self.n_chunks
        n_off = n - n_persist
        hw = self.hw
        again, stays = self._tied_head(n_persist, n_buffer)  # [Note: a tied head]
        h2d_f = self.fwd_in[n] - self.fwd_in[n_persist] + (again & ~stays) * self.head_chunk_bytes
        d2h_f = self.write_back[n] - self.write_back[n_persist] + swap_bytes
        lo, hi, kept = self._backward_span(n_persist, n_buffer)
        h2d_b = self.used[hi] - self.used[lo] - kept * self.head_chunk_bytes + swap_bytes
        d2h_b = self.grads_out[n] - self.grads_out[n_persist]
        dev_h2d = dev_d2h = dev_step_s = 0.0
        host_params = self.trainable[n] - self.trainable[n_persist]
        spp = self.host_s_per_param_at[n_persist]
        if len(dev):  # see [Note: device-stepped chunks]
            sh = self.world.shards
            trn, tb = self._trn[dev].sum(), self._trainable_bytes[dev].sum()
            dev_h2d, dev_d2h = self.device_step_bytes(dev)
            # cast weights in, not masters; no write-back; gradients out as the host's
            h2d_f = h2d_f - (self._fwd_in_chunk[dev].sum() - self._frozen[dev].sum() - tb) / sh
            h2d_f = h2d_f + dev_h2d
            d2h_f = d2h_f - self._write_back_chunk[dev].sum() / sh + dev_d2h
            dev_step_s = float(self.device_step_chunk_s(dev).sum())
            host_params = host_params - trn

        def copy_seconds(h2d, d2h):
            return np.maximum(
                np.maximum(h2d / hw.h2d_bytes_per_s, d2h / hw.d2h_bytes_per_s),
                (h2d + d2h) / hw.duplex_bytes_per_s,
            )

        coll_f, coll_b = self.collective_seconds(n_persist, n_buffer)
        copy_f = copy_seconds(h2d_f, d2h_f) + coll_f
        copy_b = copy_seconds(h2d_b, d2h_b) + coll_b
        compute_f = np.minimum(self.fwd_compute_s + fwd_wait_s, compute_s)
        compute_b = compute_s - compute_f
        concurrent = hw.device != "cpu"
        prefetch = ((n_buffer >= self.min_buffers + 1) | (n_buffer >= n_off)) & concurrent
        # each phase waits on its copies at least as long as their totals exceed its compute
        exposed_f = np.maximum(copy_f - compute_f, 0.0)
        exposed_b = np.maximum(copy_b - compute_b, 0.0)
        dev_opt_s = self.trainable[n_persist] / hw.device_adam_params_per_s
        if not len(dev):
            stall_s = self.host_stall_s[n_persist]
        elif concurrent:
            stall_s = self._stall_at(int(n_persist), dev)
        else:  # the CPU: every term adds
            stall_s = host_params * spp / self.world.shards + dev_step_s
        exposed = np.where(prefetch, exposed_f + exposed_b, copy_f + copy_b)
        if concurrent and copy_pipeline:  # [Note: the copy pipeline]
            pipe_f, pipe_b = self.copy_pipeline_s(n_persist, n_buffer, compute_f, compute_b)
            # the host stall already holds the gathers after late updates: the larger of the
            # two, not their sum
            exposed = np.where(
                prefetch,
                np.maximum(exposed_f, pipe_f - stall_s) + np.maximum(exposed_b, pipe_b),
                exposed,
            )
        overlapped = compute_s + exposed
        copy_s = copy_f + copy_b
        h2d, d2h = h2d_f + h2d_b, d2h_f + d2h_b
        total = overlapped + dev_opt_s + stall_s
        if not breakdown:
            return total
        return total, {
            "compute": float(compute_s),
            "copy": float(copy_s),
            "collective": float(coll_f + coll_b),
            "copy_exposed": float(overlapped - compute_s),
            "h2d_bytes": float(h2d),
            "d2h_bytes": float(d2h),
            "device_optimizer": float(dev_opt_s),
            "host_optimizer": float(host_params * spp / self.world.shards),
            "host_optimizer_exposed": float(stall_s),
            "host_bytes_per_param": self.host_bytes_per_param(int(n_persist)),
            "host_floor": self.host_floor_s(int(n_persist)) or 0.0,
            "device_step": dev_step_s,
            "device_step_h2d_bytes": float(dev_h2d),
            "device_step_d2h_bytes": float(dev_d2h),
        }


def _pipeline(copy_s, at, gathered, slot, n_buffer) -> np.ndarray:
    """Seconds the compute waits on one phase's gathers ([Note: the copy pipeline]), per
    row. Per position ``q`` of the phase's order (axis 0): ``copy_s`` its gather's seconds,
    ``at`` (positions x rows) when the phase's compute first uses it, ``gathered`` whether
    it is gathered, ``slot`` its place among the offloaded chunks; ``n_buffer`` per row."""
    n, rows = at.shape
    idx = np.arange(rows)
    behind = np.maximum(n_buffer - 2, 0)  # the buffers a gather trails the compute by
    # when the compute reaches position q (the engine asks for its chunk then), waits included
    reached = np.empty((n, rows))
    free = np.zeros(rows)  # when the gather stream is free
    wait = np.zeros(rows)
    for q in range(n):
        reached[q] = at[q] + wait
        g = gathered[q]
        if g.any():
            room = np.where(slot[q] >= n_buffer, reached[np.maximum(q - behind, 0), idx], 0.0)
            free = np.where(g, np.maximum(free, room) + copy_s[q], free)
            wait = np.maximum(wait, np.where(g, free - at[q], 0.0))
    return wait


def _lowest_first(release: np.ndarray, work: np.ndarray, active: np.ndarray) -> np.ndarray:
    """End times of the host worker's tasks (see ``runtime/host_worker.py``): one at a time,
    each started when released, the released task of lowest index (forward position) first.
    Inactive tasks end at -inf (nothing waits for them)."""
    done = np.full(len(work), -np.inf)
    todo = sorted(np.flatnonzero(active), key=lambda j: release[j])
    ready: list[int] = []
    t, k = -np.inf, 0
    while k < len(todo) or ready:
        if not ready:
            t = max(t, release[todo[k]])
        while k < len(todo) and release[todo[k]] <= t:
            heapq.heappush(ready, int(todo[k]))
            k += 1
        j = heapq.heappop(ready)
        t += work[j]
        done[j] = t
    return done
