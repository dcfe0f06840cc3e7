"""Predicted step time from measured compute, copy traffic, the optimizers and their overlap.

- **compute**: the traced step's measured parts: embedding, each block's forward and
  backward, the head and loss, plus the recompute of every checkpointed block.
- **copy traffic** (host-device, shared by parameter gathers and activation swap):
  host-to-device, every offloaded chunk once in forward (trainable parameters as their fp32
  masters, which the engine casts on the device after a host update), again in backward
  except the ``n_buffer`` chunks still resident when backward begins, and swapped
  activations coming back; device-to-host, the updated chunk written back, the fp32
  gradients of offloaded trainable parameters, and swapped activations going out. Copy
  seconds: the larger of each direction at its measured bandwidth and the total at the
  measured both-directions bandwidth.
- **overlap**: with a spare buffer to prefetch into (``n_buffer`` above what one module needs,
  or every offloaded chunk resident), copies run under compute and the slower of the two
  counts; without one, they add. The device optimizer (persistent chunks) runs after
  backward; the host optimizer (offloaded chunks) overlaps the next forward, and only what
  exceeds the forward's compute counts. On a CPU device nothing overlaps: the "device" is
  the host, its copies and its optimizer run on the same cores as compute.
"""

from __future__ import annotations

import numpy as np

from protrain.plan.memory import CHECKPOINT, SWAP
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import ModelProfile


class RuntimeModel:
    def __init__(self, profile: ModelProfile, hardware: HardwareProfile):
        self.hw = hardware
        b = profile.blocks
        t = profile.chunks
        self.fwd_compute_s = profile.pre_fwd_s + sum(x.fwd_s for x in b)
        self.base_compute_s = (
            self.fwd_compute_s + profile.head_s + sum(x.bwd_s for x in b) + profile.post_bwd_s
        )
        self.recompute_s = np.asarray([x.recompute_s for x in b], dtype=np.float64)
        self.saved = np.asarray([x.saved_bytes for x in b], dtype=np.int64)
        self.min_buffers = t.min_buffers
        self.n_chunks = t.n_chunks
        used = np.asarray(t.used_bytes, dtype=np.int64)
        trn = np.asarray(t.trainable_numel, dtype=np.int64)
        frozen = used - np.asarray(t.trainable_bytes, dtype=np.int64)

        def prefix(x):
            return np.concatenate([[0], np.cumsum(x)])

        self.fwd_in = prefix(frozen + 4 * trn)  # forward gather bytes (masters in fp32)
        self.used = prefix(used)
        self.out = prefix(np.where(trn > 0, used, 0) + 4 * trn)  # write-back + fp32 grads
        self.trainable = prefix(trn)

    def pair_terms(self, pol: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(compute seconds, swap bytes each way) for each row of block policies."""
        compute = self.base_compute_s + np.where(pol == CHECKPOINT, self.recompute_s, 0.0).sum(1)
        swap = np.where(pol == SWAP, self.saved, 0).sum(1)
        return compute, swap

    def step_s(self, n_persist, n_buffer, compute_s, swap_bytes, *, breakdown: bool = False):
        """Step seconds; arrays broadcast. ``breakdown=True`` returns the terms as well."""
        n_persist = np.asarray(n_persist)
        n_buffer = np.asarray(n_buffer)
        n = self.n_chunks
        n_off = n - n_persist
        resident_at_turn = np.minimum(n_buffer, n_off)
        h2d = (
            self.fwd_in[n] - self.fwd_in[n_persist]
            + self.used[n - resident_at_turn] - self.used[n_persist]
            + swap_bytes
        )  # fmt: skip
        d2h = self.out[n] - self.out[n_persist] + swap_bytes
        hw = self.hw
        copy_s = np.maximum(
            np.maximum(h2d / hw.h2d_bytes_per_s, d2h / hw.d2h_bytes_per_s),
            (h2d + d2h) / hw.duplex_bytes_per_s,
        )
        concurrent = hw.device != "cpu"
        prefetch = ((n_buffer >= self.min_buffers + 1) | (n_buffer >= n_off)) & concurrent
        overlapped = np.where(prefetch, np.maximum(compute_s, copy_s), compute_s + copy_s)
        off_params = self.trainable[n] - self.trainable[n_persist]
        cpu_opt_s = off_params / hw.cpu_adam_params_per_s
        dev_opt_s = (self.trainable[n_persist]) / hw.device_adam_params_per_s
        hidden_by = self.fwd_compute_s if concurrent else 0.0
        exposed_cpu_s = np.maximum(cpu_opt_s - hidden_by, 0.0)
        total = overlapped + dev_opt_s + exposed_cpu_s
        if not breakdown:
            return total
        return total, {
            "compute": float(compute_s),
            "copy": float(copy_s),
            "copy_exposed": float(overlapped - compute_s),
            "h2d_bytes": float(h2d),
            "d2h_bytes": float(d2h),
            "device_optimizer": float(dev_opt_s),
            "host_optimizer": float(cpu_opt_s),
            "host_optimizer_exposed": float(exposed_cpu_s),
        }
