"""``ProTrainPlugin``: axolotl trains with ProTrain's engine and its memory plan.

Written against axolotl 0.21.0 (``axolotl/integrations/base.py``, ``integrations/config.py``,
``cli/config.py``, ``core/builders/causal.py``, ``train.py``). Only public plugin hooks are used,
in the order axolotl calls them:

- ``register`` (on the YAML as loaded, before axolotl validates it; for each config axolotl
  loads in the process, on the one plugin instance it keeps): takes over what the engine
  does itself, each said once in the log: ``gradient_checkpointing`` and
  ``activation_offloading`` (the plan places activations), ``bf16: true / auto`` (the engine's compute dtype), flash-attention where
  its kernel cannot run here (sdpa), axolotl's fused LoRA kernels left unset (off: they
  read the base layers' weights outside the modules whose hooks make a chunk resident).
  It also sends protrain's log lines through axolotl's logger (``console.py``; again in
  ``pre_model_load`` and ``get_trainer_cls``).
- ``get_input_args``: the ``protrain_memory`` section joins axolotl's schema (``args.py``),
  whose validator refuses, when axolotl loads the config, what cannot run.
- ``get_training_args``: the engine's compute dtype and activation policy as the Trainer's
  ``bf16`` / ``gradient_checkpointing``, which ``ProTrainTrainer`` takes over.
- ``get_trainer_cls``: axolotl's own ``AxolotlTrainer`` with ``ProTrainTrainer`` in front
  (``protrain.integrations.transformers``); the optimizer comes from the trainer class
  (``ProTrainTrainer.create_optimizer``): the 8-bit AdamW names are the engine's 8-bit AdamW.
- ``post_trainer_create``: checks the trainer is that class.
- ``post_train``: gives the engine back (``ProTrainTrainer.close``), so that the
  ``model.save_pretrained`` axolotl runs next writes a normal HF / PEFT directory.

[Note: importing axolotl]
axolotl pins transformers, peft and trl to versions other than those protrain[hf] is tested
with (0.21.0: transformers 5.20.1, peft 0.21.2, trl 1.14.1), so it lives in an environment of
its own and may be absent here. axolotl loads a plugin by importing it and calling its hooks; it checks no
base class. The plugin subclasses ``BasePlugin`` when axolotl is importable, and plain
``object`` otherwise (nothing then calls it); axolotl's trainer class is imported only in
``get_trainer_cls``, when axolotl is running.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

import torch

from protrain.integrations.axolotl.args import (
    ACTIVATION_KEYS,
    LORA_KERNEL_KEYS,
    check_config,
    memory_section,
    protrain_config,
)
from protrain.integrations.axolotl.console import show_in_axolotl_console
from protrain.integrations.transformers.trainer import ProTrainTrainer

try:
    from axolotl.integrations.base import BasePlugin
except ImportError:  # [Note: importing axolotl]
    BasePlugin = object

log = logging.getLogger(__name__)
TESTED_AXOLOTL = "0.21.0"


class ProTrainPlugin(BasePlugin):
    """``plugins: [protrain.integrations.axolotl.ProTrainPlugin]`` with a ``protrain_memory``
    section; see the module's docstring for what each hook does."""

    def __init__(self) -> None:
        super().__init__()
        self.trainer: ProTrainTrainer | None = None
        self.compute_dtype = torch.float32  # what bf16 / bf16: auto asked for (register)
        self.save_activations = False  # what ACTIVATION_KEYS asked for (register)

    def register(self, cfg: dict) -> None:
        """Runs on the raw YAML before axolotl validates it: takes over what the engine does
        itself, so that axolotl's own validation and model loading see it off. axolotl keeps
        one plugin instance per process and calls this for every config it loads there, so
        what the last config asked for is read afresh."""
        show_in_axolotl_console()
        self.compute_dtype, self.save_activations = torch.float32, False
        changes = [
            *self._lora_kernels_off(cfg),
            *self._precision(cfg),
            *self._attention(cfg),
            *self._activations(cfg),
        ]
        for change in changes:
            log.info("ProTrainPlugin: %s", change)

    def _activations(self, cfg: dict) -> list[str]:
        """gradient_checkpointing and activation_offloading (any of axolotl's modes: true,
        legacy, disk, hidden_states) ask, with the same math, to save activation memory by
        recomputing blocks or moving their activations to the host: the engine's activation
        placement does both (the plan's n_checkpoint / n_swap). Off for axolotl itself, whose
        checkpoint and offload wrappers would wrap the blocks the engine's hooks run in."""
        asked = [key for key in ACTIVATION_KEYS if cfg.get(key)]
        for key in asked:
            self.save_activations = True
            cfg[key] = False
        return [f"{key}: the engine saves activation memory itself (the plan places "
                "activations: recomputed blocks, or swapped to the host)" for key in asked]  # fmt: skip

    @staticmethod
    def _lora_kernels_off(cfg: dict) -> list[str]:
        unset = [key for key in LORA_KERNEL_KEYS if cfg.get(key) is None]
        for key in unset:
            cfg[key] = False
        if not unset:
            return []
        return [f"{', '.join(unset)} set to false (axolotl would enable them; they read "
                "weights outside the modules the engine gathers for)"]  # fmt: skip

    def _precision(self, cfg: dict) -> list[str]:
        """bf16: true / auto is the engine's compute dtype; axolotl itself then loads and
        trains without autocast (and without its bf16 GPU check, which a CPU run fails)."""
        asked = cfg.get("bf16") if cfg.get("bf16") is not None else cfg.get("bfloat16")
        if not asked:
            return []
        bf16 = asked != "auto" or (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        self.compute_dtype = torch.bfloat16 if bf16 else torch.float32
        cfg["bf16"] = cfg["bfloat16"] = False
        if cfg.get("fp16") is None:
            cfg["fp16"] = False  # axolotl's bf16: auto would turn fp16 on without a bf16 GPU
        return [f"bf16: {asked}: the engine computes in {str(self.compute_dtype)[6:]}"]

    @staticmethod
    def _attention(cfg: dict) -> list[str]:
        """flash-attention where its kernel runs (installed, on CUDA); else sdpa, said once."""
        asked = cfg.get("attn_implementation") or (
            "flash_attention_2" if cfg.get("flash_attention") else None
        )
        if asked not in ("flash_attention_2", "flash_attention_3"):
            return []
        if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
            return []
        cfg["attn_implementation"], cfg["flash_attention"] = "sdpa", None
        return [f"attn_implementation: {asked} needs the flash_attn package and a CUDA GPU, "
                "absent here: training with sdpa (the same attention, another kernel)"]  # fmt: skip

    def get_input_args(self) -> str:
        return "protrain.integrations.axolotl.args.ProTrainArgs"

    def pre_model_load(self, cfg: Any) -> None:
        show_in_axolotl_console()
        check_config(cfg)  # already checked at load; kept for callers that skip validation

    def get_training_args(self, cfg: Any) -> dict[str, Any]:
        # the engine's compute dtype and activation policy (ProTrainTrainer takes them over)
        return {"bf16": self.compute_dtype == torch.bfloat16, "fp16": False,
                "bf16_full_eval": False, "gradient_checkpointing": self.save_activations}  # fmt: skip

    def get_trainer_cls(self, cfg: Any) -> type[ProTrainTrainer]:
        # optional dependency (axolotl): imported when axolotl asks for the trainer class
        from axolotl.core.trainers.base import AxolotlTrainer

        show_in_axolotl_console()  # the plan is logged while the trainer is built
        config = protrain_config(memory_section(cfg), None)
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
