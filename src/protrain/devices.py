"""The device a call runs on when it names none, or names CUDA without an index."""

from __future__ import annotations

import torch


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device``, or the current CUDA device (the CPU where there is no GPU) when None;
    a CUDA device without an index becomes the current one."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
