"""Tiny random Hugging Face models and batches for engine tests (nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    CLIPVisionConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB = 96
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
IMAGE_TOKEN = VOCAB - 1
N_IMAGE_TOKENS = 4  # (16 / 8) ** 2 patches, CLS dropped


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_DECODER, tie_word_embeddings=False))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_DECODER, tie_word_embeddings=False))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**_DECODER, tie_word_embeddings=False))
    elif kind == "gpt2":  # tied input and output embeddings
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=3,
                n_head=4,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    elif kind == "t5":  # encoder-decoder, shared embedding
        model = T5ForConditionalGeneration(
            T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        )
    elif kind == "llava":  # vision tower + projector + language model
        vision = CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=16,
            patch_size=8,
            projection_dim=32,
        )
        text = LlamaConfig(**{**_DECODER, "num_hidden_layers": 2})
        model = LlavaForConditionalGeneration(
            LlavaConfig(
                vision_config=vision,
                text_config=text,
                image_token_index=IMAGE_TOKEN,
                vision_feature_layer=-1,
                vision_feature_select_strategy="default",
            )
        )
    else:
        raise ValueError(kind)
    return model.train()


def batches(kind: str, n: int, seed: int = 1, batch: int = 2, seq: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, IMAGE_TOKEN, (batch, seq), generator=g)
        b = {"input_ids": ids, "labels": ids.clone()}
        if kind == "llava":
            ids[:, 1 : 1 + N_IMAGE_TOKENS] = IMAGE_TOKEN
            b["labels"] = torch.where(ids == IMAGE_TOKEN, -100, ids)
            b["pixel_values"] = torch.randn(batch, 3, 16, 16, generator=g)
        if kind == "t5":
            b["labels"] = torch.randint(1, IMAGE_TOKEN, (batch, seq // 2), generator=g)
        out.append(b)
    return out


def lora(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = {"gpt2": ["c_attn", "c_proj", "c_fc"], "t5": ["q", "k", "v", "o", "wi", "wo"]}
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=targets.get(kind, ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]),
        init_lora_weights=False,  # random A and B: every adapter gets a non-trivial gradient
        fan_in_fan_out=kind == "gpt2",
    )
    torch.manual_seed(123)
    return get_peft_model(model, cfg)
