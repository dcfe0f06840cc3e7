"""``ProTrainTrainer``: the Hugging Face ``Trainer`` training with ProTrain's engine.

The Trainer keeps its loop (data, gradient accumulation and loss normalization, LR
schedule, logging, evaluation, checkpoints); the engine places the model states. What
changes, and through which hook:

- ``__init__``: the model is wrapped (``protrain.wrap``) before ``Trainer.__init__``, so the
  Trainer's own ``model.to(args.device)`` finds every parameter already a view of device
  storage (what ``wrap`` itself does) and never holds the whole model on the device. The
  optimizer is the engine's ``HybridAdamW`` with the Trainer's parameter groups and AdamW
  hyperparameters (``create_optimizer`` returns it).
- ``get_train_dataloader``: with ``ProTrainConfig.gpu_budget`` the wrap waits for the
  Trainer's training loader, whose dataset and collator give the planner's sample, the
  heaviest micro-batch (``planning.py``); the Trainer leaves the model where it is until
  then (``TrainingArguments.place_model_on_device``).
- Clipping: ``args.max_grad_norm`` is the engine's (``EngineStepCallback`` clips through the
  engine's optimizer in ``on_pre_optimizer_step``); the Trainer gets a copy of the arguments
  with ``max_grad_norm=0``, so that its own ``clip_grad_norm_``, which reads ``param.grad``
  (always None here: gradients live in chunks), never runs. ``log`` reports the engine's
  norm as ``grad_norm``.
- ``training_step``: without clipping, arms ``step_in_backward`` before the last
  micro-batch of each step (``accelerator.sync_gradients``), then runs the Trainer's own
  step (its loss scaling for accumulation, its ``backward``).
- ``save_model``: gathered weights into a normal HF / PEFT directory; a checkpoint also gets
  the fp32 masters (``checkpoint.py``). The optimizer state goes through the Trainer's own
  ``optimizer.state_dict()`` / ``load_state_dict``.
- ``_load_from_checkpoint`` (private, the only one): see [Note: the private hook].

[Note: the private hook]
``Trainer.train(resume_from_checkpoint=...)`` loads the model's weights with
``self._load_from_checkpoint(path)``, which calls ``model.load_state_dict`` (or PEFT's
``load_adapter``): on a wrapped model that writes into chunk views (offloaded ones are not
even resident) and never reaches the fp32 masters. No public method of the Trainer runs
between that load and the training loop with the checkpoint's path, so the load itself is
replaced: the engine's masters are read from the checkpoint with
``protrain.load_state_dict``. Checked against transformers 5.24.0 (constraints.txt):
``train`` calls ``_load_from_checkpoint(resume_from_checkpoint)`` before the loop when
neither DeepSpeed, FSDP nor SageMaker MP runs (the first two are refused here, the third
needs several processes, also refused); the signature is
checked at construction and the resume is tested (tests/integrations/test_hf_trainer.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import warnings
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainingArguments

import protrain
from protrain.integrations.transformers.arguments import (
    TakenOver,
    take_over,
    trainer_arguments,
    with_taken_over,
)
from protrain.integrations.transformers.callback import EngineStepCallback
from protrain.integrations.transformers.checkpoint import load_engine_state, save_engine_state
from protrain.integrations.transformers.config import ProTrainConfig
from protrain.integrations.transformers.export import save_pretrained_gathered
from protrain.integrations.transformers.planning import planning_batch, rng_devices
from protrain.knobs import OptimizerSettings
from protrain.optim.hybrid_adamw import HybridAdamW

TESTED_TRANSFORMERS = "5.24.0"
TRAINING_ARGS_NAME = "training_args.bin"  # transformers.trainer's name for it
log = logging.getLogger(__name__)


class ProTrainTrainer(Trainer):
    """``transformers.Trainer`` whose model and optimizer are ProTrain's engine.

    Use as ``Trainer``, with the engine's knobs in ``protrain_config``::

        trainer = ProTrainTrainer(model=model, args=args, train_dataset=ds,
                                  protrain_config=ProTrainConfig(n_persist=2))
        trainer.train()
        trainer.save_model("out")  # a normal HF / PEFT directory

    The optimizer is the engine's AdamW with the Trainer's weight-decay groups (``args.optim``
    adamw_torch / adamw_torch_fused, or an 8-bit AdamW name for its 8-bit state); ``args.bf16``
    is the engine's compute dtype and ``args.gradient_checkpointing`` its activation policy
    (``arguments.py``: what is taken over, what is refused).
    ``trainer.max_grad_norm`` is the clipping the engine applies (``args.max_grad_norm``; the
    Trainer's copy of the arguments reads 0). ``close()`` gives the engine back and returns
    the plain model with the trained weights.
    """

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        *,
        protrain_config: ProTrainConfig | None = None,
        **trainer_kwargs: Any,
    ):
        # A subclass whose parent builds the model before calling this (TRL's SFTTrainer) sets
        # protrain_config on the instance first: see sft.py.
        if protrain_config is None:
            protrain_config = getattr(self, "protrain_config", None)
        config = protrain_config if protrain_config is not None else ProTrainConfig()
        taken = check_arguments(args, config, trainer_kwargs)
        _check_supported(model)
        _check_private_hook()
        self.protrain_config = with_taken_over(config, taken, model)
        self._optimizer_name = taken.optimizer
        self.max_grad_norm = args.max_grad_norm if args.max_grad_norm > 0 else None
        self._saved_args = args  # what training_args.bin holds: the caller's arguments
        args = trainer_arguments(args)  # the caller's arguments stay as they were

        named = list(model.named_parameters())
        self._param_dtypes = {name: p.dtype for name, p in named}
        self._trainable_names = [name for name, p in named if p.requires_grad]
        self._step_in_backward = config.step_in_backward and self.max_grad_norm is None
        self.engine_optimizer: HybridAdamW | None = None
        self.layout = None
        self.plan = None  # the protrain.plan.Plan, when ProTrainConfig.gpu_budget chose the knobs
        self._resume_dir: str | None = None  # a checkpoint to load once the model is wrapped
        self.engine_step = EngineStepCallback(None, self.max_grad_norm)
        model.train()
        if config.planned:
            # Wrapped once the loader exists (get_train_dataloader); until then the model stays
            # where it is: TrainingArguments.place_model_on_device is the Trainer's public
            # switch for integrations that place the model themselves.
            args.__class__ = _unplaced(type(args))
        else:
            self._wrap(model, args, sample_batch=None)
        try:
            super().__init__(model=model, args=args, **trainer_kwargs)
        except BaseException:
            if self.engine_optimizer is not None:
                protrain.close(model)
            raise
        self.add_callback(self.engine_step)

    @property
    def wrapped(self) -> bool:
        """Whether the model is in the engine (with a budget: once training has begun)."""
        return self.engine_optimizer is not None

    def _wrap(self, model: nn.Module, args: TrainingArguments, sample_batch: dict | None) -> None:
        """``protrain.wrap`` with the Trainer's optimizer settings; with a ``sample_batch``,
        the knobs left None are planned for ``ProTrainConfig.gpu_budget``."""
        config = self.protrain_config
        request = None
        if sample_batch is not None and config.planned:
            # the host optimizer's schedule the run uses (inside backward or after it)
            request = config.plan_request(
                sample_batch, clipping=not self._step_in_backward, optimizer=self._optimizer_name
            )
        optim = OptimizerSettings(
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            param_groups=_param_groups(model, self.get_decay_parameter_names(model), args),
            optimizer=self._optimizer_name,
            host_threads=config.host_threads,
        )
        device = torch.device(args.device)
        with torch.random.fork_rng(devices=rng_devices(device)):  # the trace's dropout
            model, self.engine_optimizer, self.layout = protrain.wrap(
                model,
                None if request is not None else config.knobs(),
                request=request,
                optim=optim,
                device=device,
                compute_dtype=config.compute_dtype,
            )
        self.engine_step.optimizer = self.engine_optimizer
        self.plan = protrain.plan_of(model)
        if self.plan is not None:
            log.info("protrain memory plan for the planning micro-batch %s:\n%s",
                     _shape(sample_batch), self.plan)  # fmt: skip

    def get_train_dataloader(self) -> DataLoader:
        """The Trainer's loader; with ``ProTrainConfig.gpu_budget``, the model is wrapped here
        under the plan for the heaviest micro-batch of the loader's dataset and collator
        (``planning.py``), before the Trainer creates the optimizer."""
        loader = super().get_train_dataloader()
        if not self.wrapped:
            batch = planning_batch(
                loader,
                torch.device(self.args.device),
                self.protrain_config,
                micro_batch_size=self.args.per_device_train_batch_size,
            )
            self._wrap(self.model, self.args, sample_batch=batch)
            if self._resume_dir is not None:
                load_engine_state(self.model, self._trainable_names, self._resume_dir)
                self._resume_dir = None
        return loader

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._wrap_before("evaluate()")
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any):
        self._wrap_before("predict()")
        return super().predict(*args, **kwargs)

    def _wrap_before(self, what: str) -> None:
        """With ``ProTrainConfig.gpu_budget``, the plan and wrap ``train()`` makes, made now:
        unwrapped, the Trainer's evaluation would place the whole model on the device."""
        if self.wrapped:
            return
        if self.train_dataset is None:
            raise ValueError(
                f"ProTrainTrainer: {what} before train() with ProTrainConfig.gpu_budget plans "
                "from the training data, and this trainer has no train_dataset: pass one, or "
                "fix the knobs (n_persist, n_buffer) without a budget"
            )
        self.get_train_dataloader()  # plans for its heaviest micro-batch and wraps

    # ---- optimizer and step -------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The engine's optimizer (built at wrap time, with the Trainer's groups)."""
        if not self.wrapped:
            raise RuntimeError(
                "ProTrainTrainer: with ProTrainConfig.gpu_budget the engine's optimizer exists "
                "once train() has planned from the training data"
            )
        self.optimizer = self.engine_optimizer
        return self.optimizer

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        # The last micro-batch of a step (the Trainer sets sync_gradients before it) starts
        # offloaded updates inside its backward when nothing clips.
        if self._step_in_backward and model.training and self.accelerator.sync_gradients:
            self.engine_optimizer.step_in_backward()
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The Trainer's own norm read param.grad, which the engine leaves empty.
        if "grad_norm" in logs and self.engine_step.last_grad_norm is not None:
            logs["grad_norm"] = self.engine_step.last_grad_norm
        super().log(logs, start_time)

    # ---- saving and resuming ------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A normal HF / PEFT directory with the engine's weights (``from_pretrained`` loads
        it); a checkpoint (``_internal_call``, from the Trainer) also holds the fp32 masters
        that an exact resume reads."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.wrapped:  # a budget and no training yet: the plain model, as it is
            return super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            save_pretrained_gathered(self.model, output_dir, self._param_dtypes)
            if _internal_call:
                save_engine_state(self.model, self._trainable_names, output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self._saved_args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None):
        # Private: see [Note: the private hook]. With a budget the model is wrapped later, in
        # get_train_dataloader, which loads the checkpoint then.
        if self.wrapped:
            load_engine_state(self.model, self._trainable_names, resume_from_checkpoint)
        else:
            self._resume_dir = resume_from_checkpoint

    def close(self) -> nn.Module:
        """Give back the engine's memory, threads and hooks; return the plain model, each
        parameter holding its trained value in its own dtype."""
        if not self.wrapped:
            return self.model
        return protrain.close(self.model)


def _shape(batch: dict | None) -> str:
    ids = batch.get("input_ids") if batch else None
    return "x".join(map(str, ids.shape)) if torch.is_tensor(ids) else ""


@functools.cache
def _unplaced(args_cls: type) -> type:
    """``args_cls`` whose ``place_model_on_device`` is False (the property's documented use:
    "can be subclassed and overridden for some specific integrations"). Defined once per
    class, under this module, so that it pickles."""
    name = f"Unplaced{args_cls.__name__}"
    sub = type(name, (args_cls,), {"place_model_on_device": property(lambda self: False),
                                   "__module__": __name__})  # fmt: skip
    globals()[name] = sub
    return sub


def _param_groups(model: nn.Module, decay_names: list[str], args: TrainingArguments) -> list[dict]:
    """The Trainer's groups (``Trainer.create_optimizer``): weight decay on ``decay_names``,
    none on the rest; trainable parameters only, empty groups left out."""
    decay = set(decay_names)
    groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and n in decay],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and n not in decay],
         "weight_decay": 0.0},
    ]  # fmt: skip
    return [g for g in groups if g["params"]]


def check_arguments(
    args: TrainingArguments,
    config: ProTrainConfig,
    kwargs: dict[str, Any],
    who: str = "ProTrainTrainer",
) -> TakenOver:
    """Refuse, in one line and before any work (wrapping, TRL's tokenization), what the
    engine cannot run under the Trainer; the rest is what it takes over (``arguments.py``)."""
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"{who} needs TrainingArguments (args=...)")
    if kwargs.get("model_init") is not None:
        raise ValueError(f"{who}: model_init is not supported; pass the model")
    optimizers = kwargs.get("optimizers", (None, None))
    if optimizers[0] is not None or kwargs.get("optimizer_cls_and_kwargs") is not None:
        raise ValueError(
            f"{who}: the optimizer is the engine's (HybridAdamW, AdamW with the "
            "Trainer's groups); do not pass optimizers[0] or optimizer_cls_and_kwargs"
        )
    if args.load_best_model_at_end:
        raise ValueError(f"{who}: load_best_model_at_end is not supported yet")
    # Both cast the wrapped model as a whole, which the engine's chunked parameters refuse
    # midway (the model is left half cast, and a save then records the wrong dtype).
    if args.bf16_full_eval or args.fp16_full_eval:
        raise ValueError(
            f"{who}: bf16_full_eval and fp16_full_eval cast the whole model, whose "
            "parameters live in the engine's chunks; leave them False (evaluation runs in "
            "the engine's compute dtype)"
        )
    if args.torch_compile:
        raise ValueError(
            f"{who}: torch_compile is not supported: compiled code reads offloaded "
            "parameters outside the hooks that bring them in; leave it False"
        )
    if args.deepspeed or args.fsdp:
        raise ValueError(f"{who}: DeepSpeed and FSDP are other engines; leave them off")
    if args.world_size > 1:
        raise ValueError(f"{who} runs on one process for now")
    if args.n_gpu > 1:  # the Trainer would replicate the wrapped model with nn.DataParallel
        raise ValueError(
            f"{who} uses one GPU; {args.n_gpu} are visible to this process: make "
            "one visible (CUDA_VISIBLE_DEVICES)"
        )
    if config.planned:
        _check_plannable(args)
    return take_over(args, config, who)


def _check_supported(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError("ProTrainTrainer needs the model itself (model_init is not supported)")


def _check_plannable(args: TrainingArguments) -> None:
    """The plan is made for micro-batches of ``per_device_train_batch_size`` rows."""
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy == "batch_rebalance":
        raise ValueError(
            "ProTrainTrainer: ProTrainConfig.gpu_budget plans for micro-batches of "
            "per_device_train_batch_size rows, and train_sampling_strategy='batch_rebalance' "
            "changes the rows per micro-batch: use 'random', 'sequential' or "
            "'group_by_length', or fix the knobs (n_persist, n_buffer) without a budget"
        )


def _check_private_hook() -> None:
    """[Note: the private hook]: the method must still exist with the arguments it had; on
    another transformers version than the tested one, say so once."""
    hook = getattr(Trainer, "_load_from_checkpoint", None)
    params = list(inspect.signature(hook).parameters) if hook is not None else []
    if params[:3] != ["self", "resume_from_checkpoint", "model"]:
        raise RuntimeError(
            f"transformers {transformers.__version__}: Trainer._load_from_checkpoint is not "
            f"the method ProTrainTrainer replaces (tested with {TESTED_TRANSFORMERS})"
        )
    if transformers.__version__ != TESTED_TRANSFORMERS:
        warnings.warn(
            f"ProTrainTrainer replaces Trainer._load_from_checkpoint, checked against "
            f"transformers {TESTED_TRANSFORMERS}; this is {transformers.__version__}: test "
            "resume_from_checkpoint before relying on it",
            stacklevel=3,
        )
