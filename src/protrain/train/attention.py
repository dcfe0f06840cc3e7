"""How attention runs: `model.attn_implementation` and `model.sdpa_backend`.

Left unset, `attn_implementation` is SDPA where the model's class (and each of its
sub-models: a vision tower, a text model) supports it in the installed transformers, else
eager: transformers 5.24 refuses SDPA for Gemma 2 and the attention-free Mamba models. It is
decided from the config before any weight is loaded, and logged. An explicit value is kept
as given (transformers refuses an unsupported one).

Packed rows (`sample_packing`) on a CUDA GPU take flex_attention instead, where the class
supports it. A packed micro-batch is one row whose `position_ids` restart at each sample;
under SDPA transformers builds from them a dense boolean `(1, 1, tokens, tokens)` mask once
a forward (1 GiB at 32K tokens), which also rules out SDPA's flash kernel (it takes no mask);
under flex_attention it builds a `BlockMask` (a few bytes a 128 x 128 block) and the
compiled kernel skips the blocks between samples. The math is the same (same softmax over
the same keys). flash-attn's varlen kernel would do the same but has no wheel for this
torch: it builds from source against CUDA. On the CPU torch 2.13 has no flex_attention
backward, so SDPA stays there.

Which fused kernel runs scaled-dot-product attention: `model.sdpa_backend`.

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
import importlib.util

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.auto.modeling_auto import MODEL_MAPPING
from transformers.utils import is_torch_flex_attn_available

from protrain.train.errors import ConfigError
from protrain.train.log import logger

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


def choose_attn_implementation(
    requested: str | None,
    sdpa_backend_name: str,
    model_class: type | None,
    config,
    *,
    packing: bool = False,
    device: torch.device | None = None,
) -> str | None:
    """The `attn_implementation` to load ``model_class`` (built from ``config``) with.

    ``requested`` None: 'flex_attention' for ``packing`` rows on a CUDA ``device`` where the
    class and its sub-models support it and no SDPA kernel is forced; else 'sdpa' where they
    support it, else 'eager'; a forced ``sdpa_backend_name`` needs SDPA, so it is a
    `ConfigError` there. ``model_class`` None (remote code, not known before loading): None,
    transformers' own default, which is the same rule applied to the class it loads, without
    flex. One line is logged saying which and why.
    """
    if requested is not None:
        _check_requested(requested, device)
        return requested
    if model_class is None:
        logger.info(
            "attention: model.attn_implementation unset; the model's own code decides "
            "(sdpa where it supports it, else eager)"
        )
        return None
    if packing and sdpa_backend_name == "default" and _flex_fits(model_class, config, device):
        logger.info(
            "attention: flex_attention (model.attn_implementation unset; sample_packing on a "
            "CUDA GPU: each packed sample attends within itself through a block mask, no "
            "dense tokens x tokens mask; supported by %s)",
            model_class.__name__,
        )
        return "flex_attention"
    lacking = [cls.__name__ for cls in _model_classes(model_class, config)
               if not getattr(cls, "_supports_sdpa", False)]  # fmt: skip
    if not lacking:
        why = "model.sdpa_backend needs it" if sdpa_backend_name != "default" else "supported"
        logger.info("attention: sdpa (model.attn_implementation unset; %s by %s)",
                    why, model_class.__name__)  # fmt: skip
        return "sdpa"
    if sdpa_backend_name != "default":
        raise ConfigError(
            f"model.sdpa_backend = {sdpa_backend_name!r} needs SDPA attention, which "
            f"{', '.join(lacking)} does not support in transformers {_transformers_version()}; "
            "leave sdpa_backend at 'default'"
        )
    logger.info(
        "attention: eager (model.attn_implementation unset; %s does not support sdpa in "
        "transformers %s)",
        ", ".join(lacking),
        _transformers_version(),
    )
    return "eager"


_KERNEL_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def _check_requested(requested: str, device: torch.device | None) -> None:
    """An explicit implementation that cannot train here is one line, not a traceback."""
    if requested == "flex_attention" and device is not None and device.type != "cuda":
        raise ConfigError(
            f"model.attn_implementation = 'flex_attention' needs a CUDA GPU: torch has no "
            f"flex_attention backward on {device.type}; use 'sdpa' or leave it unset"
        )
    package = _KERNEL_PACKAGES.get(requested)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"model.attn_implementation = {requested!r} needs the {package} package, which "
            "is not installed; leave it unset (sdpa where the model supports it) or install it"
        )


def _flex_fits(model_class: type, config, device: torch.device | None) -> bool:
    """flex_attention can run ``model_class`` on ``device``: a CUDA GPU (torch has no
    flex_attention backward on the CPU), and the class and its sub-models support it."""
    if device is None or device.type != "cuda" or not is_torch_flex_attn_available():
        return False
    classes = _model_classes(model_class, config)
    return all(getattr(cls, "_supports_flex_attn", False) for cls in classes)


def _model_classes(model_class: type, config) -> list[type]:
    """``model_class`` and the classes of its sub-models that transformers maps from their
    sub-configs (each checks its attention implementation when built)."""
    classes = [model_class]
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        found = MODEL_MAPPING.get(type(sub), None)
        if isinstance(found, (list, tuple)):  # transformers builds the first by default
            found = found[0]
        if found is not None:
            classes.append(found)
    return classes


def _transformers_version() -> str:
    return transformers.__version__
