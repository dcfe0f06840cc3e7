"""The engine's model state inside a Trainer checkpoint directory.

The HF weights a checkpoint carries (``model.safetensors`` or ``adapter_model.safetensors``)
are in the model's own dtype and, for an adapter, under PEFT's renamed keys; resuming
exactly needs the fp32 masters of the trainable parameters under the model's own names. They
go to one more file, ``protrain_model.safetensors``, read back into the engine with
``protrain.load_state_dict``. The optimizer state needs no file of its own: the Trainer
saves and loads ``optimizer.state_dict()``, which the engine's optimizer gives in torch's
format.
"""

from __future__ import annotations

import os

from safetensors.torch import load_file, save_file
from torch import nn

import protrain

ENGINE_STATE_NAME = "protrain_model.safetensors"


def save_engine_state(model: nn.Module, names: list[str], output_dir: str | os.PathLike) -> None:
    """Write the trainable parameters ``names`` (fp32 masters) of a wrapped model."""
    state = protrain.state_dict(model, names=names)
    os.makedirs(output_dir, exist_ok=True)
    save_file(
        {name: state[name].contiguous() for name in names},
        os.path.join(output_dir, ENGINE_STATE_NAME),
        metadata={"format": "pt"},
    )


def load_engine_state(
    model: nn.Module, names: list[str], checkpoint_dir: str | os.PathLike
) -> None:
    """Load what :func:`save_engine_state` wrote into a wrapped model; the names must match."""
    path = os.path.join(checkpoint_dir, ENGINE_STATE_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: resuming with ProTrain needs a checkpoint saved by "
            "ProTrainTrainer (it carries the fp32 masters of the trainable parameters)"
        )
    state = load_file(path, device="cpu")
    missing, unexpected = sorted(set(names) - set(state)), sorted(set(state) - set(names))
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the model's trainable parameters: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    protrain.load_state_dict(model, state, strict=False)
