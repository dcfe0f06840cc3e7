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
from pydantic import BaseModel

from protrain.integrations.transformers.config import ProTrainConfig
from protrain.train.config import MemoryConfig

SECTION = "protrain_memory"


class ProTrainArgs(BaseModel):
    """Merged into axolotl's config schema (``BasePlugin.get_input_args``)."""

    protrain_memory: MemoryConfig | None = None


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
