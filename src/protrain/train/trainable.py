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
from dataclasses import replace
from typing import Any

import torch
from torch import nn

import protrain
from protrain.activations import UnsupportedHead, apply_activation_knobs, causal_lm_head
from protrain.knobs import OptimizerSettings
from protrain.optim.adamw_8bit import (
    MIN_8BIT_SIZE,
    check_saved_optimizer,
    import_bitsandbytes,
    plain_state_dict,
)
from protrain.optim.state_format import check_saved_format
from protrain.plan import NoPlanFits, Plan
from protrain.planned_wrap import apply_plan
from protrain.planned_wrap import wrap as protrain_wrap
from protrain.train.config import ENGINE_OPTIMIZERS, TrainConfig
from protrain.train.errors import ConfigError, PlanRefusedError
from protrain.train.log import logger, warn_once
from protrain.train.loss import loss_sum, unwrap_causal_lm
from protrain.train.plan_checker import PlanChecker
from protrain.train.planning import (
    PlanSettings,
    loss_chunk_of,
    no_plan_fits_message,
    plan_memory,
)


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
        """Load what `optimizer_state` returned (another host-moment format refused: the
        chunked engine's compact moments read as fp32 ones would be garbage)."""
        check_saved_format(state, getattr(self.optimizer, "state_format", "fp32"), "run")
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
        return plain_state_dict(self.optimizer)  # bitsandbytes' state flat, for checkpoints

    def load_optimizer_state(self, state: dict) -> None:
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
        self.cfg = cfg
        # Several ranks (torchrun): each rank's loss is already divided by the tokens of the
        # whole global batch, so the engine sums gradients over ranks.
        self._several_ranks = several_ranks
        self._closed = True
        self._place(autocast_dtype or torch.float32)

    def _place(self, compute_dtype: torch.dtype) -> None:
        """Wrap the model with the config's knobs (the activation knobs are applied by the
        trainable, after)."""
        cfg = self.cfg
        knobs = replace(cfg.memory.knobs(), n_swap=None, n_checkpoint=None,
                        offload_checkpoint=False, tiled_mlp_tokens=None)  # fmt: skip
        if not self._several_ranks:  # the mode is read with several ranks only
            knobs = replace(knobs, distributed_mode=None)
        try:
            self.model, self.optimizer, self.layout = protrain_wrap(
                self.model,
                knobs,
                device=self.device,
                compute_dtype=compute_dtype,
                optim=engine_optimizer(self.model, cfg),
                grad_reduce="sum" if self._several_ranks else "mean",
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
        # only the trainable names: an adapter's save reads nothing of the frozen base
        state = protrain.state_dict(self.model, copy=copy, names=self.names)
        return {name: state[name] for name in self.names}

    def optimizer_state(self, copy: bool = True) -> dict:
        return self.optimizer.state_dict(copy=copy)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self._check_state_names(state)
        protrain.load_state_dict(self.model, state, strict=False)

    def export_model(self) -> nn.Module:
        """Close the engine: the model becomes a plain module holding the trained weights."""
        self.close()
        return self.model

    def full_tensor(self, name: str) -> torch.Tensor:
        return protrain.full_tensor(self.model, name)

    def own_trainable_values(self) -> dict[str, torch.Tensor]:
        return protrain.own_values(self.model, self.names)

    def close(self, keep_weights: bool = True) -> None:
        self.remove_activation_policies()
        if not self._closed:
            protrain.close(self.model, keep_weights=keep_weights)
            self._closed = True


class AutoTrainable(EngineTrainable):
    """`memory: {auto: true}`: the planner profiles one step of the real model at the first
    micro-batch, searches the fastest knobs that fit `gpu_budget` (the ones the user set are
    kept) and the engine runs the plan. After the first steps the measured peak and step
    time are checked against the prediction (a :class:`PlanChecker`; [Note: what is
    measured] there); a plan that would pass the budget, or one much slower than predicted
    where the measured rates make another clearly faster, is replaced in place (model and
    optimizer state carried over exactly).

    Several ranks: one plan for all, made on the first (plan_memory); the check after the
    first steps compares the largest peak and step of any rank, decided there too.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        sample_batch: dict[str, torch.Tensor],
        several_ranks: bool = False,
    ):
        self.settings = PlanSettings.from_config(cfg, device, autocast_dtype)
        self._sample_batch = sample_batch  # planned on by `_place`, in the parent's __init__
        super().__init__(model, cfg, device, autocast_dtype, several_ranks)
        self._sample_batch = None
        self.checker = PlanChecker(device, cfg.gradient_accumulation_steps)

    def _place(self, compute_dtype: torch.dtype) -> None:
        """Plan at the sample batch, then run the plan."""
        self.plan, self.problem = plan_memory(self.model, self._sample_batch, self.settings)
        logger.info("memory plan:\n%s", self.plan)
        # the loss chunk the plan was made for (searched unless memory.chunked_loss_tokens)
        self.chunked_loss_tokens = loss_chunk_of(self.plan, self.settings)
        self._apply(self.plan)

    def _apply(self, plan: Plan) -> None:
        try:
            self.model, self.optimizer, self.layout, self.activations = apply_plan(
                self.model,
                plan,
                self.settings.request.knobs,
                device=self.device,
                compute_dtype=self.settings.compute_dtype,
                optim=engine_optimizer(self.model, self.cfg),
                grad_reduce="sum" if self._several_ranks else "mean",
            )
        except ValueError as exc:
            raise ConfigError(f"memory: {exc}") from None
        self._closed = False
        self._choose_step_mode(self.cfg)
        logger.info("memory layout:\n%s", self.layout)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def forward_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if torch.is_grad_enabled():  # training, not evaluation
            self.checker.micro_batch_begun(self.model._protrain_engine)
        return super().forward_loss_sum(batch)

    def backward(self, loss: torch.Tensor, last: bool = False, may_step: bool = True) -> None:
        super().backward(loss, last, may_step)
        self.checker.backward_ended(last)

    def optimizer_step(self) -> None:
        super().optimizer_step()
        self.checker.step_ended(self.model._protrain_engine)

    def skip_step(self) -> None:
        super().skip_step()
        self.checker.step_skipped()  # a skipped step is not timed

    def check_plan(self, step: int, total_steps: int) -> dict[str, Any] | None:
        if not self.checker.due(step, total_steps):
            return None
        engine = self.model._protrain_engine
        last = step >= total_steps  # nothing left to protect: the check is only recorded
        try:
            record, check = self.checker.check(engine, self.plan, self.problem)
        except NoPlanFits as exc:
            message = no_plan_fits_message(exc, self.settings)
            if last:  # the run's steps are done: they are saved and exported all the same
                logger.warning("memory plan check after the last step: %s", message)
                return {"plan_check": "no plan fits the measured peak", "plan_corrected": False}
            raise PlanRefusedError(
                f"after the first steps, with the measured peak: {message}"
            ) from None
        if check.corrected is not None and not last:
            self.replan(check.corrected)
            record["plan_corrected"] = True
            record["plan_correction"] = check.reason
        elif check.corrected is not None:
            record["plan_correction"] = f"{check.reason} (after the last step: not applied)"
        return record

    def replan(self, plan: Plan) -> None:
        """Run `plan` from here on: the model and optimizer state move over exactly."""
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
        self.checker.stop_peak_counter()
        super().close(keep_weights)


def check_chunked_loss_supported(model: nn.Module) -> None:
    """Refuse `memory.chunked_loss_tokens` where the model's logits are not a known
    transform of its output embedding's output (see `causal_lm_head`)."""
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
