"""4-bit (NF4 / FP4) base weights that live in chunks, for QLoRA.

The layers are bitsandbytes' own ``bnb.nn.Linear4bit``, so that PEFT wraps them with its
4-bit LoRA layers and their math is bitsandbytes' (the same kernels as a QLoRA model that
is not wrapped). What the chunk engine needs besides: the tensors such a layer reads in its
forward and backward must be parameters of the module, because the engine moves
parameters (buffers only once, to the device). A ``Linear4bit`` keeps the packed weight as
its ``weight`` parameter, but the quantization state (block scales ``absmax``, the code
table, and with double quantization the scales' own scales, code and offset) as plain
tensors of a ``QuantState`` object. :func:`lift_quant_state` registers the scales as
frozen parameters of the layer and points the ``QuantState`` at them, so that when the
engine moves the parameter's storage the quantization state moves with it (chunk storage
is resized in place, see [Note: why storage is resized instead of swapped between pool
buffers] in ``chunks/chunk.py``; the views bitsandbytes saves for backward stay valid).

Scales and codes are floating point but must keep their dtype (fp32): the chunk layout
stores floating parameters in the compute dtype unless they carry ``KEEP_DTYPE_ATTR``.

:func:`quantize_linear_4bit` replaces the ``nn.Linear`` layers of a model by such layers,
quantizing each weight on ``quant_device`` (a GPU quantizes a 70B model in seconds; the
CPU kernels of bitsandbytes take minutes per billion parameters) and leaving the packed
weight where the original one was: a base model larger than the GPU is quantized one
layer at a time on the GPU and kept on the host.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from protrain.chunks.layout import KEEP_DTYPE_ATTR
from protrain.quant.bnb_layers import import_bnb, is_bnb, linear_targets, put_layer
from protrain.quant.eight_bit import lift_8bit_state

log = logging.getLogger(__name__)

# (QuantState attribute path, parameter name on the layer): the block scales, one per 64
# weights (1/64 of the packed bytes with double quantization, 1/8 without), and the scales'
# own scales. The code tables and the offset (a few hundred bytes per layer) are not lifted:
# they stay plain tensors, which ``Params4bit.to`` moves with the weight when the engine
# moves the model's buffers to the device, and which bitsandbytes' state-dict hook reads
# (it must never read a released chunk).
_STATE_TENSORS = (
    (("absmax",), "quant_absmax"),
    (("state2", "absmax"), "quant_absmax2"),
)


def is_4bit_linear(module: nn.Module) -> bool:
    """True for a bitsandbytes ``Linear4bit`` (without importing bitsandbytes otherwise)."""
    return is_bnb(module, "Linear4bit")


def _expected_dtype(state, path: tuple[str, ...]) -> torch.dtype:
    # the block scales are uint8 with double quantization (their own scales fp32), else fp32
    return torch.uint8 if path == ("absmax",) and state.nested else torch.float32


def lift_quant_state(model: nn.Module) -> int:
    """Make the quantization state of every 4-bit layer of ``model`` frozen parameters of
    the layer (see the module docstring). The layer's ``QuantState`` is the truth: a
    parameter lifted earlier takes its tensor again (after a deep copy, or a merge that
    re-quantized the weight). Idempotent; returns how many layers it changed. Refuses
    scales cast to another dtype (``model.to(dtype)`` after lifting). bitsandbytes' 8-bit
    layers are lifted too (:func:`protrain.quant.eight_bit.lift_8bit_state`): this is the
    one call that readies a model's quantized layers for chunks."""
    changed = lift_8bit_state(model)
    for module in model.modules():
        if not is_4bit_linear(module):
            continue
        state = getattr(module.weight, "quant_state", None)
        if state is None:
            raise ValueError(
                f"{type(module).__name__} has no quantization state: its weight is not "
                "quantized yet (move the model to its device before protrain.wrap)"
            )
        # bitsandbytes repacks a CPU layer's weight for inference in eval mode on CPUs
        # with AVX512-BF16, outside any chunk; training layers keep the packed layout
        module.support_avx512bf16_for_cpu = False
        lifted = False
        own = dict(module.named_parameters(recurse=False))
        for path, name in _STATE_TENSORS:
            owner = state
            for attr in path[:-1]:
                owner = getattr(owner, attr, None)
            tensor = getattr(owner, path[-1], None) if owner is not None else None
            if tensor is None:
                continue
            if tensor.dtype != _expected_dtype(state, path):
                raise ValueError(
                    f"{type(module).__name__}: its 4-bit scales ({name}) are "
                    f"{tensor.dtype}, bitsandbytes made them {_expected_dtype(state, path)}: "
                    "was the model cast (model.to(dtype)) after quantization? Cast before "
                    "quantizing, or cast only the floating parameters that are not scales"
                )
            param = own.get(name)
            if param is None:
                param = nn.Parameter(tensor.detach(), requires_grad=False)
                module.register_parameter(name, param)
            elif tensor is not param:
                if tensor.shape != param.shape:
                    raise ValueError(
                        f"{type(module).__name__}.{name}: the quantization state holds shape "
                        f"{tuple(tensor.shape)}, the lifted parameter {tuple(param.shape)}"
                    )
                param.data = tensor.detach()  # the state's values (copy or re-quantized)
            # marked every time: a deep copy of a parameter drops its attributes
            setattr(param, KEEP_DTYPE_ATTR, True)
            if tensor is not param:
                setattr(owner, path[-1], param)
                lifted = True
        changed += lifted
    return changed


@torch.no_grad()
def quantize_linear_4bit(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype,
    quant_type: str = "nf4",
    double_quant: bool = True,
    blocksize: int = 64,
    skip: tuple[str, ...] = ("lm_head",),
    quant_device: torch.device | str | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (except its output embeddings and those whose
    name ends with one of ``skip``) by a bitsandbytes ``Linear4bit`` holding the quantized weight, in place.

    Each weight is quantized on ``quant_device`` (default: where it is) and the packed
    weight and its state are moved back to where the weight was. The quantization state is
    lifted into parameters (:func:`lift_quant_state`). Returns ``model``.
    """
    bnb = import_bnb("4-bit base weights")
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type={quant_type!r} is not allowed: use 'nf4' or 'fp4'")
    targets = linear_targets(model, skip, "quantize_linear_4bit")
    for name, linear in targets:
        home = linear.weight.device
        weight = bnb.nn.Params4bit(
            linear.weight.data,
            requires_grad=False,
            quant_type=quant_type,
            compress_statistics=double_quant,
            blocksize=blocksize,
        )
        weight = weight.to(quant_device or home)  # quantizes where it lands
        if weight.device != home:
            weight = weight.to(home)  # moves the packed bytes and the state back
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=double_quant,
            quant_type=quant_type,
            device="meta",
        )
        layer.weight = weight
        put_layer(model, name, linear, layer)
    lift_quant_state(model)
    # what transformers sets on a model it loads in 4-bit: PEFT then wraps these layers with
    # its 4-bit LoRA layers (whose merge de- and re-quantizes the weight)
    model.is_loaded_in_4bit = True
    log.info("quantized %d linear layers to 4-bit %s", len(targets), quant_type)
    return model
