"""The causal language-modelling loss, normalized over a whole accumulation window.

Each micro-batch contributes `sum of token losses / tokens in the window`, so that the
accumulated gradient equals the gradient of the mean token loss over every micro-batch of
the optimizer step, however the trained tokens are spread over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_trained_tokens(labels: torch.Tensor) -> int:
    """Tokens whose next-token prediction is trained (labels are shifted by one)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of every trained next-token prediction, in fp32.

    The labels are shifted, not the logits, as transformers' ``ForCausalLMLoss`` does: the
    slice ``logits[..., :-1, :]`` of a micro-batch of several rows is not contiguous, and
    flattening it copied every logit in the forward (2 bytes each in bf16: 3.9 GiB at 8 x
    2048 positions of a 128,256-token vocabulary). The loss's peak is in its backward
    (``plan/loss_chunk.py``'s ``logit_bytes``) and stayed where it was (session 17, H100 and
    H200), but the forward no longer holds the copy. The last position of each row predicts
    nothing: its label is ``IGNORE_INDEX``."""
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = logits.reshape(-1, logits.size(-1)).float()  # a view of contiguous logits
    return F.cross_entropy(
        flat, shift_labels.to(flat.device), ignore_index=IGNORE_INDEX, reduction="sum"
    )
