"""Build a model of a given shape on the meta device and give it cheap random weights.

The library's initializers take minutes for billions of parameters on the CPU. Here each
parameter is allocated empty where it will live and filled with `normal_` (norm weights with
ones, biases with zeros) on `fill_device`, one tensor at a time, so a model bigger than the
GPU budget can still be filled on the GPU and kept on the host.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn


def build_on_meta(config, dtype: torch.dtype, lora_rank: int | None = None) -> nn.Module:
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return add_lora(model, lora_rank) if lora_rank is not None else model


def add_lora(model: nn.Module, lora_rank: int) -> nn.Module:
    """The benchmarks' LoRA: rank ``lora_rank``, alpha twice that, every linear layer."""
    import peft

    config = peft.LoraConfig(
        r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules="all-linear"
    )
    return peft.get_peft_model(model, config)


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


@torch.no_grad()
def build_qlora(config, lora_rank: int, fill_device: torch.device | str) -> nn.Module:
    """QLoRA's model, built for a base larger than the GPU: every decoder layer is created
    on ``fill_device`` (the GPU), filled, quantized there to 4-bit NF4 with double
    quantization, and moved to the host, one layer at a time; the embeddings, norms and
    output layer stay bf16 on the host; LoRA adapters of rank ``lora_rank`` on every
    linear layer (PEFT's 4-bit LoRA layers)."""
    import transformers

    from protrain.quant import quantize_linear_4bit

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    layers = model.get_decoder().layers
    for i, layer in enumerate(layers):
        layer.to_empty(device=fill_device)
        for name, param in layer.named_parameters():
            _fill(name, param, torch.device(fill_device))
        quantize_linear_4bit(layer, compute_dtype=torch.bfloat16)  # where it is: the GPU
        layers[i] = layer.to("cpu")
    for name, module in model.named_modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            for pname, param in module.named_parameters(recurse=False):
                _fill(f"{name}.{pname}", param, torch.device(fill_device))
    model.tie_weights()
    _rebuild_rotary_buffers(model, torch.device("cpu"))
    model.is_loaded_in_4bit = True  # PEFT's 4-bit LoRA layers, as for a model transformers loads
    return add_lora(model, lora_rank)


def build_for_mode(config, mode: str, lora_rank: int | None, fill_device) -> nn.Module:
    """The row's model on the host: ``full`` fp32, ``lora`` a bf16 base with adapters,
    ``qlora`` a 4-bit base with adapters (:func:`build_qlora`)."""
    if mode == "qlora":
        return build_qlora(config, lora_rank, fill_device)
    dtype = torch.bfloat16 if mode == "lora" else torch.float32
    model = build_on_meta(config, dtype, lora_rank if mode == "lora" else None)
    return materialize(model, "cpu", fill_device=fill_device)


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


def saved_param_count(path: Path) -> int:
    """Parameters of a model saved by ``save_pretrained`` in ``path`` (one safetensors file
    or an index of shards), read from the files' headers."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]  # fmt: skip
    n_params = 0
    for name in files:
        with safe_open(str(path / name), "pt") as f:
            n_params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return n_params
