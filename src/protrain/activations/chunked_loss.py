"""Cross-entropy of a causal LM over sequence chunks, without full-sequence fp32 logits.

The logits of ``chunk_tokens`` positions at a time are computed by calling the model's
output-embedding module (so hooks on it, the chunk runtime's gather among them, fire), upcast
to fp32 and reduced to a summed loss. Each chunk runs under a non-reentrant checkpoint: its
logits are dropped after forward and recomputed, one chunk at a time, in backward. Peak
memory for the loss is then about ``chunk_tokens * vocab`` fp32 values (logits, and their
log-softmax and gradient in backward) instead of ``batch * seq * vocab``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with positions: position t is scored against ``labels[..., t + 1]``."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def chunked_causal_lm_loss_sum(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Sum over tokens of the causal LM cross-entropy, computed chunk by chunk.

    ``hidden_states`` ``(..., seq, hidden)`` are the final hidden states (after the final
    norm), ``labels`` ``(..., seq)`` the unshifted labels (shifted by one here; -100 is
    ignored), ``lm_head`` the model's output-embedding module (``get_output_embeddings()``).
    Equals ``F.cross_entropy(lm_head(hidden_states).float() flattened, shifted labels,
    reduction="sum", ignore_index=-100)``; divide by the number of target tokens for a mean.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} is not allowed: use an integer >= 1")
    if hidden_states.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} and labels {tuple(labels.shape)} "
            "do not match: want hidden_states (..., seq, hidden) and labels (..., seq)"
        )
    targets = shift_labels(labels).reshape(-1)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if grad:
            total = total + checkpoint(_chunk_loss_sum, h, lm_head, t, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, lm_head, t)
    return total
