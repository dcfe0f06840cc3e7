"""The causal language-modelling loss, normalized over a whole accumulation window.

Each micro-batch contributes `sum of token losses / tokens in the window`, so that the
accumulated gradient equals the gradient of the mean token loss over every micro-batch of
the optimizer step, however the trained tokens are spread over them.

[Note: the router loss]
A Mixture-of-Experts model whose config sets `output_router_logits` adds its load-balancing
loss to its own loss (`loss + router_aux_loss_coef * aux_loss`, per forward). The loop
builds the cross-entropy itself, so it adds the same term: `coef * aux_loss` of the
micro-batch, weighted by the micro-batch's trained tokens, so that one micro-batch's loss is
the model's own, and a window's is the token-weighted mean over its micro-batches. The aux
loss is transformers' own `load_balancing_loss_func` of the family, over the router logits
the body returns (also where the head runs in chunks).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from protrain import activations
from protrain.activations.fused_loss import fused_causal_lm_loss_sum, fused_head
from protrain.train.seq2seq import decoder_start_token_id, encoder_decoder_batch

IGNORE_INDEX = -100


def count_trained_tokens(labels: torch.Tensor) -> int:
    """Tokens whose next-token prediction is trained (labels are shifted by one)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of every trained next-token prediction, in fp32.

    The logits are sliced, not the labels shifted (transformers' way): on the GPU both gave
    the same peak allocated at 8 x 2048 positions of a 128,256-token vocabulary, and the
    label shift 3.9 GiB more reserved (an H100)."""
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
    traces it): the fused linear cross-entropy where the model's kernels include it
    (``protrain.model.kernels``; it replaces ``chunked_loss_tokens``), else the loss in
    chunks of ``chunked_loss_tokens`` positions, else over the whole logits."""
    causal_lm = unwrap_causal_lm(model)
    if getattr(getattr(causal_lm, "config", None), "is_encoder_decoder", False):
        # encoder input and causal decoder labels: the same trained tokens as `batch`'s
        batch = encoder_decoder_batch(batch, decoder_start_token_id(causal_lm))
    labels = batch["labels"]
    inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "labels"}
    router = router_aux_loss(causal_lm)
    fused = fused_head(causal_lm)
    if chunked_loss_tokens is None and fused is None:
        out = model(**inputs)
        total = causal_lm_loss_sum(out.logits, labels)
        if router is not None:
            total = total + router[0] * out.aux_loss.to(total.device) * count_trained_tokens(labels)
        return total
    # Full-sequence logits never exist: the body gives hidden states and the head runs
    # fused with the loss (where the model's kernels include it: it replaces the chunks),
    # or chunk by chunk inside the loss, with the family's logit transform.
    body = causal_lm.base_model(**inputs)
    hidden = body.last_hidden_state
    if fused is not None:
        total = fused_causal_lm_loss_sum(hidden, fused, labels.to(hidden.device))
    else:
        head, transform = activations.causal_lm_head(causal_lm)
        total = activations.chunked_causal_lm_loss_sum(
            hidden,
            head,
            labels.to(hidden.device),
            chunk_tokens=chunked_loss_tokens,
            logit_transform=transform,
        )
    if router is not None:
        aux = router[1](body.router_logits, inputs.get("attention_mask"))
        total = total + router[0] * aux.to(total.device) * count_trained_tokens(labels)
    return total


def router_aux_loss(causal_lm: nn.Module) -> tuple[float, Callable] | None:
    """``(router_aux_loss_coef, aux(router_logits, attention_mask))`` of a Mixture-of-Experts
    model whose config asks for its load-balancing loss, else None ([Note: the router
    loss]). A model that asks for it without transformers' usual attributes is refused:
    its loss cannot be built as its own forward builds it."""
    if not getattr(getattr(causal_lm, "config", None), "output_router_logits", False):
        return None
    module = sys.modules.get(type(causal_lm).__module__)
    balance = getattr(module, "load_balancing_loss_func", None)
    names = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
    if balance is None or not all(hasattr(causal_lm, n) for n in names):
        raise ValueError(
            f"{type(causal_lm).__name__} has output_router_logits set, but not the "
            "load_balancing_loss_func and router_aux_loss_coef / num_experts / "
            "num_experts_per_tok of transformers' MoE models, so its router loss cannot be "
            "added as its own forward adds it; set output_router_logits: false"
        )

    def aux(router_logits, attention_mask) -> torch.Tensor:
        return balance(
            router_logits, causal_lm.num_experts, causal_lm.num_experts_per_tok, attention_mask
        )

    return float(causal_lm.router_aux_loss_coef), aux
