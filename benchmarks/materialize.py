"""Build a model of a given shape on the meta device and give it cheap random weights.

The library's initializers take minutes for billions of parameters on the CPU. Here each
parameter is allocated empty where it will live and filled with `normal_` (norm weights with
ones, biases with zeros) on `fill_device`, one tensor at a time, so a model bigger than the
GPU budget can still be filled on the GPU and kept on the host.
"""

from __future__ import annotations

import torch
from torch import nn


def build_on_meta(config, dtype: torch.dtype, lora_rank: int | None = None) -> nn.Module:
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    if lora_rank is not None:
        import peft

        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules="all-linear"
            ),
        )
    return model


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, fill_device: torch.device | str):
    """Allocate every meta tensor on `device`, re-tie tied weights, fill them cheaply."""
    model.to_empty(device=device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.tie_weights()  # to_empty gives each use of a tied tensor its own storage
    for name, param in model.named_parameters():
        _fill(name, param, torch.device(fill_device))
    _rebuild_rotary_buffers(model, torch.device(device))
    return model


def _fill(name: str, param: torch.Tensor, fill_device: torch.device) -> None:
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.numel() == 0:
        return
    if "norm" in name.rsplit(".", 2)[-2]:
        local.fill_(1.0)
    elif name.endswith("bias"):
        local.zero_()
    elif local.device == fill_device:
        local.normal_(0.0, 0.02)
    else:
        tmp = torch.empty(local.shape, dtype=local.dtype, device=fill_device).normal_(0.0, 0.02)
        local.copy_(tmp)


def _rebuild_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    # Rotary inverse frequencies are computed buffers: to_empty leaves them uninitialized.
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, child_name, type(child)(child.config).to(device))
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise RuntimeError(f"buffer {name} is still on the meta device")
