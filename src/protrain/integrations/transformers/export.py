"""A normal Hugging Face (or PEFT) model directory from a wrapped model.

While the engine runs, ``model.state_dict()`` holds views of chunk storage (offloaded ones
are not even resident), so ``save_pretrained`` must be given the gathered weights:
``protrain.state_dict`` puts them together on the CPU, trainable ones from their fp32
masters. They are written in the dtype each parameter had before ``wrap``, as
``save_pretrained`` of the plain model would; ``from_pretrained`` (or
``PeftModel.from_pretrained``) loads the directory.
"""

from __future__ import annotations

import os

import torch
from peft import PeftModel
from torch import nn

import protrain


def save_pretrained_gathered(
    model: nn.Module,
    output_dir: str | os.PathLike,
    param_dtypes: dict[str, torch.dtype],
    is_main_process: bool = True,
) -> None:
    """``model.save_pretrained(output_dir)`` with the engine's weights. A PEFT model saves
    its adapter only, so only the trainable parameters are gathered (the frozen base is
    neither read nor copied)."""
    names = None
    if isinstance(model, PeftModel):
        names = [n for n, p in model.named_parameters() if p.requires_grad]
    state = protrain.state_dict(model, names=names)
    state = {
        name: value.to(param_dtypes[name]) if name in param_dtypes else value
        for name, value in state.items()
    }
    model.save_pretrained(output_dir, state_dict=state, is_main_process=is_main_process)
