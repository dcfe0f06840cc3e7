"""Fused kernels from Liger Kernel: which run on a model (``choose_kernels``), putting the
module kernels on a loaded model (``apply_module_kernels``), and the record of what runs
(``applied_kernels``), read by the loss, the planner's trace and the plan, so that the plan
and the run agree.

The kernels are Liger's public per-family functions ``apply_liger_kernel_to_<family>(model=
...)`` (RMSNorm, SwiGLU/GeGLU MLP, RoPE), called on the loaded causal LM (inside a PEFT
wrapper: LoRA layers inside the MLP stay, the fused MLP calls them). Liger swaps RoPE
process-wide for the family (``apply_rotary_pos_emb`` of the family's modeling module),
as it does for every user. Its fused linear cross-entropy is not taken through its
replacement ``forward`` (that computes the loss its own way, a mean): the app's loss calls
the kernel itself through the head, where it replaces the chunked loss and keeps the app's
summed, token-weighted loss. The loss's layer installs that head, above this one:
``protrain.activations.fused_loss.apply_kernels`` puts a whole choice on a model (these
module kernels, then the head).

Liger's kernels are Triton, which has no CPU backend: ``auto`` is off on the CPU.
"""

from __future__ import annotations

import importlib.util
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

FUSED_CE = "fused_linear_cross_entropy"
KERNELS = ("rms_norm", "swiglu", "geglu", "rope", FUSED_CE)


@dataclass(frozen=True)
class Family:
    """A model type Liger has kernels for: its public function and its MLP's kernel."""

    function: str
    mlp: str  # "swiglu" or "geglu"


FAMILIES: dict[str, Family] = {
    "llama": Family("apply_liger_kernel_to_llama", "swiglu"),
    "mistral": Family("apply_liger_kernel_to_mistral", "swiglu"),
    "qwen2": Family("apply_liger_kernel_to_qwen2", "swiglu"),
    "qwen3": Family("apply_liger_kernel_to_qwen3", "swiglu"),
    "phi3": Family("apply_liger_kernel_to_phi3", "swiglu"),
    "granite": Family("apply_liger_kernel_to_granite", "swiglu"),
    "olmo2": Family("apply_liger_kernel_to_olmo2", "swiglu"),
    "gemma": Family("apply_liger_kernel_to_gemma", "geglu"),
    "gemma2": Family("apply_liger_kernel_to_gemma2", "geglu"),
}


@dataclass(frozen=True)
class KernelChoice:
    """The kernels that run (in ``KERNELS`` order; empty: none) and the one-line reason."""

    names: tuple[str, ...]
    reason: str

    @property
    def fused_loss(self) -> bool:
        return FUSED_CE in self.names

    def describe(self) -> str:
        return f"kernels: {', '.join(self.names) or 'none'} ({self.reason})"


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def choose_kernels(
    setting: str | Sequence[str],
    model_type: str,
    device: torch.device,
    *,
    liger_available: bool,
    head_problem: str | None,
) -> KernelChoice:
    """The kernels ``setting`` (``"auto"``, ``"none"`` or a list of ``KERNELS``) gives for a
    model of ``model_type`` on ``device``. ``head_problem``: why the fused loss cannot take
    the model's head (``protrain.activations.fused_loss.fused_head_problem``), or None.

    ``auto``: every kernel of the family where Liger is installed and the device is a CUDA
    GPU (the fused loss only where the head allows it), else none, with the reason. A list:
    exactly those, or a ``ValueError`` naming what cannot run and what is allowed."""
    if setting == "none":
        return KernelChoice((), "model.kernels: none")
    family = FAMILIES.get(model_type)
    if setting == "auto":
        off = _why_off(model_type, family, device, liger_available)
        if off is not None:
            return KernelChoice((), f"model.kernels: auto; {off}")
        names = _family_kernels(family)
        if head_problem is not None:
            names = tuple(n for n in names if n != FUSED_CE)
            return KernelChoice(names, f"model.kernels: auto; {FUSED_CE} off: {head_problem}")
        return KernelChoice(names, f"model.kernels: auto; Liger on {device.type}")
    if isinstance(setting, str):
        raise ValueError(
            f"model.kernels = {setting!r} is not allowed: use auto, none or a list of "
            f"{', '.join(KERNELS)}"
        )
    return _listed(list(setting), model_type, family, device, liger_available, head_problem)


def _why_off(model_type: str, family: Family | None, device, liger_available: bool) -> str | None:
    if device.type != "cuda":
        return f"no CUDA GPU ({device.type}): Liger's kernels are Triton, GPU only"
    if not liger_available:
        return "liger-kernel is not installed (pip install 'protrain[kernels]')"
    if family is None:
        return f"Liger has no kernels for model type {model_type!r} here"
    return None


def _family_kernels(family: Family) -> tuple[str, ...]:
    return tuple(n for n in KERNELS if n in ("rms_norm", "rope", FUSED_CE, family.mlp))


def _listed(names, model_type, family, device, liger_available, head_problem) -> KernelChoice:
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(
            f"model.kernels: {', '.join(map(repr, unknown))} not known: use auto, none or a "
            f"list of {', '.join(KERNELS)}"
        )
    if not names:
        return KernelChoice((), "model.kernels: []")
    off = _why_off(model_type, family, device, liger_available)
    if off is not None:
        raise ValueError(f"model.kernels = {names} cannot run: {off}; use auto or none")
    allowed = _family_kernels(family)
    wrong = [n for n in names if n not in allowed]
    if wrong:
        raise ValueError(
            f"model.kernels: {', '.join(wrong)} not for model type {model_type!r}: its "
            f"kernels are {', '.join(allowed)}"
        )
    if FUSED_CE in names and head_problem is not None:
        raise ValueError(f"model.kernels: {FUSED_CE} cannot run: {head_problem}")
    return KernelChoice(tuple(n for n in KERNELS if n in names), "model.kernels as listed")


# causal LM -> the kernels applied to it
_APPLIED: weakref.WeakKeyDictionary[nn.Module, KernelChoice] = weakref.WeakKeyDictionary()


def apply_module_kernels(causal_lm: nn.Module, choice: KernelChoice) -> None:
    """Put ``choice``'s module kernels (RMSNorm, SwiGLU/GeGLU, RoPE) on ``causal_lm`` (the
    transformers model, unwrapped from PEFT) through Liger's public function for its
    family, and record ``choice`` as what runs. Its fused loss is recorded, not installed:
    ``protrain.activations.fused_loss.apply_kernels`` installs the head as well, and is
    the entry point for a choice with it."""
    if not choice.names:
        _APPLIED[causal_lm] = choice
        return
    # optional dependency (liger-kernel, the kernels extra)
    import liger_kernel.transformers as liger

    family = FAMILIES[causal_lm.config.model_type]
    getattr(liger, family.function)(
        model=causal_lm,
        rope="rope" in choice.names,
        rms_norm="rms_norm" in choice.names,
        **{family.mlp: family.mlp in choice.names},
        cross_entropy=False,
        fused_linear_cross_entropy=False,  # the app's loss calls the kernel (module doc)
    )
    _APPLIED[causal_lm] = choice


def applied_kernels(causal_lm: nn.Module) -> tuple[str, ...]:
    """The kernels put on ``causal_lm`` (``apply_module_kernels``; empty where none or not
    called)."""
    choice = _APPLIED.get(causal_lm)
    return choice.names if choice is not None else ()


__all__ = [
    "FAMILIES",
    "FUSED_CE",
    "KERNELS",
    "KernelChoice",
    "applied_kernels",
    "apply_module_kernels",
    "choose_kernels",
    "liger_installed",
]
