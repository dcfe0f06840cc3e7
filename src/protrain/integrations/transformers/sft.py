"""``ProTrainSFTTrainer``: TRL's ``SFTTrainer`` training with ProTrain's engine.

``SFTTrainer`` builds its model (loading it from a name, attaching the PEFT adapter) before it
calls ``Trainer.__init__``. ``ProTrainTrainer`` sits between the two in the method resolution
order (``SFTTrainer -> _BaseTrainer -> ProTrainTrainer -> Trainer``), so it wraps the model
SFTTrainer built, before the Trainer places it; everything ``ProTrainTrainer`` does (the
engine's optimizer, clipping, ``step_in_backward``, saving and resuming) carries over.

One thing does not: SFTTrainer's loss runs a fused LM head that reads ``lm_head.weight``
directly instead of calling the ``lm_head`` module, and the engine gathers an offloaded
chunk's weights in the hooks of the modules that use them, so the head would read a chunk
that is not resident. ``compute_loss`` therefore computes the loss the Trainer's way (the
model's own forward with ``labels``: the same token-mean cross-entropy, normalized over the
accumulated batch by ``num_items_in_batch``); SFTTrainer's extra metrics (entropy, token
accuracy), which come from the fused head, are not logged. Two of SFTTrainer's loss terms
are kept its way: a Mixture-of-Experts model's router loss, which SFTTrainer weights by its
``router_aux_loss_coef`` and divides by the accumulation steps (the model's own loss adds it
undivided), and ``loss_type="dft"``, which needs the fused head's per-token probabilities
and is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer
from trl import SFTTrainer

from protrain.integrations.transformers.config import ProTrainConfig
from protrain.integrations.transformers.trainer import ProTrainTrainer, check_arguments

TESTED_TRL = "1.16.0"


class ProTrainSFTTrainer(SFTTrainer, ProTrainTrainer):
    """``trl.SFTTrainer`` whose model and optimizer are ProTrain's engine; the engine's knobs
    in ``protrain_config``. ``SFTConfig()``'s defaults are taken over by the engine
    (``bf16=True``: its compute dtype; ``gradient_checkpointing=True``: its activation
    policy; see ``arguments.py``); its arguments are checked before SFTTrainer tokenizes."""

    def __init__(self, *args: Any, protrain_config: ProTrainConfig | None = None, **kwargs: Any):
        sft_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        loss_type = getattr(sft_args, "loss_type", "nll")
        if loss_type != "nll":
            raise ValueError(
                f"ProTrainSFTTrainer: loss_type={loss_type!r} is not supported: it reads the "
                "fused LM head's per-token probabilities, which the engine's chunked head does "
                "not give; use loss_type='nll'"
            )
        # Before SFTTrainer tokenizes or loads anything: refused arguments cost no work.
        check_arguments(
            sft_args, protrain_config or ProTrainConfig(), kwargs, who=type(self).__name__
        )
        # Read by ProTrainTrainer.__init__, which SFTTrainer.__init__ reaches through super().
        self.protrain_config = protrain_config
        super().__init__(*args, **kwargs)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        inputs = {**inputs, "use_cache": False}  # as SFTTrainer.compute_loss
        if not self.aux_loss_enabled:
            return Trainer.compute_loss(
                self,
                model,
                inputs,
                return_outputs=return_outputs,
                num_items_in_batch=num_items_in_batch,
            )
        inputs["output_router_logits"] = True
        loss, outputs = Trainer.compute_loss(
            self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        # The model's loss holds coef * aux_loss once; SFTTrainer adds it divided by the
        # accumulation steps when the Trainer normalizes the loss over the accumulated batch.
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        aux = getattr(outputs, "aux_loss", None)
        if aux is not None and steps != 1:
            weighted = self.router_aux_loss_coef * aux.to(loss.device)
            loss = loss - weighted + weighted / steps
        return (loss, outputs) if return_outputs else loss
