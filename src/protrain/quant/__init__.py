"""Quantized base weights (QLoRA) inside chunks: 4-bit in :mod:`protrain.quant.four_bit`,
8-bit in :mod:`protrain.quant.eight_bit`."""

from protrain.quant.eight_bit import is_8bit_linear, lift_8bit_state, quantize_linear_8bit
from protrain.quant.four_bit import (
    is_4bit_linear,
    lift_quant_state,
    quantize_linear_4bit,
)

__all__ = [
    "is_4bit_linear",
    "is_8bit_linear",
    "lift_8bit_state",
    "lift_quant_state",
    "quantize_linear_4bit",
    "quantize_linear_8bit",
]
