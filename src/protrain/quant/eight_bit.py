"""8-bit (LLM.int8) base weights that live in chunks, for QLoRA at 8 bits.

The layers are bitsandbytes' own ``bnb.nn.Linear8bitLt`` (frozen int8 weights,
``has_fp16_weights=False``), so that PEFT wraps them with its 8-bit LoRA layers and their
math is bitsandbytes'. A ``Linear8bitLt`` keeps the int8 weight as its ``weight`` parameter,
but its matmul reads the weight and the per-row scales ``SCB`` (fp32, one per output row)
through its ``MatmulLtState``: ``state.CB`` and ``state.SCB``, tensors bound once, at the
first forward. The chunk engine moves parameters only, and places each one as a view of
chunk storage (rebinding ``param.data``), so a state bound before placement would read
storage the engine no longer fills. :func:`lift_8bit_state` therefore

- registers the scales as a frozen parameter ``quant_scb`` of the layer, marked with
  ``KEEP_DTYPE_ATTR`` so that the chunk stores them in fp32 whatever the compute dtype;
- adds a forward pre-hook (the module's own call is the public extension point) that binds
  ``state.CB`` to the weight's tensor and ``state.SCB`` to ``quant_scb`` at every call. The
  backward reads the state again; chunk storage is resized in place (see [Note: why
  storage is resized instead of swapped between pool buffers] in ``chunks/chunk.py``), so
  the tensors bound in the forward stay valid when a released chunk is gathered again.

With an outlier threshold > 0 (bitsandbytes 0.50: ``MatMul8bitLt``, the GPU path and the
CPU's eval path) the forward multiplies the input's outlier columns in 16 bits against
``CB``'s columns dequantized with ``SCB``; the outlier indices (``state.idx``) are the
call's own and the backward takes them, and the 16-bit input columns, from the autograd
context; it reads ``CB``/``SCB`` again for the input's gradient. So the bound pair is all
the weight state a call reads (``subB`` is a local of the kernel, ``CxB`` deprecated).

A weight quantized afresh (by :func:`quantize_linear_8bit`, or by PEFT's merge, which de-
and re-quantizes) holds its scales in ``weight.SCB`` until bitsandbytes' forward takes
them: those are the truth, and lifting (or the hook) moves them into ``quant_scb``.

:func:`quantize_linear_8bit` replaces the ``nn.Linear`` layers of a model by such layers,
quantizing each weight on ``quant_device`` the way bitsandbytes does (row-wise absmax of
the fp16 weight, ``int8_vectorwise_quant``) and leaving the int8 weight where the original
one was.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from protrain.chunks.layout import KEEP_DTYPE_ATTR
from protrain.quant.bnb_layers import import_bnb, is_bnb, linear_targets, put_layer

log = logging.getLogger(__name__)

SCALES_NAME = "quant_scb"  # the lifted per-row scales, a frozen parameter of the layer
_HOOKED_ATTR = "_protrain_binds_int8_state"  # the binding pre-hook is registered


def is_8bit_linear(module: nn.Module) -> bool:
    """True for a bitsandbytes ``Linear8bitLt`` (without importing bitsandbytes otherwise)."""
    return is_bnb(module, "Linear8bitLt")


def _lift_layer(module: nn.Module) -> bool:
    """Lift one ``Linear8bitLt``'s scales into ``quant_scb`` and bind its state to its
    parameters; True when the parameter was created or took new scales."""
    name = type(module).__name__
    weight, state = module.weight, module.state
    if state.has_fp16_weights:
        raise ValueError(
            f"{name} has has_fp16_weights=True: it trains its weight in 16 bits and "
            "quantizes it at every call; base weights in chunks are frozen int8 "
            "(protrain.quant.quantize_linear_8bit, or has_fp16_weights=False)"
        )
    if weight.dtype != torch.int8:
        raise ValueError(
            f"{name}'s weight is {weight.dtype}, not int8: it is not quantized yet "
            "(protrain.quant.quantize_linear_8bit, or move the layer to its device)"
        )
    param = getattr(module, SCALES_NAME, None)
    scales = getattr(weight, "SCB", None)  # a fresh quantization or merge: the truth
    if scales is None and param is None:
        scales = state.SCB  # bitsandbytes' forward already took the weight's scales
        if scales is None:
            raise ValueError(f"{name} has no int8 scales (SCB): its weight is not quantized")
    changed = False
    if scales is not None and scales is not param:
        if scales.shape != (weight.shape[0],):
            raise ValueError(
                f"{name}: the int8 scales have shape {tuple(scales.shape)}, the weight has "
                f"{weight.shape[0]} rows"
            )
        if param is None:
            param = nn.Parameter(scales.detach(), requires_grad=False)
            module.register_parameter(SCALES_NAME, param)
        else:
            param.data = scales.detach()
        changed = True
    if param.dtype != torch.float32:
        raise ValueError(
            f"{name}: its int8 scales ({SCALES_NAME}) are {param.dtype}, bitsandbytes made "
            "them torch.float32: was the model cast (model.to(dtype)) after quantization? "
            "Cast before quantizing, or cast only the floating parameters that are not scales"
        )
    # marked every time: a deep copy of a parameter drops its attributes
    setattr(param, KEEP_DTYPE_ATTR, True)
    weight.CB = weight.SCB = None  # else bitsandbytes' forward would bind the state itself
    # CB a plain tensor: bitsandbytes calls ``state.CB.to(..., copy=True)``, which
    # Int8Params.to refuses. SCB the parameter itself: bitsandbytes' state-dict hook saves
    # it, and the engine's state_dict then finds it among its parameters (the plain alias of
    # a released chunk would be read as it is: no bytes)
    state.CB, state.SCB = weight.data, param
    if not getattr(module, _HOOKED_ATTR, False):
        module.register_forward_pre_hook(_bind_state)
        setattr(module, _HOOKED_ATTR, True)  # a deep copy copies the hook and the mark
        changed = True
    return changed


def _bind_state(module: nn.Module, args) -> None:
    # the parameters' tensors now: the engine placed them in chunks after lifting
    _lift_layer(module)


def lift_8bit_state(model: nn.Module) -> int:
    """Make the scales of every 8-bit layer of ``model`` a frozen parameter of the layer and
    bind the layer's state to its parameters (see the module docstring). Idempotent;
    returns how many layers it changed. Refuses layers that are not quantized, layers
    with 16-bit trained weights, and scales cast to another dtype."""
    return sum(_lift_layer(m) for m in model.modules() if is_8bit_linear(m))


@torch.no_grad()
def quantize_linear_8bit(
    model: nn.Module,
    *,
    threshold: float = 6.0,
    skip: tuple[str, ...] = ("lm_head",),
    quant_device: torch.device | str | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (except its output embeddings and those whose
    name ends with one of ``skip``) by a bitsandbytes ``Linear8bitLt`` holding the int8
    weight, in place. ``threshold``: LLM.int8's outlier threshold on activations, default 6.0
    as transformers' ``BitsAndBytesConfig.llm_int8_threshold`` (the same model as one loaded
    in 8 bits); 0.0 quantizes every input column. Input columns holding a value above it are
    multiplied in 16 bits against their dequantized weight columns; bitsandbytes' CPU
    training path dequantizes the whole weight and reads no threshold.

    Each weight is quantized on ``quant_device`` (default: where it is) and the int8 weight
    and its scales are moved back to where the weight was; the scales are lifted
    (:func:`lift_8bit_state`). The layers compute in their input's dtype. Returns ``model``.
    """
    bnb = import_bnb("8-bit base weights")
    if not (threshold >= 0.0 and math.isfinite(threshold)):
        raise ValueError(f"threshold={threshold!r} is not allowed: use a finite number >= 0")
    targets = linear_targets(model, skip, "quantize_linear_8bit")
    for name, linear in targets:
        home = linear.weight.device
        # as Int8Params quantizes: row-wise absmax of the fp16 weight
        fp16 = linear.weight.detach().to(quant_device or home, torch.float16)
        int8, scales, _ = bnb.functional.int8_vectorwise_quant(fp16)
        layer = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_fp16_weights=False,
            threshold=threshold,
            device="meta",
        )
        layer.weight = bnb.nn.Int8Params(
            int8.to(home), requires_grad=False, has_fp16_weights=False, SCB=scales.to(home)
        )
        put_layer(model, name, linear, layer)
    lift_8bit_state(model)
    # what transformers sets on a model it loads in 8-bit: PEFT then wraps these layers with
    # its 8-bit LoRA layers
    model.is_loaded_in_8bit = True
    log.info("quantized %d linear layers to 8-bit (LLM.int8)", len(targets))
    return model
