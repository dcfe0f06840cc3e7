"""The model-family matrix: one tiny random config per family (nothing downloaded).

Add a family by adding one ``Family`` to ``FAMILIES``: its ``model_type``, the config
overrides that make it tiny, and its kind (which ``Auto...`` class builds it and which
batch it takes). Every test in this folder runs over the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

VOCAB = 96
IMAGE_TOKEN = VOCAB - 1
BATCH, SEQ = 2, 12

# the sizes most decoder configs take by these names
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MOE = dict(_DECODER, intermediate_size=32)
_SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
)

_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               image_size=16)  # fmt: skip
# peft 0.21 refuses all-linear on Mamba models (out_proj): the projections it allows
_MAMBA_LORA = dict(target_modules=["in_proj", "x_proj", "dt_proj"])
N_IMAGE_TOKENS = 4


@dataclass(frozen=True)
class Family:
    model_type: str
    kind: str  # "dense", "moe", "hybrid", "seq2seq", "vlm"
    config: dict
    # peft LoraConfig arguments beyond target_modules="all-linear"
    lora: dict = field(default_factory=dict)
    # the MLP of every block can be tiled (token-wise, one tensor in and out)
    tiles: bool = True
    # a vision-language model's text and vision sub-configs, and its image inputs
    text: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)
    image: str = ""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        # dense decoders
        Family("llama", "dense", _DECODER),
        Family("qwen2", "dense", _DECODER),
        Family("qwen3", "dense", dict(_DECODER, head_dim=8)),
        Family("mistral", "dense", _DECODER),
        Family("gemma", "dense", dict(_DECODER, head_dim=8)),
        Family("gemma2", "dense", dict(_DECODER, head_dim=8, sliding_window=4)),
        Family("gemma3_text", "dense", dict(_DECODER, head_dim=8, sliding_window=4)),
        Family("phi3", "dense", _DECODER),
        Family("gpt_neox", "dense", dict(_DECODER, hidden_dropout=0.0, attention_dropout=0.0)),
        # mixture of experts, fused experts (4 experts, 2 per token)
        Family("qwen3_moe", "moe", dict(_MOE, moe_intermediate_size=32, num_experts=4,
                                        num_experts_per_tok=2)),
        Family("mixtral", "moe", dict(_MOE, num_local_experts=4, num_experts_per_tok=2)),
        Family("olmoe", "moe", dict(_MOE, num_experts=4, num_experts_per_tok=2)),
        # peft 0.21 puts Qwen2-MoE's fused experts under all-linear only when named
        Family("qwen2_moe", "moe", dict(_MOE, moe_intermediate_size=32, num_experts=4,
               num_experts_per_tok=2, shared_expert_intermediate_size=32),
               lora=dict(target_parameters=["mlp.experts.gate_up_proj",
                                            "mlp.experts.down_proj"])),
        # linear-attention and state-space layers (beside attention)
        Family("mamba", "hybrid", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
               state_size=8, expand=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
               tiles=False, lora=_MAMBA_LORA),
        Family("mamba2", "hybrid", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
               state_size=8, expand=2, num_heads=8, head_dim=8, n_groups=1, chunk_size=4,
               pad_token_id=0, bos_token_id=1, eos_token_id=2), tiles=False,
               lora=_MAMBA_LORA),
        # a linear-attention (Qwen3-Next) or Mamba (Jamba) layer both first (swapped, keeps
        # the cache) and second (recomputed, called without it)
        Family("qwen3_next", "hybrid", dict(_MOE, num_hidden_layers=3, head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
               linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
               layer_types=["linear_attention", "linear_attention", "full_attention"],
               moe_intermediate_size=32, shared_expert_intermediate_size=32)),
        Family("jamba", "hybrid", dict(_MOE, num_hidden_layers=3, attn_layer_period=3,
               attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
               num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
               mamba_dt_rank=4, use_mamba_kernels=False), tiles=False),
        Family("bamba", "hybrid", dict(_DECODER, attn_layer_indices=[1], mamba_n_heads=8,
               mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4,
               mamba_expand=2)),
        # encoder-decoders
        Family("t5", "seq2seq", dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
               num_layers=2, num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=2,
               decoder_start_token_id=0), tiles=False),
        Family("bart", "seq2seq", _SEQ2SEQ, tiles=False),
        Family("pegasus", "seq2seq", _SEQ2SEQ, tiles=False),
        Family("marian", "seq2seq", dict(_SEQ2SEQ, decoder_vocab_size=VOCAB), tiles=False),
        # vision-language: 4 image tokens a row
        Family("llava", "vlm", dict(image_token_index=IMAGE_TOKEN, vision_feature_layer=-1,
               vision_feature_select_strategy="default"), text=dict(_DECODER, model_type="llama"),
               vision=dict(_VISION, model_type="clip_vision_model", patch_size=8,
                           projection_dim=32), image="pixels"),
        Family("paligemma", "vlm", dict(image_token_index=IMAGE_TOKEN, projection_dim=32),
               text=dict(_DECODER, model_type="gemma", head_dim=8),
               vision=dict(_VISION, model_type="siglip_vision_model", patch_size=8,
                           projection_dim=32), image="pixels_and_token_types"),
        Family("gemma3", "vlm", dict(image_token_index=IMAGE_TOKEN, mm_tokens_per_image=4,
               boi_token_index=IMAGE_TOKEN - 2, eoi_token_index=IMAGE_TOKEN - 1),
               text=dict(_DECODER, model_type="gemma3_text", head_dim=8),
               vision=dict(_VISION, model_type="siglip_vision_model", patch_size=4),
               image="pixels_and_image_types"),
        Family("qwen2_vl", "vlm", dict(image_token_id=IMAGE_TOKEN,
               vision_start_token_id=IMAGE_TOKEN - 2, vision_end_token_id=IMAGE_TOKEN - 1),
               text=dict(_DECODER, model_type="qwen2_vl_text",
                         rope_scaling=dict(type="mrope", mrope_section=[1, 1, 2])),
               vision=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2),
               image="patches_and_grid"),
    ]
}  # fmt: skip


def build(name: str, seed: int = 0, vocab_size: int = VOCAB) -> nn.Module:
    """The family's tiny model, random weights from ``seed``, in train mode; ``vocab_size``
    replaces the vocabulary size of a text model (the app's tests use a real tokenizer's)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
    )

    family = FAMILIES[name]
    if family.kind == "vlm":
        config = AutoConfig.for_model(
            name, text_config=family.text, vision_config=family.vision, **family.config
        )
        auto = AutoModelForImageTextToText
    else:
        sizes = {k: vocab_size for k in ("vocab_size", "decoder_vocab_size") if k in family.config}
        config = AutoConfig.for_model(name, **{**family.config, **sizes})
        auto = AutoModelForSeq2SeqLM if family.kind == "seq2seq" else AutoModelForCausalLM
    torch.manual_seed(seed)
    return auto.from_config(config, dtype=torch.float32).train()


def n_layers(model: nn.Module) -> int:
    """Layers the model's config declares (encoder and decoder, vision and text)."""
    config = model.config
    if FAMILIES[config.model_type].kind == "seq2seq":
        enc = getattr(config, "encoder_layers", None) or config.num_layers
        dec = getattr(config, "decoder_layers", None) or config.num_decoder_layers or enc
        return enc + dec
    if FAMILIES[config.model_type].kind == "vlm":
        return config.vision_config.num_hidden_layers + config.text_config.num_hidden_layers
    return config.num_hidden_layers


def lora_all_linear(model: nn.Module, name: str) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    kwargs = {"target_modules": "all-linear", **FAMILIES[name].lora}
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **kwargs)
    torch.manual_seed(123)
    return get_peft_model(model, cfg)


def batches(name: str, n: int, seed: int = 1, seq: int = SEQ) -> list[dict]:
    """``n`` batches of ``seq`` tokens of the family's inputs with a right-padded row (its
    tail masked and not trained), and the model's default ``use_cache``."""
    family = FAMILIES[name]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, IMAGE_TOKEN, (BATCH, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        ids[1, -3:] = 0
        b = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        if family.kind == "seq2seq":
            labels = torch.randint(3, IMAGE_TOKEN, (BATCH, seq // 2), generator=g)
            labels[1, -2:] = -100
            b["labels"] = labels
        if family.kind == "vlm":
            b.update(_image_inputs(family.image, ids, g))
            b["labels"] = b["labels"].masked_fill(ids == IMAGE_TOKEN, -100)
        out.append(b)
    return out


def _image_inputs(image: str, ids: torch.Tensor, g: torch.Generator) -> dict:
    """One 16x16 image a row, its ``N_IMAGE_TOKENS`` tokens after the first (``ids`` edited),
    in the form the family's processor gives it."""
    ids[:, 1 : 1 + N_IMAGE_TOKENS] = IMAGE_TOKEN
    is_image = (ids == IMAGE_TOKEN).long()
    if image == "patches_and_grid":  # Qwen2-VL: flattened 4x4 patches, 2 frames, merged 2x2
        return {
            "pixel_values": torch.randn(BATCH * 16, 3 * 2 * 4 * 4, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * BATCH),
            "mm_token_type_ids": is_image,
        }
    out = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)}
    if image == "pixels_and_token_types":  # PaliGemma: the prefix (image and prompt) is 0
        out["token_type_ids"] = (torch.arange(ids.shape[1]) > N_IMAGE_TOKENS).long().expand_as(ids)
    if image == "pixels_and_image_types":  # Gemma 3: image tokens are 1
        out["token_type_ids"] = is_image
    return out
