"""What the engine takes over from ``TrainingArguments`` (the Trainer's, TRL's ``SFTConfig``).

Some arguments ask for something the engine does itself; they are taken over instead of
refused, and the log says so once:

- ``gradient_checkpointing=True`` (``activation_checkpointing``, its name in transformers 5) asks to save activation memory: with
  ``ProTrainConfig.gpu_budget`` the plan places activations (the searched ``n_checkpoint`` /
  ``n_swap``); without one every block is recomputed (``n_checkpoint`` = the model's
  blocks), as the Trainer's checkpointing would.
- ``bf16=True`` is the engine's compute dtype (``ProTrainConfig.compute_dtype``); ``bf16=False``
  (the Trainer's default) is fp32 compute, as the plain Trainer computes then, unless
  ``ProTrainConfig.compute_dtype`` says otherwise.
- ``optim`` ``adamw_8bit`` / ``adamw_bnb_8bit`` / ``paged_adamw_8bit`` is the engine's 8-bit
  AdamW (bitsandbytes' blockwise state for the persistent chunks, ``optim/adamw_8bit.py``);
  ``adamw_torch`` / ``adamw_torch_fused`` its fp32 AdamW.

What would change the math or cannot run is refused in one line naming the argument:
``fp16=True`` (fp16 needs a loss scale in every backward, which the Trainer's step does not
apply), ``bf16=True`` next to ``compute_dtype=torch.float32``, any other optimizer.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import TrainingArguments

from protrain.integrations.transformers.config import ProTrainConfig
from protrain.model.blocks import discover_blocks

log = logging.getLogger(__name__)
FP32_ADAMW = ("adamw_torch", "adamw_torch_fused")  # HybridAdamW runs torch's fused AdamW
EIGHT_BIT_ADAMW = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit")


@dataclass(frozen=True)
class TakenOver:
    """The engine's reading of the arguments: its optimizer (``"adamw"`` or
    ``"adamw_8bit"``), its compute dtype (None: the engine's default) and whether the user
    asked to save activation memory."""

    optimizer: str
    compute_dtype: torch.dtype | None
    save_activations: bool


def take_over(args: TrainingArguments, config: ProTrainConfig, who: str) -> TakenOver:
    """What the engine does in place of ``args``' own precision, checkpointing and optimizer;
    one ``ValueError`` naming the argument (``who`` names the trainer) for what it cannot."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in FP32_ADAMW + EIGHT_BIT_ADAMW:
        raise ValueError(
            f"{who}: optim={optim!r} is not supported: use one of {FP32_ADAMW + EIGHT_BIT_ADAMW}"
            " (the engine's AdamW, fp32 or 8-bit state)"
        )
    if args.fp16:
        raise ValueError(
            f"{who}: fp16=True is not supported (fp16 needs a loss scale the Trainer's step "
            "does not apply): set bf16=True (the engine computes in bf16) or fp16=False"
        )
    dtype = config.compute_dtype
    if args.bf16:
        if dtype not in (None, torch.bfloat16):
            raise ValueError(
                f"{who}: bf16=True and ProTrainConfig.compute_dtype={dtype} disagree: set "
                "bf16=False, or compute_dtype=torch.bfloat16"
            )
        dtype = torch.bfloat16
    elif dtype is None:  # the plain Trainer computes in fp32 then: the same math
        dtype = torch.float32
    # transformers 5 names it activation_checkpointing; gradient_checkpointing mirrors it
    save_activations = bool(
        getattr(args, "activation_checkpointing", False)
        or getattr(args, "gradient_checkpointing", False)
    )
    return TakenOver("adamw_8bit" if optim in EIGHT_BIT_ADAMW else "adamw", dtype, save_activations)


def trainer_arguments(args: TrainingArguments) -> TrainingArguments:
    """A copy of ``args`` for the Trainer itself, without what the engine took over: the
    Trainer's autocast, its checkpointing (which wraps the model's layers) and its clipping
    (which reads ``param.grad``, always None here: the engine clips)."""
    args = copy.copy(args)
    args.bf16 = False
    args.gradient_checkpointing = False
    if hasattr(args, "activation_checkpointing"):
        args.activation_checkpointing = False
    args.max_grad_norm = 0.0
    return args


def with_taken_over(config: ProTrainConfig, taken: TakenOver, model: nn.Module) -> ProTrainConfig:
    """``config`` with the compute dtype and, for ``gradient_checkpointing`` without a
    budget or activation knobs, every block recomputed; the log says what was taken over."""
    config = replace(config, compute_dtype=taken.compute_dtype)
    if taken.compute_dtype == torch.bfloat16:
        log.info("protrain: bf16=True is the engine's compute dtype (bfloat16)")
    elif taken.compute_dtype == torch.float32:
        log.info("protrain: the engine computes in float32 (bf16=True for bfloat16)")
    if taken.optimizer == "adamw_8bit":
        log.info("protrain: the 8-bit optim is the engine's 8-bit AdamW (bitsandbytes' state)")
    if not taken.save_activations:
        return config
    if config.planned:
        log.info(
            "protrain: gradient_checkpointing=True: the memory plan places activations "
            "(recomputed or swapped blocks, within gpu_budget)"
        )
    elif config.n_checkpoint is None and config.n_swap is None:
        n_blocks = len(discover_blocks(model).blocks)
        config = replace(config, n_checkpoint=n_blocks)
        log.info(
            "protrain: gradient_checkpointing=True: the engine recomputes all %d blocks "
            "(ProTrainConfig.n_checkpoint)",
            n_blocks,
        )
    return config
