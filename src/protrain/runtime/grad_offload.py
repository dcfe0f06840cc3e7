"""Gradient sink: takes each parameter's gradient as soon as autograd has accumulated it.

Called from ``Parameter.register_post_accumulate_grad_hook``, once per parameter per backward
(or once per use under reentrant checkpointing). The low-precision ``param.grad`` is folded
into the fp32 accumulator of the parameter's slot and dropped:

- persistent chunk: added on the compute device, at once, on the compute stream;
- offloaded chunk: copied to its pinned landing place on ``grad_offload_stream``, then added
  on the host by the CPU worker, which also takes the norm used for global clipping.

The first gradient after ``zero_grad`` is copied rather than added, so accumulation over
micro-batches does the same arithmetic as PyTorch's ``param.grad += grad``.

[Note: reusing a landing place]
A parameter's landing place is reused by its next gradient (next micro-batch); before the
device-to-host copy into it, the previous host accumulation of that parameter must have read
it, so the hook waits on ``slot.accumulate_future`` first. The gradient tensor is kept alive
for the copy with ``record_stream`` on the offload stream.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from protrain.chunks.chunk import ParamSlot
from protrain.chunks.manager import ChunkManager, Phase


class GradSink:
    def __init__(self, manager: ChunkManager, worker: ThreadPoolExecutor):
        self.manager = manager
        self.worker = worker
        self._slot_of = {s.param: s for s in manager.slots() if s.master is not None}

    def on_grad_accumulated(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        self.manager.phase = Phase.BACKWARD
        slot = self._slot_of[param]
        first = not slot.has_grad
        slot.has_grad = True
        chunk = self.manager.chunks[slot.chunk]
        with torch.no_grad():
            if chunk.persistent:
                if first:
                    slot.grad_acc.copy_(grad)
                else:
                    slot.grad_acc.add_(grad)
                param.grad = None
                return
            if slot.accumulate_future is not None:
                t0 = time.perf_counter()
                slot.accumulate_future.result()
                self.manager.stats["wait_cpu_optimizer_s"] += time.perf_counter() - t0
            done_event = None
            if self.manager.is_cuda:
                stream = self.manager.grad_offload_stream
                stream.wait_event(torch.cuda.current_stream(self.manager.device).record_event())
                with torch.cuda.stream(stream):
                    slot.grad_staging.copy_(grad, non_blocking=True)
                    grad.record_stream(stream)
                    done_event = stream.record_event()
            else:
                slot.grad_staging.copy_(grad)
            param.grad = None
            slot.accumulate_future = self.worker.submit(
                _accumulate, slot, first, done_event, self.manager.stats
            )


def _accumulate(slot: ParamSlot, first: bool, done_event, stats: dict) -> None:
    if done_event is not None:
        done_event.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        if first:
            slot.grad_acc.copy_(slot.grad_staging)
        else:
            slot.grad_acc.add_(slot.grad_staging)
        # The 2-norm for global clipping, taken here so that it overlaps compute; only the
        # value after the last micro-batch is used.
        slot.grad_norm = torch.linalg.vector_norm(slot.grad_acc)
    stats["host_accumulate_s"] = stats.get("host_accumulate_s", 0.0) + time.perf_counter() - t0
