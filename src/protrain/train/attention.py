"""Which fused kernel runs scaled-dot-product attention: `model.sdpa_backend`.

torch picks an SDPA kernel by itself; at long context attention is most of a step, and the
kernels differ a lot there. On one H200 (`benchmarks/attention_backends.py`, 32 heads of
128, causal, bf16, forward + backward at 131,072 tokens): cuDNN 0.91 s (541 TFLOP/s),
flash 1.52 s (325), memory-efficient 3.42 s (144). The kernel is forced with
`torch.nn.attention.sdpa_kernel` for the whole run, so that the planner's trace, training,
its recomputation in backward and evaluation all use it. Kernels round differently within
the compute dtype; `default` keeps torch's choice.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from protrain.train.errors import ConfigError

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
_CPU = ("default", "flash", "math")  # torch's CPU SDPA has these kernels only


def sdpa_backend(name: str, device: torch.device) -> contextlib.AbstractContextManager:
    """A context forcing SDPA kernel ``name`` (``default``: none is forced) on ``device``."""
    if name == "default":
        return contextlib.nullcontext()
    if name not in BACKENDS:
        raise ConfigError(
            f"model.sdpa_backend = {name!r} is not allowed: use one of "
            f"{', '.join(['default', *BACKENDS])}"
        )
    if device.type != "cuda" and name not in _CPU:
        raise ConfigError(
            f"model.sdpa_backend = {name!r} needs a CUDA GPU; on {device.type} use one of "
            f"{', '.join(_CPU)}"
        )
    return sdpa_kernel([BACKENDS[name]])
