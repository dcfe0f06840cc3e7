"""Fused linear cross-entropy: the output head's matmul and the loss in one kernel, so that
no logits tensor of any size exists (Liger Kernel's ``LigerFusedLinearCrossEntropyLoss``).

[Note: the fused loss runs inside the head's call]
The kernel reads the head's weight directly, and the chunk runtime gathers a module's
parameters in that module's forward pre-hook. So the loss is computed by calling the head
module: its ``forward`` is wrapped once (``wrap_forward``) to take an optional
``fused_ce_targets`` keyword. ``head(hidden)`` still gives logits (evaluation, generation);
``head(hidden, fused_ce_targets=t)`` gives the summed loss, and every hook on the head (the
chunk runtime's gather, the planner's trace) runs around it as around a plain call.

The kernel computes the input and weight gradients during forward and scales them in
backward, so the loss is ``sum over trained tokens`` exactly as ``chunked_causal_lm_loss_sum``
and ``causal_lm_loss_sum`` give it (fp32, ``ignore_index=-100``); the app divides by the
window's trained tokens as for every other loss.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from protrain.activations.chunked_loss import (
    IGNORE_INDEX,
    LogitTransform,
    UnsupportedHead,
    causal_lm_head,
    shift_labels,
)
from protrain.activations.forward_wrap import wrap_forward
from protrain.model.kernels import KernelChoice, apply_module_kernels

# (head weight, hidden (tokens, hidden), targets (tokens,), head bias or None) -> summed loss
LinearCrossEntropy = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]

# causal LM -> its head, for models whose head computes the fused loss (install_fused_head)
_FUSED_HEADS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def reference_linear_cross_entropy(
    weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What the fused kernel computes, with the logits materialized: the CPU reference."""
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def liger_linear_cross_entropy() -> LinearCrossEntropy:
    """Liger's fused kernel with the app's reduction (a sum, -100 ignored). Needs Triton."""
    # optional dependency (liger-kernel, the kernels extra): imported where the fused loss is used
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


def fused_head_problem(causal_lm: nn.Module) -> str | None:
    """Why the fused loss cannot replace ``causal_lm``'s head and loss, or None where it can:
    the head must be a plain ``nn.Linear`` (not an adapter, a quantized layer or a wrapper)
    whose logits the model does not transform (``causal_lm_head``)."""
    try:
        head, transform = causal_lm_head(causal_lm)
    except UnsupportedHead as exc:
        return str(exc)
    if type(head) is not nn.Linear:
        return f"the output head is a {type(head).__name__}, not a plain nn.Linear"
    if transform not in (LogitTransform(), LogitTransform(upcast_first=True)):
        return f"{type(causal_lm).__name__} transforms its logits ({transform})"
    return None


def apply_kernels(
    causal_lm: nn.Module,
    choice: KernelChoice,
    *,
    loss_kernel: LinearCrossEntropy | None = None,
) -> None:
    """Put ``choice`` on ``causal_lm`` (the transformers model, unwrapped from PEFT): its
    module kernels and the record of what runs (``protrain.model.kernels``), then, where it
    has the fused loss, the head that computes it (``install_fused_head``; ``loss_kernel``:
    the fused loss's kernel, default Liger's). A head the fused loss cannot take is refused
    before anything is put on."""
    if choice.fused_loss:
        _refuse_unfit_head(causal_lm)
    apply_module_kernels(causal_lm, choice)
    if choice.fused_loss:
        install_fused_head(causal_lm, loss_kernel or liger_linear_cross_entropy())


def install_fused_head(causal_lm: nn.Module, kernel: LinearCrossEntropy) -> Callable[[], None]:
    """Let ``causal_lm``'s head compute the fused loss when called with ``fused_ce_targets``
    (see [Note: the fused loss runs inside the head's call]); return the undo. Raises
    ``ValueError`` where ``fused_head_problem`` names a reason."""
    _refuse_unfit_head(causal_lm)
    head = causal_lm.get_output_embeddings()

    def make(forward: Callable) -> Callable:
        def forward_or_fused_loss(hidden, fused_ce_targets=None):
            if fused_ce_targets is None:
                return forward(hidden)
            return kernel(head.weight, hidden, fused_ce_targets, head.bias)

        return forward_or_fused_loss

    undo_forward = wrap_forward(head, make)
    _FUSED_HEADS[causal_lm] = head

    def undo() -> None:
        undo_forward()
        _FUSED_HEADS.pop(causal_lm, None)

    return undo


def _refuse_unfit_head(causal_lm: nn.Module) -> None:
    problem = fused_head_problem(causal_lm)
    if problem is not None:
        raise ValueError(f"the fused linear cross-entropy cannot run: {problem}")


def fused_head(causal_lm: nn.Module) -> nn.Module | None:
    """The head of ``causal_lm`` that computes the fused loss, or None."""
    return _FUSED_HEADS.get(causal_lm)


def fused_causal_lm_loss_sum(
    hidden_states: torch.Tensor, head: nn.Module, labels: torch.Tensor
) -> torch.Tensor:
    """Sum over trained tokens of the causal LM cross-entropy, by the fused head
    (``install_fused_head``): ``hidden_states`` ``(..., seq, hidden)`` after the final norm,
    ``labels`` ``(..., seq)`` unshifted (shifted by one here). The same value as
    ``chunked_causal_lm_loss_sum`` for a head without a logit transform."""
    if hidden_states.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} and labels {tuple(labels.shape)} "
            "do not match: want hidden_states (..., seq, hidden) and labels (..., seq)"
        )
    targets = shift_labels(labels).reshape(-1)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    return head(hidden, fused_ce_targets=targets).float()
