"""A tiny random Llama and a batch (nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

N_LAYERS = 4


def build(seed: int = 0, layers: int = N_LAYERS, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg)


def batch(bsz: int = 2, seq: int = 64, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (bsz, seq), generator=g)
    return {"input_ids": ids, "labels": ids}
