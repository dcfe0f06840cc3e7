"""The plugin's YAML keys: ``protrain_memory``, protrain's own ``memory:`` section.

axolotl merges the pydantic model that ``ProTrainPlugin.get_input_args`` names into its
config schema, so ``protrain_memory`` is validated with the rest of the YAML. The section has
the application's vocabulary and checks (``protrain.train.config.MemoryConfig``): ``auto``,
``gpu_budget``, ``cpu_budget``, ``n_persist``, ``n_buffer``, ``chunk_size``, ``n_swap``,
``n_checkpoint``, ``offload_checkpoint``, ``tiled_mlp_tokens``. Two of its keys have no
meaning under axolotl's Trainer and are refused: ``chunked_loss_tokens`` (the loss is the
Trainer's) and ``mode`` (one process).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

import torch
from pydantic import BaseModel, model_validator

from protrain.integrations.transformers.arguments import EIGHT_BIT_ADAMW
from protrain.integrations.transformers.config import ProTrainConfig
from protrain.train.config import MemoryConfig

SECTION = "protrain_memory"


_ADAMW = (None, "adamw_torch", "adamw_torch_fused", *EIGHT_BIT_ADAMW)
# axolotl keys that regroup or replace the optimizer the engine builds
_OPTIMIZER_KEYS = ("loraplus_lr_ratio", "embedding_lr", "embedding_lr_scale", "lr_groups")
_OTHER_ENGINES = ("deepspeed", "fsdp", "fsdp_config")
_OTHER_TRAINERS = ("rl", "reward_model", "process_reward_model")
# axolotl's fused LoRA kernels (axolotl/kernels/lora.py), switched on by default for LoRA
# axolotl keys that save activation memory with the same math; ProTrainPlugin.register
# takes them over (the plan places activations)
ACTIVATION_KEYS = ("gradient_checkpointing", "activation_offloading")
LORA_KERNEL_KEYS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")


class ProTrainArgs(BaseModel):
    """Merged into axolotl's config schema (``BasePlugin.get_input_args``): its validator
    sees the whole config when axolotl loads it, so what cannot run is refused then, before
    any dataset is tokenized or model loaded."""

    protrain_memory: MemoryConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def refuse_what_cannot_run(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "plugins" in data:  # the whole config, not a part
            check_config(data)
        return data


def memory_section(cfg: Mapping[str, Any]) -> MemoryConfig:
    """The validated ``protrain_memory`` section of an axolotl config; one clear error when
    it is missing or asks for what the engine cannot do under axolotl's Trainer."""
    raw = cfg.get(SECTION)
    if raw is None:
        raise ValueError(
            f"{SECTION} is not set: ProTrainPlugin needs the engine's memory settings, e.g. "
            f"{SECTION}: {{auto: true, gpu_budget: 24GiB}} (or n_persist / n_buffer)"
        )
    memory = raw if isinstance(raw, MemoryConfig) else MemoryConfig.model_validate(dict(raw))
    if not memory.engine_enabled:
        raise ValueError(
            f"{SECTION} sets no engine knob: set auto: true with gpu_budget, or n_persist / "
            "n_buffer"
        )
    if memory.chunked_loss_tokens is not None:
        raise ValueError(
            f"{SECTION}.chunked_loss_tokens is not supported by the plugin (the loss is "
            "axolotl's Trainer's); remove it"
        )
    if memory.mode is not None:
        raise ValueError(f"{SECTION}.mode is for several ranks; the plugin runs on one: remove it")
    return memory


def protrain_config(memory: MemoryConfig, compute_dtype: torch.dtype | None) -> ProTrainConfig:
    """The engine's knobs for ``ProTrainTrainer`` from the section (``auto``: planned from
    the heaviest micro-batch of the Trainer's dataset for ``gpu_budget``; knobs set next to it are kept)."""
    planned = ProTrainConfig(
        compute_dtype=compute_dtype,
        gpu_budget=int(memory.gpu_budget) if memory.auto else None,
        cpu_budget=int(memory.cpu_budget) if memory.cpu_budget is not None else None,
    )
    return replace(planned, **asdict(memory.knobs()))


def check_config(cfg: Mapping[str, Any]) -> None:
    """One clear error, naming the axolotl key and the fix, for what the engine cannot run
    or would change the math of (``ProTrainPlugin.register`` has already taken over
    ``gradient_checkpointing``, ``activation_offloading``, ``bf16: auto`` and an absent
    flash-attention kernel)."""
    memory_section(cfg)
    for key in LORA_KERNEL_KEYS:
        if cfg.get(key):
            raise ValueError(
                f"{key}: axolotl's fused LoRA kernels read weights outside the modules the "
                f"engine gathers for; set {key}: false"
            )
    if cfg.get("fp16") or cfg.get("float16"):
        raise ValueError(
            "fp16: not supported with ProTrainPlugin (fp16 needs a loss scale the Trainer's "
            "step does not apply); use bf16: true or bf16: auto, or set fp16: false"
        )
    if cfg.get("optimizer") not in _ADAMW:
        raise ValueError(
            f"optimizer: {cfg.get('optimizer')!r} is not supported with ProTrainPlugin; use "
            f"one of {_ADAMW[1:]} (the engine's AdamW, fp32 or 8-bit state)"
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
