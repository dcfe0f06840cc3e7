"""Encoder-decoder (sequence-to-sequence) models: a causal batch split into encoder input
and decoder labels at the micro-batch.

The data pipeline encodes every row as for a causal LM: ids, and labels that are -100 where
the token is not trained (the prompt, the user's turns, padding). For an encoder-decoder
model each row is split at its first trained token: what comes before it (at least one
token) is the encoder's input, the rest the decoder's, after the model's decoder start
token. The decoder's labels are the row's own from there on, so untrained tokens after the
first trained one (a later user turn of a chat) are read by the decoder and never trained:
masks as for causal models.

[Note: the decoder's labels are causal]
The decoder reads ``[start] + rest`` and is scored against ``[-100] + rest's labels``
shifted by one, exactly as a causal LM is: position t predicts token t + 1. That is the
model's own loss with ``labels=rest`` (whose decoder input is ``[start] + rest[:-1]``),
plus one last decoder position whose logits are dropped by the shift. The trained tokens
are then the causal batch's own (``labels[..., 1:] != -100``), so the loop counts and
normalizes them without knowing the model is an encoder-decoder.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
SEQ2SEQ_KEYS = ("input_ids", "labels", "attention_mask")


def decoder_start_token_id(model) -> int:
    """The token the model's decoder starts from (its config's, else its generation
    config's); a ValueError where it has none."""
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        start = getattr(config, "decoder_start_token_id", None)
        if isinstance(start, int):
            return start
    raise ValueError(
        f"{type(model).__name__} has no decoder_start_token_id in its config or generation "
        "config: the decoder's first input is not known"
    )


def encoder_decoder_batch(
    batch: dict[str, torch.Tensor], start_id: int, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """The causal, right-padded ``batch`` (``input_ids``, ``labels``, ``attention_mask``)
    as the encoder's ``input_ids`` and ``attention_mask``, the decoder's
    ``decoder_input_ids`` and ``decoder_attention_mask``, and causal ``labels`` of the
    decoder positions (see [Note: the decoder's labels are causal])."""
    extra = sorted(set(batch) - set(SEQ2SEQ_KEYS))
    if extra:
        raise ValueError(
            f"an encoder-decoder model takes text rows only, padded (no packing): the batch "
            f"holds {extra}"
        )
    ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    encoder, decoder, decoder_labels = [], [], []
    for row_ids, row_labels, row_mask in zip(ids, labels, mask, strict=True):
        n = int(row_mask.sum())
        trained = torch.nonzero(row_labels[:n] != IGNORE_INDEX).flatten()
        # never an empty encoder input; a label at position 0 is not trained causally either
        k = max(int(trained[0]) if trained.numel() else n, 1)
        encoder.append(row_ids[:k])
        decoder.append(torch.cat([row_ids.new_tensor([start_id]), row_ids[k:n]]))
        decoder_labels.append(torch.cat([row_labels.new_tensor([IGNORE_INDEX]), row_labels[k:n]]))
    input_ids, attention_mask = _pad(encoder, pad_id)
    decoder_input_ids, decoder_attention_mask = _pad(decoder, pad_id)
    out_labels, _ = _pad(decoder_labels, IGNORE_INDEX)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids,
        "decoder_attention_mask": decoder_attention_mask,
        "labels": out_labels,
    }


def _pad(rows: list[torch.Tensor], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    out = rows[0].new_full((len(rows), width), value)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return out, mask
