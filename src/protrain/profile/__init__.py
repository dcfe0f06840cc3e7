"""Measuring: hardware rates (``hardware``), one traced step of the real model (``trace``),
the memory clock both use (``memory_clock``), and a picture of a traced step (``timeline``)."""

from protrain.profile.hardware import HardwareProfile, measure_hardware
from protrain.profile.trace import BlockProfile, ModelProfile, trace_model

__all__ = [
    "BlockProfile",
    "HardwareProfile",
    "ModelProfile",
    "measure_hardware",
    "trace_model",
]
