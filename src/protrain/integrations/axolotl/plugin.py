"""``ProTrainPlugin``: axolotl trains with ProTrain's engine and its memory plan.

Checked against axolotl 0.19.0 (``axolotl/integrations/base.py``, ``core/builders/causal.py``,
``train.py``). Only public plugin hooks are used, in the order axolotl calls them:

- ``register``: turns off axolotl's fused LoRA kernels where the config leaves them unset
  (axolotl would switch them on), said once in the log: their autograd functions read the
  base layers' weights directly, outside the modules whose hooks make an offloaded chunk
  resident.
- ``get_input_args``: the ``protrain_memory`` section joins axolotl's schema (``args.py``).
- ``pre_model_load``: refuses, with the key's name, what the engine cannot run or would
  silently change (its own activation checkpointing, fp16, other optimizers or optimizer
  groups, DeepSpeed / FSDP, RL and reward trainers).
- ``get_training_args``: the Trainer's ``bf16`` / ``fp16`` off, since the engine computes
  in ``bf16`` itself when the config asks for it (``ProTrainConfig.compute_dtype``).
- ``get_trainer_cls``: axolotl's own ``AxolotlTrainer`` with ``ProTrainTrainer`` in front
  (``protrain.integrations.transformers``): the engine's model and optimizer, clipping,
  ``step_in_backward``, checkpoints and exact resume, and, with ``auto: true``, the plan from
  the heaviest micro-batch of the Trainer's dataset. axolotl 0.19.0 never calls the plugin's ``create_optimizer``
  (``PluginManager.create_optimizer`` has no caller), so the optimizer comes from the
  trainer class (``ProTrainTrainer.create_optimizer``).
- ``post_trainer_create``: checks the trainer is that class (another plugin's trainer class
  may come first).
- ``post_train``: gives the engine back (``ProTrainTrainer.close``): the model is the plain
  module again, holding the trained weights, so the ``model.save_pretrained`` axolotl runs
  next writes a normal HF / PEFT directory. Checkpoints during training were written by
  ``ProTrainTrainer.save_model`` while wrapped.

[Note: importing axolotl]
axolotl pins transformers, peft and trl to versions other than those protrain[hf] is tested
with (0.19.0: transformers 5.16.1, peft 0.20.0, trl 1.9.0), so it is an optional extra that
may be absent. axolotl loads a plugin by importing it and calling its hooks; it checks no
base class. The plugin subclasses ``BasePlugin`` when axolotl is importable, and plain
``object`` otherwise (nothing then calls it); axolotl's trainer class is imported only in
``get_trainer_cls``, when axolotl is running.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from protrain.integrations.axolotl.args import SECTION, memory_section, protrain_config
from protrain.integrations.transformers.trainer import ProTrainTrainer

try:
    from axolotl.integrations.base import BasePlugin
except ImportError:  # [Note: importing axolotl]
    BasePlugin = object

log = logging.getLogger(__name__)
TESTED_AXOLOTL = "0.19.0"
_ADAMW = (None, "adamw_torch", "adamw_torch_fused")
# axolotl keys that regroup or replace the optimizer the engine builds
_OPTIMIZER_KEYS = ("loraplus_lr_ratio", "embedding_lr", "embedding_lr_scale", "lr_groups")
_OTHER_ENGINES = ("deepspeed", "fsdp", "fsdp_config")
_OTHER_TRAINERS = ("rl", "reward_model", "process_reward_model")
# axolotl's fused LoRA kernels (axolotl/kernels/lora.py), switched on by default for LoRA
LORA_KERNEL_KEYS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")


class ProTrainPlugin(BasePlugin):
    """``plugins: [protrain.integrations.axolotl.ProTrainPlugin]`` with a ``protrain_memory``
    section; see the module's docstring for what each hook does."""

    def __init__(self) -> None:
        super().__init__()
        self.trainer: ProTrainTrainer | None = None

    def register(self, cfg: dict) -> None:
        unset = [key for key in LORA_KERNEL_KEYS if cfg.get(key) is None]
        for key in unset:
            cfg[key] = False
        if unset:
            log.info(
                "ProTrainPlugin: %s set to false (axolotl would enable them; they read "
                "weights outside the modules the engine gathers for)",
                ", ".join(unset),
            )

    def get_input_args(self) -> str:
        return "protrain.integrations.axolotl.args.ProTrainArgs"

    def pre_model_load(self, cfg: Any) -> None:
        memory_section(cfg)
        check_config(cfg)

    def get_training_args(self, cfg: Any) -> dict[str, Any]:
        return {"bf16": False, "fp16": False, "bf16_full_eval": False}

    def get_trainer_cls(self, cfg: Any) -> type[ProTrainTrainer]:
        from axolotl.core.trainers.base import AxolotlTrainer

        config = protrain_config(memory_section(cfg), compute_dtype(cfg))
        return type(
            "ProTrainAxolotlTrainer",
            (protrain_trainer(AxolotlTrainer),),
            {"protrain_config": config, "__module__": __name__},
        )

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        if not isinstance(trainer, ProTrainTrainer):
            raise ValueError(
                f"ProTrainPlugin: the trainer is {type(trainer).__name__}, not ProTrain's: "
                "another plugin in `plugins:` sets the trainer class first; list "
                "ProTrainPlugin before it or remove it"
            )
        self.trainer = trainer
        if trainer.protrain_config.planned:
            log.info(
                "ProTrainPlugin: the memory plan is made from the heaviest training micro-batch"
            )

    def post_train(self, cfg: Any, model: Any) -> None:
        # axolotl calls this twice (after trainer.train, and at the end of train()).
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None


@functools.cache
def protrain_trainer(base: type) -> type[ProTrainTrainer]:
    """``ProTrainTrainer`` in front of axolotl's trainer class: its ``__init__`` wraps the
    model and then calls ``base.__init__`` with axolotl's keyword arguments."""
    return type(f"ProTrain{base.__name__}", (ProTrainTrainer, base), {"__module__": __name__})


def compute_dtype(cfg: Any) -> torch.dtype:
    """bf16 when the config asks for it (``bf16`` / ``bfloat16``), fp32 otherwise."""
    return torch.bfloat16 if cfg.get("bf16") or cfg.get("bfloat16") else torch.float32


def check_config(cfg: Any) -> None:
    """One clear error, naming the axolotl key, for what the engine cannot run."""
    if cfg.get("gradient_checkpointing"):
        raise ValueError(
            "gradient_checkpointing: the engine recomputes blocks itself "
            f"({SECTION}.n_checkpoint, or chosen by {SECTION}.auto); set "
            "gradient_checkpointing: false"
        )
    for key in LORA_KERNEL_KEYS:
        if cfg.get(key):
            raise ValueError(
                f"{key}: axolotl's fused LoRA kernels read weights outside the modules the "
                f"engine gathers for; set {key}: false"
            )
    if cfg.get("activation_offloading"):
        raise ValueError(
            f"activation_offloading: the engine swaps activations itself ({SECTION}.n_swap); "
            "remove activation_offloading"
        )
    if cfg.get("fp16") or cfg.get("float16"):
        raise ValueError(
            "fp16: not supported with ProTrainPlugin; use bf16: true, or set fp16: false "
            "(axolotl's bf16: auto turns fp16 on where the GPU has no bf16)"
        )
    if cfg.get("optimizer") not in _ADAMW:
        raise ValueError(
            f"optimizer: {cfg.get('optimizer')!r} is not supported with ProTrainPlugin; use "
            "adamw_torch or adamw_torch_fused (the engine's AdamW)"
        )
    for key in _OPTIMIZER_KEYS:
        if cfg.get(key) is not None:
            raise ValueError(
                f"{key}: not supported with ProTrainPlugin (the engine's optimizer uses the "
                "Trainer's weight-decay groups); remove it"
            )
    for key in _OTHER_ENGINES:
        if cfg.get(key):
            raise ValueError(f"{key}: another engine; ProTrainPlugin replaces it: remove it")
    for key in _OTHER_TRAINERS:
        if cfg.get(key):
            raise ValueError(
                f"{key}: ProTrainPlugin trains with axolotl's causal LM trainer only; remove it"
            )
