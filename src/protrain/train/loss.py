"""The causal language-modelling loss, normalized over a whole accumulation window.

Each micro-batch contributes `sum of token losses / tokens in the window`, so that the
accumulated gradient equals the gradient of the mean token loss over every micro-batch of
the optimizer step, however the trained tokens are spread over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def count_trained_tokens(labels: torch.Tensor) -> int:
    """Tokens whose next-token prediction is trained (labels are shifted by one)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of every trained next-token prediction, in fp32.

    The logits are sliced, not the labels shifted (transformers' way): on the GPU both gave
    the same peak allocated at 8 x 2048 positions of a 128,256-token vocabulary, and the
    label shift 3.9 GiB more reserved (session 17)."""
    shift_logits = logits[..., :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal-LM module inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def loss_sum(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    chunked_loss_tokens: int | None = None,
) -> torch.Tensor:
    """Sum of token losses of one micro-batch, as the loop computes it (and the planner
    traces it)."""
    causal_lm = unwrap_causal_lm(model)
    if getattr(getattr(causal_lm, "config", None), "is_encoder_decoder", False):
        from protrain.train.seq2seq import decoder_start_token_id, encoder_decoder_batch

        # encoder input and causal decoder labels: the same trained tokens as `batch`'s
        batch = encoder_decoder_batch(batch, decoder_start_token_id(causal_lm))
    labels = batch["labels"]
    inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "labels"}
    if chunked_loss_tokens is None:
        return causal_lm_loss_sum(model(**inputs).logits, labels)
    # Full-sequence logits never exist: the body gives hidden states and the head runs
    # chunk by chunk inside the loss, with the family's logit transform.
    from protrain.activations import causal_lm_head, chunked_causal_lm_loss_sum

    head, transform = causal_lm_head(causal_lm)
    hidden = causal_lm.base_model(**inputs).last_hidden_state
    return chunked_causal_lm_loss_sum(
        hidden,
        head,
        labels.to(hidden.device),
        chunk_tokens=chunked_loss_tokens,
        logit_transform=transform,
    )
