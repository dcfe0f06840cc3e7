"""Quantized base weights (QLoRA) inside chunks: see :mod:`protrain.quant.four_bit`."""

from protrain.quant.four_bit import (
    is_4bit_linear,
    lift_quant_state,
    quantize_linear_4bit,
)

__all__ = ["is_4bit_linear", "lift_quant_state", "quantize_linear_4bit"]
