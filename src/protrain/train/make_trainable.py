"""Which trainable runs a config: the FSDP2 engine, auto mode, the chunk engine or plain
PyTorch. Its own module so that ``trainable.py`` (the base class and ProTrain's engines) and
``fsdp2_trainable.py`` (a subclass) need not import each other."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from protrain.train.config import TrainConfig
from protrain.train.fsdp2_trainable import FSDP2Trainable
from protrain.train.log import logger
from protrain.train.trainable import AutoTrainable, EngineTrainable, PlainTrainable, Trainable


def make_trainable(
    model: nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    sample_batch: Callable[[], dict[str, torch.Tensor]],
    several_ranks: bool = False,
) -> Trainable:
    """The trainable the `memory:` section asks for; `sample_batch()` (the heaviest micro-batch)
    is called only when a plan is made. Several ranks run the engine (with no knob set, every
    chunk on the GPU: gradients all-reduced chunk by chunk, as DDP would)."""
    if cfg.fsdp_version:  # the FSDP2 engine, on one rank or several
        return FSDP2Trainable(model, cfg, device, autocast_dtype)
    if cfg.memory.auto:
        return AutoTrainable(
            model, cfg, device, autocast_dtype, sample_batch(), several_ranks=several_ranks
        )
    if several_ranks:
        if not cfg.memory.engine_enabled:
            logger.info("several ranks without memory knobs: every chunk stays on the GPU")
        return EngineTrainable(model, cfg, device, autocast_dtype, several_ranks=True)
    if cfg.memory.engine_enabled:
        return EngineTrainable(model, cfg, device, autocast_dtype)
    return PlainTrainable(model, cfg, device, autocast_dtype)
