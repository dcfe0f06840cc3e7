"""What the training loop trains: a model with its optimizer, on plain PyTorch or the engine.

The loop calls the same few methods either way (`forward_loss_sum`, `backward`,
`clip_grad_norm`, `optimizer_step`, `model_state`, ...), so it never branches on how model
states are placed. `PlainTrainable` is ordinary PyTorch: the model on one device and
`torch.optim.AdamW`. `EngineTrainable` hands the model to `protrain.wrap`, which places
parameters, gradients and optimizer states in chunks between the GPU and the host.
"""

from __future__ import annotations

import abc
import contextlib
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from protrain.knobs import OptimizerSettings
from protrain.planned_wrap import apply_plan
from protrain.planned_wrap import wrap as protrain_wrap
from protrain.train.config import ENGINE_OPTIMIZERS, TrainConfig
from protrain.train.errors import ConfigError
from protrain.train.log import logger, warn_once
from protrain.train.loss import loss_sum, unwrap_causal_lm
from protrain.train.planning import PlanSettings, loss_chunk_of, plan_memory


def optimizer_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices, not biases or norm weights (the Hugging Face Trainer's rule)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def engine_optimizer(model: nn.Module, cfg: TrainConfig) -> OptimizerSettings:
    """The engine's optimizer for the config's AdamW settings and weight-decay groups."""
    return OptimizerSettings(
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        param_groups=optimizer_param_groups(model, cfg.weight_decay),
        optimizer=ENGINE_OPTIMIZERS[cfg.optimizer],
        optimizer_state=cfg.optimizer_state,
    )


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


class Trainable(abc.ABC):
    """The model and optimizer the loop trains; subclasses place the model states."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        chunked_loss_tokens: int | None = None,
    ):
        self.model = model
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.names = trainable_names(model)
        self.chunked_loss_tokens = chunked_loss_tokens
        if chunked_loss_tokens is not None:
            check_chunked_loss_supported(model)
        self.activations = None  # the handle of applied activation policies, if any
        # what an export writes, as the model is before any placement changes its storage
        self.export_shapes = {
            name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()
        }
        self.export_param_dtypes = [(name, p.dtype) for name, p in model.named_parameters()]
        self.export_numel = sum(p.numel() for p in model.parameters())  # ties counted once

    def apply_activation_knobs(self, cfg: TrainConfig) -> None:
        """Per-block activation policies and tiled MLP, from the `memory:` knobs."""
        mem = cfg.memory
        if not mem.activation_knobs_set:
            return
        from protrain.activations import apply_activation_knobs

        try:
            self.activations = apply_activation_knobs(
                self.model,
                mem.n_swap or 0,
                mem.n_checkpoint or 0,
                device=self.device,
                offload_checkpoint_inputs=mem.offload_checkpoint,
                tiled_mlp_tokens=mem.tiled_mlp_tokens,
            )
        except ValueError as exc:  # e.g. more blocks asked for than the model has
            raise ConfigError(f"memory: {exc}") from None
        logger.info(
            "activations: n_swap=%s n_checkpoint=%s offload_checkpoint=%s tiled_mlp_tokens=%s",
            mem.n_swap,
            mem.n_checkpoint,
            mem.offload_checkpoint,
            mem.tiled_mlp_tokens,
        )

    def forward_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of token losses of one micro-batch (labels are never passed to the model, so
        that the loss is computed once, here, in fp32)."""
        with self._autocast():
            return loss_sum(self.model, batch, self.device, self.chunked_loss_tokens)

    def extra_state(self) -> dict[str, Any]:
        """JSON-able state outside the model and optimizer that a checkpoint must carry."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what `extra_state` returned."""
        if state:
            warn_once(f"checkpoint state {sorted(state)} has no use in this run; ignored")

    def remove_activation_policies(self) -> None:
        if self.activations is not None:
            self.activations.remove()
            self.activations = None

    def backward(self, loss: torch.Tensor, last: bool = False, may_step: bool = True) -> None:
        """Backpropagate one micro-batch; ``last``: the last of the optimizer step;
        ``may_step`` False: the step's loss is not finite, no update may begin in backward."""
        loss.backward()

    @property
    def skips_overflow(self) -> bool:
        """True where fp16 loss scaling skips a step with inf/nan gradients by itself."""
        return False

    def skip_step(self) -> None:
        """Drop the step's gradients without updating anything (a non-finite step)."""
        self.optimizer.zero_grad(set_to_none=True)

    def check_plan(self, step: int, total_steps: int) -> dict[str, Any] | None:
        """After optimizer step `step`: a metrics record when the placement's plan was
        checked against the measured steps (only planned placements have one)."""
        return None

    @abc.abstractmethod
    def clip_grad_norm(self, max_norm: float | None) -> float | None:
        """Clip the global gradient norm to `max_norm` (None: no clipping); return the norm,
        taken either way (None only without clipping where `skips_overflow`)."""

    @abc.abstractmethod
    def optimizer_step(self) -> None:
        """Apply the optimizer update and clear the gradients."""

    @abc.abstractmethod
    def model_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Trainable parameters by name, full precision, for checkpoints. ``copy=False``:
        views of the placement's own memory where it can (to be written out at once: a save
        then holds no second copy of the model states in host memory)."""

    def optimizer_state(self, copy: bool = True) -> dict:
        """The optimizer's state dict, for checkpoints (``copy`` as in :meth:`model_state`;
        torch's optimizers return their own tensors either way)."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        """Load what `optimizer_state` returned."""
        self.optimizer.load_state_dict(state)

    @abc.abstractmethod
    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load what `model_state` returned."""

    @abc.abstractmethod
    def export_model(self) -> nn.Module:
        """The model with its trained weights, ready for `save_pretrained`."""

    def full_tensor(self, name: str) -> torch.Tensor:
        """One entry of the model's state dict, whole, on the CPU, in the dtype an export
        writes, on every rank (a collective where the placement shards it: every rank asks
        for the same names in the same order). It may be the model's own memory: to be read
        (written out) at once, not changed."""
        return self.model.state_dict(keep_vars=True)[name].detach().to("cpu")

    def own_trainable_values(self) -> dict[str, torch.Tensor]:
        """The trainable values this rank holds (its own shards where they are sharded), by
        name; no collective."""
        return self.model_state(copy=False)

    def close(self, keep_weights: bool = True) -> None:
        """Give back what the placement holds (activation hooks; the engine's buffers,
        threads and hooks). ``keep_weights=False``: the run is over and its weights are
        written; the model need not hold them (no gather)."""
        self.remove_activation_policies()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _check_state_names(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.names) - set(state))
        unexpected = sorted(set(state) - set(self.names))
        if missing or unexpected:
            raise ValueError(
                "checkpoint does not match the model: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        # shapes too: a model of another size has the same names (the engine's offloaded
        # parameters and FSDP2's DTensors keep their whole shape)
        params = dict(self.model.named_parameters())
        for name in self.names:
            want = tuple(params[name].shape) if name in params else None
            if want is not None and tuple(state[name].shape) != want:
                raise ValueError(
                    f"checkpoint does not match the model: {name} is "
                    f"{tuple(state[name].shape)} in the checkpoint, {want} in the model"
                )


def plain_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The config's optimizer over every trainable parameter: torch's AdamW, or
    bitsandbytes' 8-bit AdamW (its default threshold: tensors under 4096 elements keep fp32
    state, as the engine's persistent chunks do)."""
    groups = optimizer_param_groups(model, cfg.weight_decay)
    hyper = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    if cfg.optimizer == "adamw_bnb_8bit":
        from protrain.optim.adamw_8bit import MIN_8BIT_SIZE, import_bitsandbytes

        bnb = import_bitsandbytes()
        return bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_SIZE, **hyper)
    return torch.optim.AdamW(groups, fused=_fused_supported(model), **hyper)


class PlainTrainable(Trainable):
    """Plain PyTorch: every model state on `device`, `torch.optim.AdamW` (or bitsandbytes'
    8-bit AdamW: config `optimizer`)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
    ):
        model = model.to(device)
        model.train()
        super().__init__(model, device, autocast_dtype, cfg.memory.chunked_loss_tokens)
        self.apply_activation_knobs(cfg)
        self.optimizer = plain_optimizer(model, cfg)
        self.optimizer_choice = cfg.optimizer
        self.scaler = torch.amp.GradScaler(device.type) if autocast_dtype == torch.float16 else None

    def backward(self, loss: torch.Tensor, last: bool = False, may_step: bool = True) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    @property
    def skips_overflow(self) -> bool:
        return self.scaler is not None

    def skip_step(self) -> None:
        if self.scaler is not None:
            self.scaler.update()  # ends the step that unscale_ began (and lowers the scale)
        super().skip_step()

    def extra_state(self) -> dict[str, Any]:
        return {"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if self.scaler is not None:
            if "grad_scaler" in state:
                self.scaler.load_state_dict(state["grad_scaler"])
            else:
                warn_once(
                    "the checkpoint has no GradScaler state (not an fp16 run): a new one starts"
                )

    def clip_grad_norm(self, max_norm: float | None) -> float | None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm is None:
            if self.scaler is not None:
                return None
            grads = [p.grad for p in params]
            return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        return {name: params[name].detach() for name in self.names}

    def optimizer_state(self, copy: bool = True) -> dict:
        from protrain.optim.adamw_8bit import plain_state_dict

        return plain_state_dict(self.optimizer)  # bitsandbytes' state flat, for checkpoints

    def load_optimizer_state(self, state: dict) -> None:
        from protrain.optim.adamw_8bit import check_saved_optimizer

        check_saved_optimizer(state, ENGINE_OPTIMIZERS[self.optimizer_choice])
        self.optimizer.load_state_dict({k: v for k, v in state.items() if k != "optimizer"})

    @torch.no_grad()
    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self._check_state_names(state)
        params = dict(self.model.named_parameters())
        for name in self.names:
            params[name].copy_(state[name])

    def export_model(self) -> nn.Module:
        self.remove_activation_policies()
        return self.model


class EngineTrainable(Trainable):
    """The chunked engine: `protrain.wrap` places parameters, gradients and optimizer states."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        several_ranks: bool = False,
    ):
        model.train()
        # The engine computes in `compute_dtype` itself: no autocast.
        super().__init__(model, device, None, cfg.memory.chunked_loss_tokens)
        mem = cfg.memory
        # the activation knobs are applied by the trainable (apply_activation_knobs, below)
        knobs = replace(mem.knobs(), n_swap=None, n_checkpoint=None, offload_checkpoint=False,
                        tiled_mlp_tokens=None)  # fmt: skip
        if not several_ranks:  # the mode is read with several ranks only
            knobs = replace(knobs, distributed_mode=None)
        self._several_ranks = several_ranks
        try:
            self.model, self.optimizer, self.layout = protrain_wrap(
                model,
                knobs,
                device=device,
                compute_dtype=autocast_dtype or torch.float32,
                optim=engine_optimizer(model, cfg),
                # Several ranks (torchrun): each rank's loss is already divided by the tokens
                # of the whole global batch, so the engine sums gradients over ranks.
                grad_reduce="sum" if several_ranks else "mean",
            )
        except ValueError as exc:  # a knob that cannot work for this model
            raise ConfigError(f"memory: {exc}") from None
        self._closed = False
        self._choose_step_mode(cfg)
        logger.info("memory layout:\n%s", self.layout)
        self.apply_activation_knobs(cfg)

    def _choose_step_mode(self, cfg: TrainConfig) -> None:
        # Without clipping or fp16 loss scaling, offloaded chunks start their AdamW inside
        # the last backward of each step (HybridAdamW.step_in_backward; same arithmetic).
        # Not under nonfinite.policy: skip: see [Note: non-finite steps] in nonfinite.py.
        self._step_in_backward = (
            cfg.max_grad_norm is None
            and not self.optimizer.scaler.enabled
            and cfg.nonfinite.policy == "stop"
        )
        self._armed = False

    def backward(self, loss: torch.Tensor, last: bool = False, may_step: bool = True) -> None:
        if last and may_step and self._step_in_backward:
            self.optimizer.step_in_backward()
            self._armed = True
        # fp16: times the engine's dynamic loss scale, which clip and step divide out again
        self.optimizer.scale_loss(loss).backward()

    @property
    def skips_overflow(self) -> bool:
        return self.optimizer.scaler.enabled

    def clip_grad_norm(self, max_norm: float | None) -> float | None:
        if max_norm is not None:
            return float(self.optimizer.clip_grad_norm_(max_norm))
        if self._armed:
            return self._armed_grad_norm()
        if self.optimizer.scaler.enabled:
            return None
        return float(self.optimizer.grad_norm())  # the norm without clipping

    def _armed_grad_norm(self) -> float:
        """The global gradient norm after a backward armed by `step_in_backward` (over every
        rank: a collective), from the per-tensor norms the gradient sink took."""
        return float(self.optimizer.grad_norm())

    def skip_step(self) -> None:
        self.optimizer.synchronize()  # no accumulation still writes a gradient being dropped
        self.optimizer.zero_grad()

    def optimizer_step(self) -> None:
        self._armed = False
        self.optimizer.step()
        self.optimizer.zero_grad()

    def model_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        import protrain

        # only the trainable names: an adapter's save reads nothing of the frozen base
        state = protrain.state_dict(self.model, copy=copy, names=self.names)
        return {name: state[name] for name in self.names}

    def optimizer_state(self, copy: bool = True) -> dict:
        return self.optimizer.state_dict(copy=copy)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        import protrain

        self._check_state_names(state)
        protrain.load_state_dict(self.model, state, strict=False)

    def export_model(self) -> nn.Module:
        """Close the engine: the model becomes a plain module holding the trained weights."""
        self.close()
        return self.model

    def full_tensor(self, name: str) -> torch.Tensor:
        import protrain

        return protrain.full_tensor(self.model, name)

    def own_trainable_values(self) -> dict[str, torch.Tensor]:
        import protrain

        return protrain.own_values(self.model, self.names)

    def close(self, keep_weights: bool = True) -> None:
        import protrain

        self.remove_activation_policies()
        if not self._closed:
            protrain.close(self.model, keep_weights=keep_weights)
            self._closed = True


# the engine's copy counters the plan check reads, in MeasuredCopies' order
_COPY_COUNTERS = ("h2d_bytes", "h2d_s", "d2h_bytes", "d2h_s", "copy_busy_s", "wait_copy_s")


class AutoTrainable(EngineTrainable):
    """`memory: {auto: true}`: the planner profiles one step of the real model at the first
    micro-batch, searches the fastest knobs that fit `gpu_budget` (the ones the user set are
    kept) and the engine runs the plan. After the first steps the measured peak and step
    time are checked against the prediction; a plan that would pass the budget, or one much
    slower than predicted where the measured rates make another clearly faster, is replaced
    in place (model and optimizer state carried over exactly).

    [Note: what is measured]
    The planner predicts one micro-batch's forward and backward plus the optimizer step,
    the waits for the previous step's host updates included. The measured step is the
    whole optimizer step, from its first forward to the end of `optimizer_step`, less the
    micro-batches before the last, each counted as long as the last one's forward and
    backward (they wait for no host update; the first micro-batch's forward is where the
    waits land). The step compared is the median of the steady steps: the
    `WARMUP_STEPS` after the plan was applied are left out ([Note: steady-state steps] in
    `plan/closed_loop.py`), and the engine's host-optimizer counters are read over the same
    steps (the host work of the last warm-up step finished before, of the last step
    counted after), and so are its copy counters (bytes and seconds of the host-device
    copies each way, the link's busy time, the compute stream's waits for gathers;
    ``chunks/copy_times.py``), per micro-batch, as the model predicts one. The peak is the
    allocator's reserved peak on CUDA; on the CPU, the engine's device-side tensor bytes
    (what the planner's CPU accounting counts) over the first two optimizer steps (the
    first creates the optimizer state, the second runs with it), counted from the freshly
    applied plan as `protrain.profile.measure` does.
    """

    # The first step creates the optimizer state and touches its host pages, the allocator
    # grows to its peak; the second is the first with the state in place but still pays the
    # CPU peak counter (PEAK_STEPS) and the allocator's last growth. From the third on the
    # steps repeat.
    WARMUP_STEPS = 2
    STEADY_STEPS = 3  # a median of three: one outlier does not move it
    CHECK_AFTER_STEPS = WARMUP_STEPS + STEADY_STEPS
    PEAK_STEPS = 2  # CPU: counted steps (the second is the first with optimizer state)

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        sample_batch: dict[str, torch.Tensor],
        several_ranks: bool = False,
    ):
        model.train()
        Trainable.__init__(self, model, device, None, cfg.memory.chunked_loss_tokens)
        # Several ranks: one plan for all, made on the first (plan_memory); the check after
        # the first steps compares the largest peak and step of any rank, decided there too.
        self._several_ranks = several_ranks
        self.cfg = cfg
        self.settings = PlanSettings.from_config(cfg, device, autocast_dtype)
        self.plan, self.problem = plan_memory(model, sample_batch, self.settings)
        logger.info("memory plan:\n%s", self.plan)
        # the loss chunk the plan was made for (searched unless memory.chunked_loss_tokens)
        self.chunked_loss_tokens = loss_chunk_of(self.plan, self.settings)
        self._closed = True
        self._apply(self.plan)
        self._checked = False
        self._peak_counter = None  # CPU: the tensor-bytes counter over the first steps
        self._measured_peak_bytes = 0
        self._micro = 0  # micro-batches of the current optimizer step so far
        self._steps_run = 0
        # this optimizer step's times: first forward begun, last forward begun, last
        # backward ended ([Note: what is measured])
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._t_last_backward: float | None = None
        self._step_times: list[float] = []  # the steady steps' ([Note: what is measured])
        self._last_step_s = 0.0
        self._stats_after_warmup: dict | None = None  # the engine's counters then

    def _apply(self, plan) -> None:
        cfg = self.cfg
        try:
            self.model, self.optimizer, self.layout, self.activations = apply_plan(
                self.model,
                plan,
                self.settings.request.knobs,
                device=self.device,
                compute_dtype=self.settings.compute_dtype,
                optim=engine_optimizer(self.model, cfg),
                # the loss is divided by the whole global batch's tokens (train/ranks.py)
                grad_reduce="sum" if self._several_ranks else "mean",
            )
        except ValueError as exc:
            raise ConfigError(f"memory: {exc}") from None
        self._closed = False
        self._choose_step_mode(cfg)
        logger.info("memory layout:\n%s", self.layout)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def forward_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if torch.is_grad_enabled() and not self._checked:  # training, not evaluation
            self._micro += 1
            if self._steps_run == 0 and self._micro == 1 and self.device.type != "cuda":
                self._start_peak_counter()
            if self._micro == 1:
                self._t_first = self._now()
            if self._micro == self.cfg.gradient_accumulation_steps:
                self._t_last = self._t_first if self._micro == 1 else self._now()
        return super().forward_loss_sum(batch)

    def backward(self, loss: torch.Tensor, last: bool = False, may_step: bool = True) -> None:
        super().backward(loss, last, may_step)
        if last and self._t_last is not None:
            self._t_last_backward = self._now()

    def optimizer_step(self) -> None:
        super().optimizer_step()
        if self._t_last_backward is None:
            return
        # the whole optimizer step less the micro-batches before the last, each taken to
        # last as long as the last one (which waits for no host update); never below an
        # even share of the whole (micro-batches of uneven length)
        micro_s = self._t_last_backward - self._t_last
        whole_s = self._now() - self._t_first
        step_s = max(whole_s - (self._micro - 1) * micro_s, whole_s / self._micro)
        self._reset_step_times()
        self._steps_run += 1
        # Timed: steps after the warm-up that ran without the CPU counter's overhead.
        if self._steps_run > self.WARMUP_STEPS and self._peak_counter is None:
            self._step_times.append(step_s)
        self._last_step_s = step_s
        if self._steps_run == self.PEAK_STEPS:
            self._stop_peak_counter()
        if self._steps_run == self.WARMUP_STEPS:  # the host work of the warm-up is done
            self._stats_after_warmup = self._settled_stats()

    def skip_step(self) -> None:
        super().skip_step()
        self._reset_step_times()  # a skipped step is not timed

    def _reset_step_times(self) -> None:
        self._t_first = self._t_last = self._t_last_backward = None
        self._micro = 0

    def check_plan(self, step: int, total_steps: int) -> dict[str, Any] | None:
        from protrain.distributed import resolve_context
        from protrain.distributed.agree import max_over_ranks, on_main
        from protrain.plan import NoPlanFits, check_plan
        from protrain.plan.closed_loop import MeasuredCopies

        if self._checked or self._steps_run == 0:
            return None
        if self._steps_run < self.CHECK_AFTER_STEPS and step < total_steps:
            return None
        self._checked = True
        self._stop_peak_counter()
        steady = bool(self._step_times)
        measured_step_s = statistics.median(self._step_times) if steady else self._last_step_s
        host_adam_s = wait_s = -1.0  # not measured
        copies = [-1.0] * len(_COPY_COUNTERS)
        if self._stats_after_warmup is not None and self._steps_run > self.WARMUP_STEPS:
            # the last step's host work and copies are counted too
            before, now = self._stats_after_warmup, self._settled_stats()
            n = self._steps_run - self.WARMUP_STEPS

            def per_step(key: str) -> float:
                return (now.get(key, 0.0) - before.get(key, 0.0)) / n

            host_adam_s = per_step("host_adam_s")
            wait_s = per_step("wait_cpu_optimizer_s")
            micro = self.cfg.gradient_accumulation_steps
            copies = [per_step(key) / micro for key in _COPY_COUNTERS]
        cuda = self.device.type == "cuda"
        measured_peak = (
            torch.cuda.max_memory_reserved(self.device) if cuda else self._measured_peak_bytes
        )
        allocated = torch.cuda.max_memory_allocated(self.device) if cuda else -1
        ctx = resolve_context()
        # every rank runs the plan: the largest of each is what must fit, the slowest rank's
        # step and host optimizer what the plan is judged by
        measured = max_over_ranks(
            ctx,
            [measured_peak, allocated, measured_step_s, host_adam_s, wait_s, *copies],
            self.device,
        )
        measured_peak, allocated = int(measured[0]), int(measured[1])
        measured_step_s = measured[2]
        host_adam_s, wait_s = (v if v >= 0 else None for v in measured[3:5])
        copies = measured[5:]
        measured_copies = MeasuredCopies(*copies) if min(copies) >= 0 else None
        record = {
            "plan_predicted_peak_gib": self.plan.predicted_peak_bytes / 2**30,
            "plan_measured_peak_gib": measured_peak / 2**30,
            "plan_predicted_step_s": self.plan.predicted_step_s,
            "plan_measured_step_s": measured_step_s,
            "plan_warmup_steps": self.WARMUP_STEPS,
            "plan_steady_steps": len(self._step_times),
        }
        if host_adam_s is not None:
            record["plan_measured_host_adam_s"] = host_adam_s
        if wait_s is not None:
            record["plan_measured_wait_host_optimizer_s"] = wait_s
        if measured_copies is not None:
            for key, value in zip(_COPY_COUNTERS, copies):
                record[f"plan_measured_{key}"] = value

        def check_here():
            return check_plan(self.plan, self.problem, measured_peak_bytes=measured_peak,
                              measured_step_s=measured_step_s,
                              measured_allocated_bytes=allocated if cuda else None,
                              measured_host_adam_s=host_adam_s,
                              measured_wait_host_optimizer_s=wait_s,
                              measured_copies=measured_copies,
                              steady=steady)  # fmt: skip

        try:
            check = on_main(ctx, check_here)  # the first rank holds the problem and decides
        except NoPlanFits as exc:
            from protrain.train.planning import no_plan_fits_message

            message = no_plan_fits_message(exc, self.settings)
            raise ConfigError(f"after the first steps, with the measured peak: {message}") from None
        if check.corrected_step_s is not None:
            record["plan_corrected_step_s"] = check.corrected_step_s
            for name, (_, rate) in check.corrected_rates.items():
                record[f"plan_corrected_{name}"] = rate
            if check.measured_compute_s is not None:
                record["plan_measured_compute_s"] = check.measured_compute_s
            if check.compute_scale is not None:
                record["plan_compute_scale"] = check.compute_scale
        if check.corrected is not None:
            self.replan(check.corrected)
            record["plan_corrected"] = True
            record["plan_correction"] = check.reason
        return record

    def _settled_stats(self) -> dict:
        """The engine's counters with every host task and copy so far counted in (a
        synchronization: between steps only)."""
        self.optimizer.synchronize()
        self.model._protrain_engine.manager.settle_counters()
        return dict(self.optimizer.stats)

    def replan(self, plan) -> None:
        """Run `plan` from here on: the model and optimizer state move over exactly."""
        import protrain
        from protrain.train.planning import loss_chunk_of

        model_state = protrain.state_dict(self.model)
        optimizer_state = self.optimizer.state_dict()
        self.close()
        self._apply(plan)
        protrain.load_state_dict(self.model, model_state)
        self.optimizer.load_state_dict(optimizer_state)
        self.plan = plan
        self.chunked_loss_tokens = loss_chunk_of(plan, self.settings)
        logger.info("memory plan, corrected:\n%s", plan)

    def close(self, keep_weights: bool = True) -> None:
        self._stop_peak_counter()
        super().close(keep_weights)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _start_peak_counter(self) -> None:
        from protrain.profile.measure import engine_static_device_bytes
        from protrain.profile.memory_clock import TensorBytesCounter

        manager = self.model._protrain_engine.manager
        static = engine_static_device_bytes(self.model)
        chunk = manager.layout.chunk_size_bytes
        peak = [0]

        def sample(counter: TensorBytesCounter) -> None:
            peak[0] = max(peak[0], static + counter.live_bytes + len(manager.resident) * chunk)

        self._peak_counter = (TensorBytesCounter(on_op=sample), peak)
        self._peak_counter[0].__enter__()

    def _stop_peak_counter(self) -> None:
        if self._peak_counter is not None:
            counter, peak = self._peak_counter
            self._peak_counter = None
            counter.__exit__(None, None, None)
            self._measured_peak_bytes = peak[0]


def check_chunked_loss_supported(model: nn.Module) -> None:
    """Refuse `memory.chunked_loss_tokens` where the model's logits are not a known
    transform of its output embedding's output (see `causal_lm_head`)."""
    from protrain.activations import UnsupportedHead, causal_lm_head

    causal_lm = unwrap_causal_lm(model)
    model_type = getattr(getattr(causal_lm, "config", None), "model_type", None)
    try:
        causal_lm_head(causal_lm)
    except UnsupportedHead as exc:
        raise ConfigError(
            f"memory.chunked_loss_tokens is not allowed for model type {model_type!r}: the "
            f"chunked loss cannot reproduce its logits ({exc}); unset it"
        ) from None


def _fused_supported(model: nn.Module) -> bool | None:
    # Fused AdamW runs on CUDA and on the CPU (torch >= 2.4) for floating-point params.
    return (
        True if all(p.is_floating_point() for p in model.parameters() if p.requires_grad) else None
    )
