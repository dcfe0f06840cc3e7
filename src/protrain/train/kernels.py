"""`model.kernels`: which of Liger Kernel's fused kernels a run puts on its model
(`protrain.model.kernels`), decided once after the model and its adapters are built, and
logged in one line saying which kernels run or why none do."""

from __future__ import annotations

from torch import nn

from protrain.activations.fused_loss import apply_kernels, fused_head_problem
from protrain.model.kernels import KernelChoice, choose_kernels, liger_installed
from protrain.train.config import TrainConfig
from protrain.train.errors import ConfigError
from protrain.train.log import logger
from protrain.train.loss import unwrap_causal_lm


def put_kernels(cfg: TrainConfig, model: nn.Module, device) -> KernelChoice:
    """Choose `cfg.model.kernels` for `model` (a causal LM, or PEFT around one) on
    `device`, apply them, log the choice; a list that cannot run is a `ConfigError`."""
    causal_lm = unwrap_causal_lm(model)
    setting = cfg.model.kernels
    model_type = getattr(getattr(causal_lm, "config", None), "model_type", None) or "?"
    problem = None
    if setting != "none":
        problem = _fused_loss_problem(cfg, causal_lm)
    try:
        choice = choose_kernels(
            setting,
            model_type,
            device,
            liger_available=liger_installed(),
            head_problem=problem,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    logger.info(choice.describe())
    apply_kernels(causal_lm, choice)
    return choice


def _fused_loss_problem(cfg: TrainConfig, causal_lm: nn.Module) -> str | None:
    if cfg.fsdp_version == 2:
        # FSDP2 computes a chunked loss inside the root's forward (fsdp2_trainable); the
        # fused head is not wired there
        return "the FSDP2 engine (fsdp_version: 2) runs the loss its own way"
    if getattr(causal_lm.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return fused_head_problem(causal_lm)
