"""Hybrid AdamW: one optimizer object over parameters that live in chunks on two devices.

Nothing of Adam is written here; this class only decides when each update runs. The
persistent chunks' fp32 masters are stepped on the compute device by one
``torch.optim.AdamW(fused=True)`` (one multi-tensor launch, then one ``_foreach_copy_`` of
the masters into the chunks). Each offloaded chunk is stepped on the host, in pieces, by
one of two paths, chosen once (``optim/host_adam_ext.py``; the log says which):

- the one-pass kernel (``optim/host_one_pass.py``): reads each gradient where it landed
  (bf16/fp16, or the fp32 accumulator after several micro-batches), unscales and clips as
  it reads, updates master and moments in place and writes the rounded weights into the
  chunk's host copy, which the next gather copies as it is;
- torch's functional fused AdamW (the fallback: no compiler, or ``PROTRAIN_HOST_ADAM=torch``)
  over the pinned fp32 masters as flat views (:class:`~protrain.optim.flat_adamw.FlatAdamW`:
  one tensor per run of masters that lie back to back; see [Note: flat runs] there), the
  masters then cast on the device at the chunk's next gather.

Both keep the same Adam state (``FlatAdamW``'s) and do torch's arithmetic (the one pass bit
for bit but in a tensor's last ``numel % vec_size`` elements, a few ulp: see its kernel);
[Note: write-back on the device] in ``chunks/manager.py`` says how each reaches the device. The last
``n_device_step`` offloaded chunks are stepped on the device instead, their gradients
(accumulated on the host as every offloaded chunk's), masters and moments streamed in and
out (``optim/device_step.py``): in ``step()`` after the host tasks are queued, or, armed by
``step_in_backward()``, from inside the backward once the chunk's whole gradient (with
several ranks: its reduced gradient) is on its way to the host.

With ``optimizer="adamw_8bit"`` the persistent chunks' moments are bitsandbytes' blockwise
8-bit state, stepped by its ``AdamW8bit`` instead of the fused AdamW (``optim/adamw_8bit.py``);
offloaded chunks keep fp32 moments on the host either way (see [Note: 8-bit state on the
host] there). ``state_format`` (``optimizer_state``: fp32, bf16 or 8bit) is how the host
keeps the moments of the chunks the one pass steps (``optim/state_format.py``); opt-in, as
it changes the math.

To the user it is a ``torch.optim.Optimizer``: ``param_groups`` holds the model's own
parameters (so LR schedulers work on it), ``state_dict`` is keyed by parameter index like
torch's, and ``load_state_dict`` takes that format back.

[Note: overlap and exact clipping]
Global-norm clipping needs the norm over every gradient before any parameter changes, so no
update can start before the last backward ends. The host updates therefore overlap the *next
forward*: ``step`` enqueues one task per offloaded chunk on the CPU worker and returns; the worker
(``runtime/host_worker.py``) runs them in forward order (each ranked by its chunk's
position in ``manager.forward_order``), and the gather of a chunk in the next forward waits
only for that chunk's task, or rather for the piece of it that writes each parameter: an
update runs in pieces of at most ``_UPDATE_PIECE_NUMEL`` parameters, one ``FlatAdamW``
each, and the gather copies every piece in as soon as it is written (see [Note:
gathering an updating chunk] in ``chunks/manager.py``).
The norm stays cheap because each offloaded gradient's 2-norm is taken as it arrives, during
backward (on the device for the first micro-batch, on the host worker after a host
accumulation); ``clip_grad_norm_`` only combines per-parameter norms (as torch does: a norm
of the per-tensor norms) and scales the persistent gradients on the device, and the clip
coefficient is applied to the offloaded gradients inside their step task, with the same
multiplication torch does, so the result equals ``torch.nn.utils.clip_grad_norm_`` followed
by ``AdamW.step``.

Without clipping nothing waits for the whole backward: each step task waits only for its
own chunk's gradients to land (``slot.grad_event``), so the host AdamW of the last layers
can run while the device computes the gradients of the first ones (see [Note: step in
backward] for starting it from inside the backward). Those tasks become ready in backward
order, and a FIFO worker would step the first chunk the next forward needs last, making the
forward wait for every update; the worker's ranking takes the backlog in forward order
instead, so the forward trails the host optimizer chunk by chunk. The order changes only
the schedule: every chunk's update does the same arithmetic.

[Note: step in backward]
Without clipping, the update of an offloaded chunk could start the moment its last gradient
lands, while the device still runs the backward of the layers before it. ``step`` cannot do
that: it is called after ``backward`` returns, and by then the device is mostly done (the
host blocks on buffer reuse during backward). ``step_in_backward()`` says ahead of time
that the next backward is the last of the window and that ``step()`` follows it without
clipping or loss scaling, at the hyperparameters ``param_groups`` hold now. The gradient
sink then watches each offloaded chunk (see [Note: chunks complete in backward] in
``runtime/grad_offload.py``) and the chunk's step task is queued on the host worker from
inside the backward, right behind its gradient's device-to-host copy. The chunk is marked
stale (or updating) only by ``step()``: a gather later in the same backward (a LoRA chunk's
frozen weights, say) does not wait for the update, and reads every weight the backward
still uses as the forward did ([Note: the one pass writes the host copy in backward] in
``chunks/manager.py``). ``step()`` then steps the persistent chunks on the device and queues the chunks that
never completed (parameters without a gradient) as usual. Each update does the same
arithmetic as in ``step()``; only its start moves. Calling ``clip_grad_norm_``,
``zero_grad``, saving or loading state, or changing a hyperparameter between the two calls is
an error, since updates have already run.

[Note: loss scaling over chunks]
With fp16 compute the user backpropagates ``scale_loss(loss)`` (the loss times the scale of
:class:`~protrain.optim.loss_scaler.LossScaler`); accumulators hold scaled fp32 gradients.
``unscale_`` (called by ``clip_grad_norm_``, or by ``step`` when nothing clipped) runs once
per step, after the whole backward: persistent gradients are multiplied by ``1 / scale`` and
checked on the device with GradScaler's own kernel; an offloaded gradient is checked through
its 2-norm, which the gradient sink already takes on every gradient (a tensor holding inf or
nan has a non-finite norm), so no offloaded gradient is read again. The offloaded gradients
themselves are unscaled on the host inside their step task, before the clip coefficient,
with the same kernel and order as GradScaler then ``clip_grad_norm_``; their norms for
clipping are ``norm * (1 / scale)``, bit for bit the norm of the unscaled gradient because
every scale is a power of two. ``step`` then reads the one found-inf flag (one sync, as
GradScaler's step does), updates the scale, and on inf or nan returns before any update is
enqueued: no chunk changes, on the device or on the host, and no Adam state is created or
advanced. Since the decision needs every gradient, an fp16 step always enqueues the host
updates in forward order. Without fp16 (scaler disabled) none of this runs.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent import futures

import torch

from protrain.chunks.chunk import Chunk, ParamSlot, UpdateProgress
from protrain.chunks.manager import ChunkManager
from protrain.knobs import OptimizerSettings
from protrain.optim import host_adam_ext
from protrain.optim.adamw_8bit import (
    QMAP_KEYS,
    TORCH_STATE_KEYS,
    DeviceAdamW8bit,
    check_optimizer,
    convert_state,
    device_adamw,
    device_state_keys,
)
from protrain.optim.device_step import DeviceStep
from protrain.optim.flat_adamw import FlatAdamW
from protrain.optim.host_one_pass import plan_reads, step_piece
from protrain.optim.loss_scaler import LossScaler
from protrain.optim.state_format import (
    MOMENTS,
    check_saved_format,
    check_state_format,
    decode_state,
    encode_state,
    reencode_state,
    state_keys,
)
from protrain.runtime.grad_offload import GradSink
from protrain.runtime.host_worker import HostWorker

log = logging.getLogger(__name__)
_HYPER = ("lr", "betas", "eps", "weight_decay")
# Parameters per piece of a host update (fp32: 128 MiB of masters): a gather waiting for the
# update copies each piece in as soon as it is written. See [Note: gathering an updating
# chunk] in chunks/manager.py. A larger tensor is a piece of its own.
_UPDATE_PIECE_NUMEL = 1 << 25
_DEVICE = -1  # the piece key of a device-stepped chunk's whole update in step_in_backward


def check_hyperparameters(defaults: dict, param_groups: list[dict]) -> None:
    """AdamW's own checks, on the defaults and on every group's values (torch checks only
    the constructor's arguments), so that a bad value fails before any chunk moves."""
    for where, values in [("", defaults)] + [
        (f"param_groups[{i}].", {**defaults, **{k: g[k] for k in _HYPER if k in g}})
        for i, g in enumerate(param_groups)
    ]:
        lr, (beta1, beta2), eps, wd = (values[k] for k in _HYPER)
        for name, value, ok, rule in (
            ("lr", lr, lr >= 0, ">= 0"),
            ("betas[0]", beta1, 0 <= beta1 < 1, "in [0, 1)"),
            ("betas[1]", beta2, 0 <= beta2 < 1, "in [0, 1)"),
            ("eps", eps, eps >= 0, ">= 0"),
            ("weight_decay", wd, wd >= 0, ">= 0"),
        ):
            if not ok:
                raise ValueError(f"{where}{name}={value} is not allowed: use a value {rule}")


class HybridAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        param_groups: list[dict],
        manager: ChunkManager,
        worker: HostWorker,
        settings: OptimizerSettings,
        *,
        scaler: LossScaler | None = None,
        sink: GradSink | None = None,
        device_step: DeviceStep | None = None,
    ):
        """``param_groups``: the model's parameters (their groups' hyperparameters over
        ``settings``'); ``settings``: AdamW's defaults (``lr``, ``betas``, ``eps``,
        ``weight_decay``), ``optimizer`` and ``optimizer_state`` (its ``param_groups`` is
        not read: the groups are the first argument)."""
        check_optimizer(settings.optimizer)
        check_state_format(settings.optimizer_state)
        self.optimizer_name = settings.optimizer  # "adamw" or "adamw_8bit" (optim/adamw_8bit.py)
        self.state_format = settings.optimizer_state  # the host's moments (optim/state_format.py)
        defaults = {k: getattr(settings, k) for k in _HYPER}
        self._ready = False
        super().__init__(param_groups, defaults)
        self._manager = manager
        self._worker = worker
        self._close_fn = None  # the owning engine's close (set by protrain.engine.wrap)
        self._clip_coef: torch.Tensor | None = None
        self._clipped = False  # clip_grad_norm_ ran since zero_grad
        # slots that had a gradient before zero_grad(set_to_none=False): torch would step
        # them with a zero gradient where the next backward gives them none
        self._kept_zero: set[int] = set()
        self.scaler = scaler if scaler is not None else LossScaler(manager.device, enabled=False)
        self._found_inf: torch.Tensor | None = None  # set by unscale_, read by step
        self._inv_scale: torch.Tensor | None = None
        self._sink = sink
        # the offloaded chunks stepped on the device (optim/device_step.py); None: none
        self._device_step = device_step if device_step and device_step.n_chunks else None
        self._armed_hyper: list[dict] | None = None  # set by step_in_backward
        # chunk -> its pieces whose update began in backward (see [Note: step in backward])
        self._armed_started: dict[int, set[int]] = {}
        # device-stepped chunks whose update ran in the armed backward (optim/device_step.py)
        self._armed_device: set[int] = set()
        slot_of = {s.param: s for s in manager.slots() if s.master is not None}
        self._slots: list[ParamSlot] = [slot_of[p] for g in self.param_groups for p in g["params"]]
        self._group_of = {
            id(slot_of[p]): gi for gi, g in enumerate(self.param_groups) for p in g["params"]
        }
        persistent = [s for s in self._slots if manager.chunks[s.chunk].persistent]
        self._persistent_slots = persistent
        self._device_opt = self._inner(persistent)
        if self.optimizer_name == "adamw_8bit":  # say what the choice covers in this layout
            on_device = sum(s.master.numel() for s in persistent)
            total = sum(s.master.numel() for s in self._slots)
            log.info(
                "protrain: optimizer='adamw_8bit' keeps 8-bit state for %d of %d trainable "
                "parameters (the persistent chunks'); the offloaded ones keep fp32 moments on "
                "the host",
                on_device,
                total,
            )
        self._host_opts: dict[int, list[FlatAdamW]] = {
            c.index: [
                FlatAdamW(piece, [self._group_of[id(s)] for s in piece], self.state_format)
                for piece in _pieces(c.trainable_slots)
            ]
            for c in manager.offloaded
            if c.trainable_slots
        }
        self._one_pass = self._choose_one_pass()
        if self.state_format != "fp32":
            self._check_compact_state()
        self._ready = True

    def _check_compact_state(self) -> None:
        """Refuse a compact ``state_format`` where something other than the one pass would
        step its moments, and say once what it changes.

        Any number of ranks: each rank's one pass steps the slots it holds, so a sharded
        chunk's moments are encoded over the rank's own elements (the 8-bit blocks of 256
        laid from each rank's first element of a parameter, the bf16 rounding bits drawn by
        the offset in the shard); replicated, every rank steps the whole chunk from the
        same reduced gradient with the same seeds and step counts, so all hold the same
        state. A checkpoint gathers the moments decoded to fp32 (:meth:`state_dict`)."""
        fmt, manager = self.state_format, self._manager
        where = None
        if self._device_step is not None:
            where = "with n_device_step > 0 (the device step streams fp32 moments)"
        elif self._one_pass is None and not manager.discard_offloaded_grads and self._host_opts:
            where = "without the host's one-pass kernel (the log's line on the host AdamW says why)"
        if where is not None:
            raise ValueError(
                f"optimizer_state={fmt!r} is not supported {where}; use optimizer_state='fp32'"
            )
        host = sum(s.master.numel() for opts in self._host_opts.values()
                   for a in opts for s in a.slots)  # fmt: skip
        total = sum(s.master.numel() for s in self._slots)
        how = {
            "bf16": "bf16, rounded stochastically",
            "8bit": "8 bits an element with an fp32 absmax a block of 256 (a floating-point "
            "code relative to the absmax)",
        }[fmt]
        log.info(
            "protrain: optimizer_state=%r (opt-in; it changes the math): the Adam moments of "
            "%d of %d trainable parameters (the offloaded chunks') are kept on the host in %s "
            "and updated in fp32; masters stay fp32, and the persistent chunks' moments fp32 "
            "on the device",
            fmt,
            host,
            total,
            how,
        )

    def _choose_one_pass(self):
        """The one-pass kernel for the host-stepped offloaded chunks (``optim/host_one_pass.py``),
        or None: torch's fused AdamW with the cast on the device (no kernel, or the
        profiler's wrap, whose gradients are discarded)."""
        manager = self._manager
        chunks = [ci for ci in self._host_opts if not self._on_device(ci)]
        if not chunks or manager.discard_offloaded_grads:
            return None
        kernel = host_adam_ext.kernel()
        if kernel is None:
            return None
        manager.ensure_grad_staging()  # where one backward's gradients land for the pass
        if self._sink is not None:
            self._sink.one_pass_chunks = frozenset(chunks)
        return kernel

    def _mark_updating(self, chunk: Chunk) -> None:
        """``chunk``'s update has run or runs: its next gather reads it (the host copy the
        one pass writes, or the masters cast on the device)."""
        if self._one_pass is not None:
            chunk.host_updating = True
        else:
            chunk.host_stale = True

    def _inner(self, slots: list[ParamSlot]):
        """The device optimizer over the masters of ``slots`` (the persistent chunks'):
        torch's fused AdamW, or bitsandbytes' 8-bit AdamW; inner group -> outer group."""
        if not slots:
            return None
        groups, group_map = [], []
        for gi, g in enumerate(self.param_groups):
            masters = [s.master for s in slots if self._group_of[id(s)] == gi]
            if masters:
                groups.append({"params": masters, **{k: g[k] for k in _HYPER}})
                group_map.append(gi)
        return device_adamw(groups, self.optimizer_name), group_map

    def add_param_group(self, param_group: dict) -> None:
        if self._ready:
            raise RuntimeError(
                "protrain: parameter groups are fixed at wrap time; pass param_groups to wrap()"
            )
        super().add_param_group(param_group)

    # ---- gradients ----------------------------------------------------------------------

    def _wait_reductions(self) -> None:
        """With several ranks: the compute stream waits for the gradient reductions."""
        if self._sink is not None and self._sink.reducer is not None:
            self._sink.reducer.wait()

    def _flush_grads(self) -> None:
        """The first gradients the sink still holds go to their accumulators (after a
        backward that raised before its end; see [Note: batched first gradients] in
        runtime/grad_offload.py)."""
        if self._sink is not None:
            self._sink.flush()

    def _wait_accumulations(self) -> None:
        self._flush_grads()
        for s in self._slots:
            if s.accumulate_future is not None:
                t0 = time.perf_counter()
                s.accumulate_future.result()
                self._manager.stats["wait_cpu_optimizer_s"] += time.perf_counter() - t0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: ``loss * scale`` in fp16, ``loss`` itself otherwise."""
        return self.scaler.scale(loss)

    @torch.no_grad()
    def unscale_(self) -> None:
        """Unscale and check every gradient; see [Note: loss scaling over chunks]."""
        self._check_open()
        if not self.scaler.enabled or self._found_inf is not None:
            return
        self._wait_accumulations()
        self._wait_reductions()
        manager = self._manager
        if manager.is_cuda:  # offloaded norms taken on the gradient offload stream
            torch.cuda.current_stream(manager.device).wait_stream(manager.grad_offload_stream)
        inv_scale = self.scaler.inv_scale()
        found_inf = torch.zeros(1, dtype=torch.float32, device=manager.device)
        persistent_grads = [s.grad_acc for s in self._persistent_slots if s.has_grad]
        if persistent_grads:
            torch._amp_foreach_non_finite_check_and_unscale_(persistent_grads, found_inf, inv_scale)
        offloaded_norms = [
            s.grad_norm.to(manager.device)
            for s in self._slots
            if s.has_grad and not manager.chunks[s.chunk].persistent
        ]
        if offloaded_norms:
            bad = ~torch.isfinite(torch.stack(offloaded_norms)).all()
            found_inf.add_(bad.to(torch.float32))
        if manager.sharded:  # each rank has checked its own shards: skip on any rank's inf
            manager.collectives.all_reduce_sum(found_inf)
        self._found_inf, self._inv_scale = found_inf, inv_scale

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Global-norm clipping over all gradients, wherever they live (as torch's)."""
        self._check_open()
        if self._armed_hyper is not None:
            raise RuntimeError(
                "protrain: clip_grad_norm_ after step_in_backward(): clipping needs every "
                "gradient before any update starts; do not arm the step when clipping"
            )
        if self._clipped:
            raise RuntimeError(
                "protrain: clip_grad_norm_ a second time before zero_grad(): offloaded "
                "gradients are clipped inside the host step, by the coefficient of the one "
                "clip of the window; clip once, after the window's last backward"
            )
        total, persistent_grads = self._total_norm(norm_type)
        self._clipped = True
        if error_if_nonfinite and (total.isnan() or total.isinf()):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total}")
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if persistent_grads:
            torch._foreach_mul_(persistent_grads, clip_coef)
        self._clip_coef = clip_coef
        return total

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global norm of the gradients accumulated since ``zero_grad`` (unscaled, over
        every rank), as ``clip_grad_norm_`` computes it, changing nothing: also after a
        backward armed by ``step_in_backward()``, whose updates may have begun (the 2-norm
        comes from the per-tensor norms the gradient sink took). With several ranks it is a
        collective: every rank calls it."""
        self._check_open()
        return self._total_norm(norm_type)[0]

    def _total_norm(self, norm_type: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The global norm (see :meth:`grad_norm`) and the persistent gradients it read.

        Sharded slots hold this rank's elements: a parameter's 2-norm is the root of the
        sum over ranks of the squares of its shards' norms (one all-reduce for all of them;
        a parameter wholly on one rank keeps its own norm bit for bit, sqrt(n * n) == n),
        its inf-norm the largest over ranks (exact). Other norms are refused there."""
        norm_type = float(norm_type)
        self._wait_accumulations()
        self.unscale_()
        self._wait_reductions()
        inv_scale = None if self._inv_scale is None else self._inv_scale.squeeze()
        manager = self._manager
        device = manager.device
        if manager.sharded and norm_type not in (2.0, math.inf):
            raise ValueError(
                f"protrain: a gradient norm of order {norm_type} with sharded chunks: only the "
                "2-norm and the inf-norm are combined across ranks"
            )
        if manager.is_cuda:  # offloaded norms taken on the gradient offload stream
            torch.cuda.current_stream(device).wait_stream(manager.grad_offload_stream)
        persistent_grads = [s.grad_acc for s in self._persistent_slots if s.has_grad]
        norms = list(torch._foreach_norm(persistent_grads, norm_type)) if persistent_grads else []
        shard_at: list[int] = []
        for s in self._slots:
            if not s.has_grad or manager.chunks[s.chunk].persistent:
                continue
            if s.shard is not None:
                shard_at.append(len(norms))
            if norm_type == 2.0 and s.grad_norm is not None:
                norm = s.grad_norm.to(device)
                norms.append(norm if inv_scale is None else norm * inv_scale)
            else:
                _refuse_if_discarded(manager, f"a gradient norm (norm_type={norm_type:g})")
                if s.grad_event is not None:
                    s.grad_event.synchronize()
                grad = s.landed_grad()
                grad = grad if inv_scale is None else grad * inv_scale.cpu()
                if grad.numel() == 0:  # a shard of no elements (the max of nothing fails)
                    norms.append(torch.zeros((), device=device))
                else:
                    norms.append(torch.linalg.vector_norm(grad, norm_type).to(device))
        if shard_at:  # the same slots have gradients on every rank (the reducer's mask)
            coll = manager.collectives
            own = torch.stack([norms[i] for i in shard_at])
            if norm_type == 2.0:
                whole = coll.all_reduce_sum(own**2).sqrt()
            else:
                whole = coll.all_reduce_max(own)
            for i, n in zip(shard_at, whole.unbind()):
                norms[i] = n
        if not norms:
            return torch.tensor(0.0, device=device), persistent_grads
        return torch.linalg.vector_norm(torch.stack(norms), norm_type), persistent_grads

    # ---- step ---------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """The engine's running counters (seconds waited on copies and on the host
        optimizer, gathers, updates started in backward), read-only for callers."""
        return self._manager.stats

    def step_in_backward(self) -> None:
        """Start each offloaded chunk's update during the next backward, as soon as its
        gradients are complete; see [Note: step in backward]. Call it before the last
        backward of an accumulation window, then ``step()`` after that backward, with no
        clipping and no fp16 loss scaling in between. Exact: the same updates as ``step()``.
        """
        self._check_open()
        if self.scaler.enabled:
            raise RuntimeError(
                "protrain: step_in_backward() is not allowed with fp16 loss scaling: the "
                "skip-on-overflow decision needs every gradient before any update"
            )
        if self._armed_hyper is not None:
            raise RuntimeError("protrain: step_in_backward() was already called for this step")
        self._refuse_unfrozen(self._unfrozen())  # before any update begins
        _refuse_if_discarded(self._manager, "step_in_backward()")
        if self._sink is None:
            raise RuntimeError("protrain: this optimizer was built without a gradient sink")
        self._armed_hyper = [{k: g[k] for k in _HYPER} for g in self.param_groups]
        self._armed_started, self._armed_device = {}, set()
        pieces = {
            (ci, pi): piece
            for ci, opts in self._host_opts.items()
            if not self._on_device(ci)
            for pi, piece in enumerate(p.slots for p in opts)
        }
        # A device-stepped chunk steps once its whole gradient is on its way to the host (its
        # copy-in waits for the copies; with several ranks the reducer delivers the reduced
        # gradients on its own stream, which the step's streams wait for). Not in the last
        # backward of an accumulation window with earlier micro-batches: its gradients are
        # then added on the host, and the step's wait for those adds would hold the
        # backward's thread (step() steps it).
        if self._device_step is not None:
            for ci in self._device_step.chunk_ids():
                slots = self._manager.chunks[ci].trainable_slots
                if not any(s.has_grad for s in slots):
                    pieces[(ci, _DEVICE)] = slots
        self._sink.watch(pieces, self._start_in_backward)

    def _start_in_backward(self, key: tuple[int, int]) -> None:
        """A piece's gradients are all on their way to the host: queue its update now (a
        device-stepped chunk's: step it now; its copy-in waits for them)."""
        ci, pi = key
        chunk = self._manager.chunks[ci]
        if pi == _DEVICE:
            opts = self._host_opts[ci]
            items = [(s, opts[s.update_piece], self._group_of[id(s)])
                     for s in chunk.trainable_slots]  # fmt: skip
            self._device_step.step(items, self._armed_hyper, None, None)
            self._armed_device.add(ci)
            stats = self._manager.stats
            stats["updates_started_in_backward"] = stats.get("updates_started_in_backward", 0) + 1
            return
        if ci not in self._armed_started:
            self._armed_started[ci] = set()
            self._begin_update(chunk)
            stats = self._manager.stats
            stats["updates_started_in_backward"] = stats.get("updates_started_in_backward", 0) + 1
        # host_stale stays False until step(): see [Note: step in backward]
        self._submit_piece(chunk, pi, self._armed_hyper, None, None)
        self._armed_started[ci].add(pi)  # only once queued: abandoning queues the others

    def _begin_update(self, chunk: Chunk) -> None:
        """A new update of ``chunk``: its own progress object (a chunk stepped twice before a
        gather, two step() calls in a row, must not count the first update's pieces for the
        second) and the future of the whole update."""
        progress = chunk.update_progress = UpdateProgress(len(self._host_opts[chunk.index]))
        chunk.update_future = progress.future

    def _submit_piece(
        self, chunk: Chunk, pi: int, hyper, inv_scale, clip_coef, with_grad=None
    ) -> None:
        """Queue one piece of ``chunk``'s host update, ranked by the chunk's place in the
        forward, then by the piece's place in the chunk. ``with_grad``: the slots it steps
        (default: those of the piece with a gradient; ``[]`` completes it unchanged)."""
        order = self._manager.forward_order
        rank = order.index(chunk.index) if chunk.index in order else len(order) + chunk.index
        opts = self._host_opts[chunk.index]
        if with_grad is None:
            with_grad = [s for s in opts[pi].slots if s.has_grad]
        if self._one_pass is not None:  # fixed now: zero_grad may run before the task
            inv = None if inv_scale is None else float(inv_scale)
            # the torch path's rule: a coefficient of exactly 1 changes no bit
            coef = None if clip_coef is None or float(clip_coef) == 1.0 else float(clip_coef)
            stepping = (with_grad, hyper, inv, coef, plan_reads(with_grad, inv, coef))
        else:
            stepping = (with_grad, hyper, inv_scale, clip_coef)
        self._worker.submit(
            _step_host_piece_task,
            chunk,
            chunk.update_progress,
            pi,
            opts[pi],
            stepping,
            self._manager.stats,
            self._one_pass,
            priority=rank + pi / (len(opts) + 1),
            ready=lambda: _grads_landed(with_grad),
        )

    def _abandon_started_updates(self, *, stale: bool) -> None:
        """Between an armed backward and ``step()`` (``close()``, or ``step()`` refusing a
        changed hyperparameter): complete every update begun in backward with its other
        pieces left unchanged, so that nothing waits for pieces only ``step()`` would queue,
        and disarm. The weights are then half stepped (see :meth:`check_between_steps`).
        ``stale``: the next gathers read the updated masters."""
        for ci, pieces in self._armed_started.items():
            chunk = self._manager.chunks[ci]
            for pi in range(len(self._host_opts[ci])):
                if pi not in pieces:
                    self._submit_piece(chunk, pi, self._armed_hyper, None, None, with_grad=[])
            if stale:
                self._mark_updating(chunk)
        self._disarm()

    def _disarm(self) -> None:
        if self._sink is not None:
            self._sink.unwatch()
        self._armed_hyper = None
        self._armed_started, self._armed_device = {}, set()

    @torch.no_grad()
    def step(self, closure=None):
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._flush_grads()
        self._refuse_kept_zero_without_grad()
        unfrozen = self._unfrozen()
        if self._armed_hyper is None:  # else refused once the started updates are complete
            self._refuse_unfrozen(unfrozen)
        loss = self._step(loss)
        self._refuse_unfrozen(unfrozen, stepped=True)
        return loss

    def _step(self, loss):
        hyper = [{k: g[k] for k in _HYPER} for g in self.param_groups]
        manager = self._manager
        if any(s.has_grad for c in manager.offloaded for s in c.trainable_slots):
            _refuse_if_discarded(manager, "step()")
        armed, started = self._armed_hyper, self._armed_started
        device_started = self._armed_device
        if armed is not None:
            if hyper != armed:
                for ci in device_started:  # stepped: a retried step() must not step them again
                    for slot in manager.chunks[ci].trainable_slots:
                        slot.has_grad = False
                # The updates that began in backward have run: the next gathers must read
                # them; the pieces not begun stay as they are.
                manager.release_all()
                self._abandon_started_updates(stale=True)
                for ci, pieces in started.items():  # a retried step() must not step them again
                    for pi in pieces:
                        for slot in self._host_opts[ci][pi].slots:
                            slot.has_grad = False
                # ... nor begin a new update of these chunks while their pieces still run
                futures.wait([manager.chunks[ci].update_future for ci in started])
                raise RuntimeError(
                    "protrain: a hyperparameter changed between step_in_backward() and step(); "
                    f"the updates started in backward used {armed}, param_groups now hold "
                    f"{hyper}. The {len(started) + len(device_started)} offloaded chunks whose "
                    "update began in "
                    "backward keep the pieces of it that had begun, and nothing else was "
                    "updated. Change hyperparameters after step(), as LR schedulers do"
                )
            self._disarm()
        host_inv_scale = device_inv_scale = None
        if self.scaler.enabled:  # see [Note: loss scaling over chunks]
            if not any(s.has_grad for s in self._slots):
                # GradScaler's rule: a step that saw no gradient must not grow the scale.
                raise RuntimeError(
                    "protrain: step() with fp16 loss scaling found no gradients; call "
                    "backward() on optimizer.scale_loss(loss) first"
                )
            self.unscale_()
            found_inf, inv_scale = self._found_inf, self._inv_scale
            self._found_inf = self._inv_scale = None
            skip = bool(found_inf.item())
            self.scaler.update(found_inf)
            if skip:
                self._clip_coef = None
                log.info("protrain: inf or nan in the gradients, step skipped")
                return loss
            host_inv_scale = inv_scale.to("cpu")
            device_inv_scale = inv_scale
        clip_coef = self._clip_coef
        self._clip_coef = None

        if self._device_opt is not None:
            self._wait_reductions()
            opt, group_map = self._device_opt
            stepped = _attach_grads(self._persistent_slots)
            if stepped:
                _set_hyper(opt, group_map, hyper)
                opt.step()
                torch._foreach_copy_([s.device_view for s in stepped], [s.master for s in stepped])

        manager.release_all()  # device copies of offloaded chunks are about to be stale
        host_coef = None if clip_coef is None else clip_coef.to("cpu")
        on_device = []  # (slot, its FlatAdamW, its group) of the device-stepped chunks
        for chunk in manager.offloaded:  # the worker runs them in forward order
            ci = chunk.index
            if ci not in self._host_opts:
                continue
            if self._on_device(ci):
                if ci in device_started:  # stepped in backward: [Note: step in backward]
                    continue
                opts = self._host_opts[ci]
                on_device += [(s, opts[s.update_piece], self._group_of[id(s)])
                              for s in chunk.trainable_slots if s.has_grad]  # fmt: skip
                continue
            if ci in started:  # its update runs since backward: [Note: step in backward]
                self._mark_updating(chunk)
                for pi in range(len(self._host_opts[ci])):  # pieces some gradient never reached
                    if pi not in started[ci]:
                        self._submit_piece(chunk, pi, hyper, None, None)
                continue
            if not any(s.has_grad for s in chunk.trainable_slots):
                continue
            self._mark_updating(chunk)
            self._begin_update(chunk)
            for pi in range(len(self._host_opts[ci])):
                self._submit_piece(chunk, pi, hyper, host_inv_scale, host_coef)
        if on_device:  # after the host tasks are queued: on the CPU this step is synchronous
            # the host task's rule: a coefficient of exactly 1 changes no bit
            coef = clip_coef if host_coef is not None and float(host_coef) != 1.0 else None
            self._wait_reductions()  # several ranks: the gradients are reduced
            self._device_step.step(on_device, hyper, device_inv_scale, coef)
        return loss

    @torch.no_grad()
    def step_without_host_updates(self) -> None:
        """``step()`` with every offloaded chunk's host update left out: the persistent
        chunks step on the device, and each offloaded chunk with a gradient is marked for
        the write-back its next gather does after a real update (its fp32 masters copied in
        and cast on the device), so that the next step moves the bytes and holds the
        staging memory a training step does. For the profiler's traced steps, at ``lr=0``,
        where no weight changes either way: the host update's time comes from the hardware
        profile, and running it would also make every offloaded parameter's Adam moments
        (8 bytes each on the host; 47 GB for full-8b's trace).

        The offloaded gradients are consumed, as an update would: a backward before
        ``zero_grad()`` starts their accumulators afresh, and with fp16 loss scaling the
        inf/nan check sees the persistent gradients alone."""
        self._check_open()
        if self._armed_hyper is not None:
            raise RuntimeError(
                "protrain: step_without_host_updates() after step_in_backward(): updates have "
                "started"
            )
        self._wait_accumulations()
        for chunk in self._manager.offloaded:
            had = [s for s in chunk.trainable_slots if s.has_grad]
            # a device-stepped chunk's host copy stays fresh: only its gradients go
            if not self._on_device(chunk.index):
                chunk.host_stale = chunk.host_stale or bool(had)
            for s in had:
                s.has_grad = False
        if any(s.has_grad for s in self._persistent_slots):
            self.step()
        else:  # nothing to step (and fp16's step() refuses a step without gradients)
            self._clip_coef = self._found_inf = self._inv_scale = None
            self._manager.release_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_open()
        self.check_between_steps("zero_grad()")
        self._flush_grads()  # no copy into an accumulator after its gradient is cleared
        self._disarm()
        self._clip_coef = self._found_inf = self._inv_scale = None
        self._clipped = False
        # torch keeps zeros: a parameter without a gradient in the next backward is still
        # decayed and moved by its moments there; ProTrain frees the gradient, so that
        # case is refused at step() (_refuse_kept_zero_without_grad)
        self._kept_zero = (
            set()
            if set_to_none is None or set_to_none
            else {id(s) for s in self._slots if s.has_grad}
        )
        for s in self._slots:
            s.has_grad = s.grad_low = False
            s.grad_pending_mul = None
            s.param.grad = None
        for s in self._persistent_slots:  # device accumulators are made by the next backward
            s.grad_acc = s.master.grad = None

    def _refuse_kept_zero_without_grad(self) -> None:
        if not self._kept_zero:  # the usual zero_grad(): nothing to check on the step's path
            return
        missing = [s.name for s in self._slots if id(s) in self._kept_zero and not s.has_grad]
        if missing:
            raise RuntimeError(
                f"protrain: {missing[0]} (and {len(missing) - 1} more) got no gradient after "
                "zero_grad(set_to_none=False): torch would step it with a zero gradient "
                "(decay and momentum), ProTrain steps only parameters with a gradient; call "
                "zero_grad() with set_to_none=True (the default)"
            )

    def _unfrozen(self) -> list[str]:
        """Parameters frozen at wrap that require a gradient now: they have no master,
        moments or gradient hook, so torch's optimizer over them would train them and this
        one would leave them as they are."""
        return [s.name for s in self._manager.slots() if s.master is None and s.param.requires_grad]

    def _refuse_unfrozen(self, unfrozen: list[str], stepped: bool = False) -> None:
        if not unfrozen:
            return
        taken = (
            "; this step was taken without it (its updates had begun in backward)"
            if stepped
            else ""
        )
        raise RuntimeError(
            f"protrain: {unfrozen[0]} (and {len(unfrozen) - 1} more) was frozen when "
            "protrain.wrap placed it and requires a gradient now: the engine trains only the "
            f"parameters that required one at wrap{taken}; set requires_grad before wrapping "
            "(protrain.close(model), unfreeze, wrap again)"
        )

    # ---- state --------------------------------------------------------------------------

    def check_between_steps(self, what: str) -> None:
        """Raise if a backward armed by ``step_in_backward()`` has started updates that
        ``step()`` has not yet completed: the weights and optimizer state are then half
        stepped, neither the state before the step nor after it."""
        if self._armed_started or self._armed_device:
            raise RuntimeError(
                f"protrain: {what} after a backward armed by step_in_backward(): updates "
                "have started; call step() first (if that backward raised, the weights are "
                "half stepped: load the last checkpoint)"
            )

    def synchronize(self) -> None:
        """Wait for every host task (accumulations and updates) and raise their errors;
        except an update begun in a backward armed by ``step_in_backward()``, which ends
        only once ``step()`` has queued its remaining pieces."""
        self._check_open()
        self._flush_grads()  # held first gradients' copies are enqueued before the wait
        self._worker.barrier()
        if self._manager.is_cuda:  # device-to-host copies into host memory
            torch.cuda.synchronize(self._manager.device)
        if self._device_step is not None:
            self._device_step.harvest()
        self._wait_accumulations()
        for c in self._manager.offloaded:
            # an update begun in an armed backward completes only once step() queues the
            # pieces no gradient completed yet: not waited for here
            if c.update_future is not None and c.index not in self._armed_started:
                c.update_future.result()

    def _opt_of(self, s: ParamSlot):
        if self._manager.chunks[s.chunk].persistent:
            return self._device_opt[0]
        return self._host_opts[s.chunk][s.update_piece]

    def state_dict(self, copy: bool = True) -> dict:
        """torch's format, every tensor on the CPU; ``copy=False``: the host AdamW's state as
        the tensors themselves (see :func:`protrain.state_dict`), for writing out at once."""
        self.check_between_steps("optimizer.state_dict()")
        self.synchronize()
        whole = self._gather_sharded_state()
        state = {}
        for i, s in enumerate(self._slots):
            st = self._opt_of(s).state.get(s.master)
            if st and (id(s), "exp_avg") in whole:  # gathered: fp32 moments (no absmaxes)
                state[i] = {"step": st["step"].clone()} | {k: whole[(id(s), k)] for k in MOMENTS}
            elif st:
                state[i] = {
                    k: whole[(id(s), k)]
                    if (id(s), k) in whole
                    # bitsandbytes' maps are one tensor for every parameter: always copied
                    # (1 KiB), so that no two entries of the dict share memory
                    else v.detach().to("cpu", copy=copy or k in QMAP_KEYS)
                    if torch.is_tensor(v)
                    else v
                    for k, v in st.items()
                }
        groups, start = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(d)
        # which choice saved it: a load converts a parameter's state only between placements
        # under the same choice (convert_state), and refuses the other choice's checkpoint
        out = {"state": state, "param_groups": groups, "optimizer": self.optimizer_name}
        out["optimizer_state"] = self.state_format  # the host moments' format
        if whole and self.state_format != "fp32":  # sharded: compact moments gathered as fp32
            out["moments_gathered"] = True
        if self.scaler.enabled:
            out["loss_scaler"] = self.scaler.state_dict()
        return out

    def _gather_sharded_state(self) -> dict[tuple[int, str], torch.Tensor]:
        """``(id(slot), key) -> whole tensor`` of the Adam state of sharded chunks (a
        collective: every rank calls it, chunk by chunk, in the same order)."""
        manager = self._manager
        if not manager.sharded:
            return {}
        out = {}
        for c in manager.offloaded:
            slots = [s for s in c.trainable_slots if self._opt_of(s).state.get(s.master)]
            # compact moments: each rank's own elements decoded (exact), gathered as fp32
            own = {id(s): self._own_moments(s) for s in slots}
            for i, key in enumerate(MOMENTS):
                frags = {sid: moments[i] for sid, moments in own.items()}
                for sid, t in manager.collectives.gather_fp32(c, frags).items():
                    if sid in frags:
                        out[(sid, key)] = t.clone()
        return out

    def _own_moments(self, s: ParamSlot) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's fp32 ``exp_avg`` and ``exp_avg_sq`` of ``s`` (compact ones decoded)."""
        m, v = decode_state(self.state_format, self._opt_of(s).state[s.master])
        return m.view_as(s.master), v.view_as(s.master)

    def checkpoint_state(self, s: ParamSlot) -> dict:
        """``s``'s Adam state as a sharded checkpoint saves it (``distributed/dcp_state.py``;
        empty before its first step): its optimizer's, with compact host moments decoded to
        fp32 of the master's shape (the elements this rank holds)."""
        st = self._opt_of(s).state.get(s.master) or {}
        if not st or self.state_format == "fp32" or self._manager.chunks[s.chunk].persistent:
            return st
        m, v = self._own_moments(s)
        return {"step": st["step"], "exp_avg": m, "exp_avg_sq": v}

    def load_checkpoint_state(self, s: ParamSlot, state: dict) -> None:
        """Put a sharded checkpoint's state of ``s`` in place: fp32 moments of the elements
        this rank holds, encoded in the host's compact format where it keeps one."""
        if self.state_format != "fp32" and not self._manager.chunks[s.chunk].persistent:
            m, v = state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1)
            state = reencode_state(self.state_format, state["step"], m, v)
        self._opt_of(s).state[s.master] = state

    def load_state_dict(self, state_dict: dict) -> None:
        self.check_between_steps("optimizer.load_state_dict()")
        self.synchronize()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(sg["params"]) != len(g["params"]) for sg, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "optimizer state_dict does not match: its parameter groups have sizes "
                f"{[len(g['params']) for g in saved_groups]}, this optimizer's "
                f"{[len(g['params']) for g in self.param_groups]}"
            )
        if self.scaler.enabled and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
        for g, sg in zip(self.param_groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
        saved_choice = state_dict.get("optimizer")
        if saved_choice is not None and saved_choice != self.optimizer_name:
            raise ValueError(
                f"optimizer state_dict does not match: it was saved with optimizer="
                f"{saved_choice!r}, this engine's is {self.optimizer_name!r}; resume with the "
                "optimizer it was saved with"
            )
        check_saved_format(state_dict, self.state_format)
        ordered = [pid for sg in saved_groups for pid in sg["params"]]
        converted = 0
        for s, pid in zip(self._slots, ordered):
            opt = self._opt_of(s)
            st = state_dict["state"].get(pid, state_dict["state"].get(str(pid)))
            if not st:
                opt.state.pop(s.master, None)
                continue
            persistent = self._manager.chunks[s.chunk].persistent
            if saved_choice is None and persistent:  # a checkpoint from before the marker
                self._check_device_state(s, pid, st)
            want = (
                device_state_keys(self.optimizer_name, s.master.numel())
                if persistent
                else state_keys(self.state_format)
            )
            if not persistent and self.state_format != "fp32" and _needs_encoding(st, s):
                # a gathered checkpoint's fp32 moments, or a one-rank one under a shard
                opt.state[s.master] = _encoded_own(st, s, self.state_format)
                if not _is_compact(st) and not state_dict.get("moments_gathered"):
                    converted += 1  # fp32: saved where the parameter was persistent
                continue
            if self.state_format != "fp32" and _is_compact(st) == persistent:
                # another plan placed it on the other side of the host's compact moments
                st = _convert_host_state(st, persistent, self.state_format, s.master.shape)
                converted += 1
            if set(st) != want:  # another plan placed it on the other side (same choice)
                st = convert_state(st, want, opt if isinstance(opt, DeviceAdamW8bit) else None)
                converted += 1
            opt.state[s.master] = {k: _loaded(opt, k, v, s) for k, v in st.items()}
        if converted:
            device = "8-bit" if self.optimizer_name == "adamw_8bit" else "fp32"
            log.warning(
                "protrain: the AdamW state of %d parameters moved between %s (device) and "
                "%s (host) moments: this plan places them on the other side than the one "
                "that saved them",
                converted,
                device,
                self.state_format,
            )

    def _check_device_state(self, s: ParamSlot, pid, st: dict) -> None:
        """A persistent parameter's saved state has the keys its device optimizer keeps (a
        checkpoint of the other ``optimizer`` choice is refused, not misread)."""
        want = device_state_keys(self.optimizer_name, s.master.numel())
        if set(st) != want:
            raise ValueError(
                f"optimizer state_dict does not match: parameter {pid} ({s.name}) has state "
                f"keys {sorted(st)}; optimizer={self.optimizer_name!r} keeps {sorted(want)} "
                "for it (was the checkpoint saved with the other optimizer choice?)"
            )

    def close(self) -> None:
        """Close the whole engine (see :func:`protrain.close`)."""
        if self._close_fn is not None:
            self._close_fn()

    def _on_device(self, chunk: int) -> bool:
        """Whether ``chunk``'s AdamW runs on the device (optim/device_step.py)."""
        return self._device_step is not None and self._device_step.takes(chunk)

    def _release(self) -> None:
        if self._device_step is not None:
            self._device_step.close()
        self._device_opt, self._host_opts, self._slots = None, {}, []
        self._closed = True

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError("protrain: this optimizer's engine is closed")


def _own(key: str, value: torch.Tensor, s: ParamSlot) -> torch.Tensor:
    """Of a whole state tensor, the part a slot holds: all of it, or a sharded chunk's own
    elements of a moment (Adam's step count stays whole)."""
    if s.shard is None or key == "step":
        return value
    lo, hi = s.shard
    return value.reshape(-1)[lo:hi]


def _loaded(opt, key: str, value, s: ParamSlot):
    """A saved state value as ``s``'s optimizer keeps it: a copy on the master's device,
    floating point as fp32 (torch's Adam state), bitsandbytes' uint8 state as uint8, and
    its quantization maps shared again."""
    if not torch.is_tensor(value):
        return value
    dtype = torch.float32 if value.is_floating_point() else value.dtype
    out = _own(key, value, s).to(s.master.device, dtype, copy=True)
    if isinstance(opt, DeviceAdamW8bit) and key in QMAP_KEYS:
        return opt.shared_qmap(key, out)
    return out


def _is_compact(st: dict) -> bool:
    """Whether a saved state is a host's compact one (bf16 or 8-bit moments), not the
    device's (torch's fp32 state or bitsandbytes')."""
    return "exp_avg" in st and st["exp_avg"].dtype != torch.float32


def _needs_encoding(st: dict, s: ParamSlot) -> bool:
    """Whether a host slot's saved state must be re-encoded for a compact engine: it is fp32
    (gathered from sharded ranks, or saved where the parameter was persistent), or compact
    but whole where this rank holds a shard (its blocks and bits are laid over the shard)."""
    return not _is_compact(st) or s.shard is not None


def _encoded_own(st: dict, s: ParamSlot, state_format: str) -> dict:
    """A host slot's saved state (compact whole, or fp32 whole) as ``state_format`` over the
    elements ``s`` holds: decoded to fp32 (exact), sliced, encoded again (the same codes
    where they were laid over the same elements: ``reencode_state``)."""
    if set(st) != TORCH_STATE_KEYS and not _is_compact(st):  # bitsandbytes' device state
        st = convert_state(st, TORCH_STATE_KEYS)
    saved_format = state_format if _is_compact(st) else "fp32"
    m, v = decode_state(saved_format, st)
    m, v = _own("exp_avg", m, s), _own("exp_avg_sq", v, s)
    step = torch.as_tensor(st["step"], dtype=torch.float32).clone()
    return reencode_state(state_format, step, m.contiguous(), v.contiguous())


def _convert_host_state(st: dict, persistent: bool, state_format: str, shape) -> dict:
    """A host state of ``state_format`` as torch's fp32 state of the parameter's ``shape``
    (exact: decoded; torch's fused AdamW on CUDA takes moments of the parameter's shape
    only), which the caller converts on to the device optimizer's; or a device state as
    the host's (via torch's fp32 state, then encoded once: bf16 rounded to nearest)."""
    if persistent:
        m, v = decode_state(state_format, st)
        return encode_state("fp32", st["step"], m.view(shape), v.view(shape))
    if set(st) != TORCH_STATE_KEYS:  # bitsandbytes' state of a persistent parameter
        st = convert_state(st, TORCH_STATE_KEYS)
    m, v = decode_state("fp32", st)
    return encode_state(state_format, st["step"], m, v)


def _refuse_if_discarded(manager: ChunkManager, what: str) -> None:
    if manager.discard_offloaded_grads:
        raise RuntimeError(
            f"protrain: {what} reads offloaded gradients, which this engine discards (the "
            "profiler's wrap, see [Note: discarded gradients] in chunks/manager.py); only "
            "step_without_host_updates() steps it"
        )


def _attach_grads(slots: list[ParamSlot]) -> list[ParamSlot]:
    with_grad = []
    for s in slots:
        s.master.grad = s.grad_acc if s.has_grad else None
        if s.has_grad:
            with_grad.append(s)
    return with_grad


def _set_hyper(opt: torch.optim.Optimizer, group_map: list[int], hyper: list[dict]) -> None:
    for inner, gi in zip(opt.param_groups, group_map):
        inner.update(hyper[gi])


def _pieces(slots: list[ParamSlot]) -> list[list[ParamSlot]]:
    """Consecutive slots grouped into pieces of at most ``_UPDATE_PIECE_NUMEL`` parameters
    (a larger tensor alone); each slot learns its piece's index."""
    pieces: list[list[ParamSlot]] = []
    numel = 0
    for s in slots:
        n = s.master.numel()
        if not pieces or numel + n > _UPDATE_PIECE_NUMEL:
            pieces.append([])
            numel = 0
        s.update_piece = len(pieces) - 1
        pieces[-1].append(s)
        numel += n
    return pieces


def _grads_landed(with_grad: list[ParamSlot]) -> bool:
    """Every gradient of an update is on the host (the worker prefers such a task over a
    higher-ranked one that would block on its copies)."""
    return all(s.grad_event is None or s.grad_event.query() for s in with_grad)


@torch.no_grad()
def _step_host_piece_task(
    chunk: Chunk,
    progress: UpdateProgress,
    pi: int,
    adam: FlatAdamW,
    stepping: tuple,
    stats,
    kernel=None,
) -> None:
    """Runs on the CPU worker: piece ``pi`` of a chunk's update (unscale, clip, AdamW over
    its fp32 masters), then tells ``progress``; an error fails the whole update.
    ``stepping``: (slots with a gradient, hyperparameters, inverse loss scale, clip
    coefficient); ``kernel``: the one pass's (``optim/host_one_pass.py``), else torch's."""
    with_grad, hyper, inv_scale, clip_coef = stepping[:4]
    if progress.failed:  # an earlier piece failed: the update is over
        return
    try:
        if chunk.gathered_event is not None:
            chunk.gathered_event.synchronize()  # the last copy-in has read the masters
        if kernel is not None:
            _step_one_pass(kernel, adam, stepping, stats)
        else:
            _step_host_piece(adam, with_grad, hyper, inv_scale, clip_coef, stats)
    except BaseException as e:
        progress.fail(e)
        raise
    progress.advance(pi)


def _step_one_pass(kernel, adam: FlatAdamW, stepping: tuple, stats) -> None:
    with_grad, hyper, inv, coef, reads = stepping
    for s in with_grad:
        if s.grad_event is not None:
            s.grad_event.synchronize()  # the gradient has landed
    if not with_grad:
        return
    t0 = time.perf_counter()
    step_piece(kernel, adam, with_grad, reads, hyper, inv, coef, stats)
    stats["host_adam_s"] = stats.get("host_adam_s", 0.0) + time.perf_counter() - t0


def _step_host_piece(
    adam: FlatAdamW, with_grad: list[ParamSlot], hyper, inv_scale, clip_coef, stats
) -> None:
    for s in with_grad:
        if s.grad_event is not None:
            s.grad_event.synchronize()  # the gradient has landed in grad_acc
    if not with_grad:
        return
    t_prepare = time.perf_counter()
    batch = adam.prepare(set(map(id, with_grad)))  # makes the state of a first step
    t0 = time.perf_counter()
    # Unscale and clip over the flat gradient views the AdamW call takes: one multiply per
    # element either way, so the same bits as per tensor, with fewer parallel regions.
    if inv_scale is not None:  # step() has already found every gradient finite
        found_inf = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(batch.grads, found_inf, inv_scale)
    # A coefficient of exactly 1 (the norm under max_norm) changes no bit: skip the pass
    # over the chunk's fp32 gradients, which costs about a third of its AdamW.
    clips = clip_coef is not None and float(clip_coef) != 1.0
    if clips:
        torch._foreach_mul_(batch.grads, clip_coef)
    t1 = time.perf_counter()
    adam.step(batch, hyper)
    # [Note: host bytes of the one pass] in optim/host_one_pass.py: this path's bytes
    numel = sum(g.numel() for g in batch.grads)
    passes = 28 + 8 * ((inv_scale is not None) + clips)
    stats["host_update_bytes"] = stats.get("host_update_bytes", 0) + passes * numel
    stats["host_update_params"] = stats.get("host_update_params", 0) + numel
    stats["host_clip_s"] = stats.get("host_clip_s", 0.0) + t1 - t0
    adam_s = time.perf_counter() - t1 + t0 - t_prepare
    stats["host_adam_s"] = stats.get("host_adam_s", 0.0) + adam_s
