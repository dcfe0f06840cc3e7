"""The models and workloads of the benchmark matrix (shared/BENCHMARKS.md), as data.

Shapes are those of the public model cards; weights are random. `tiny` is a model of the
same family small enough for a CPU test.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_SHAPES: dict[str, dict] = {
    "llama1b": dict(  # Llama-3.2-1B
        family="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama3b": dict(  # Llama-3.2-3B
        family="llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama8b": dict(  # Llama-3-8B
        family="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    "qwen14b": dict(  # Qwen2.5-14B
        family="qwen2",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    "llama70b": dict(  # Llama-3-70B
        family="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    "qwen3moe30b": dict(  # Qwen3-30B-A3B: 128 fused experts a layer, 8 routed a token
        family="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    # Held-out families (plan accuracy): numbers from the public config.json of each checkpoint.
    "qwen7b": dict(  # Qwen2.5-7B: q/k/v projections with bias (Qwen2Config's default)
        family="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    "mistral7b": dict(  # Mistral-7B-v0.3: the v0.2 body with a 32,768-token vocabulary
        family="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,  # v0.2 and later attend over the whole context
        rope_theta=1000000.0,
    ),
    "tiny": dict(
        family="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    # the held-out families' code paths (Qwen2 with q/k/v bias, Mistral) at CPU size
    "tiny-qwen2": dict(
        family="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    "tiny-mistral": dict(
        family="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        rope_theta=1000000.0,
    ),
}


@dataclass(frozen=True)
class Workload:
    model: str
    mode: str  # "full", "lora" or "qlora" (4-bit NF4 base)
    batches: tuple[int, ...]
    seq: int
    budget_gib: float
    systems: tuple[str, ...]  # the row of the matrix, protrain first


WORKLOADS: dict[str, Workload] = {
    "fits": Workload("llama1b", "full", (1, 8), 2048, 80, ("protrain", "plain")),
    "full-3b": Workload(
        "llama3b",
        "full",
        (4,),
        2048,
        24,
        ("protrain", "plain", "fsdp2_offload", "ds_z3_offload", "ds_z2_offload"),
    ),
    "full-8b": Workload(
        "llama8b",
        "full",
        (4,),
        2048,
        80,
        ("protrain", "plain", "fsdp2_offload", "ds_z3_offload", "ds_z2_offload"),
    ),
    "lora-14b": Workload(
        "qwen14b", "lora", (4,), 2048, 24, ("protrain", "plain", "fsdp2_offload", "ds_z3_offload")
    ),
    # LoRA where the model fits the whole GPU: the compute path (kernels) decides the speed
    "lora-8b": Workload("llama8b", "lora", (2, 4), 2048, 80, ("protrain", "plain", "plain_liger")),
    "lora-14b-fits": Workload(
        "qwen14b", "lora", (2, 4), 2048, 80, ("protrain", "plain", "plain_liger")
    ),
    # LoRA, peft's all-linear: attention, router and the fused experts (through peft's
    # ParamWrapper): 1.0 B trainable beside a 30.5 B bf16 base (61 GB, on the host)
    "lora-moe30b": Workload("qwen3moe30b", "lora", (4,), 2048, 24, ("protrain", "fsdp2_offload")),
    # none of the baselines fits: the 4-bit base alone is 35 GB
    "qlora-70b": Workload("llama70b", "qlora", (1,), 2048, 24, ("protrain",)),
}

SYSTEMS = (
    "plain",
    # plain with Liger Kernel's RMSNorm, SwiGLU, RoPE and fused linear CE (axolotl's plugin)
    "plain_liger",
    "fsdp2_offload",
    "ds_z3_offload",
    "ds_z2_offload",
    "protrain",
    # ProTrain's FSDP2 engine (fsdp_version: 2), parameters on the GPU or offloaded
    "protrain_fsdp2",
    "protrain_fsdp2_offload",
)
LORA_RANK = 16


def hf_config(model: str):
    """A transformers config of the named shape."""
    import transformers

    shape = dict(MODEL_SHAPES[model])
    family = shape.pop("family")
    rope_theta = shape.pop("rope_theta")
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mistral": transformers.MistralConfig,
    }[family]
    config = cls(
        **shape,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        use_cache=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return config


# Vision-language shapes (the plan-accuracy VLM row): the text model and the vision tower, from
# the public config.json of Qwen2.5-VL-7B-Instruct (the vision tower's hidden size is 1280;
# transformers' Qwen2_5_VLVisionConfig defaults it to 3584). `qwen25vl-tiny` is the same
# architecture small enough for a CPU run.
VLM_SHAPES: dict[str, dict] = {
    "qwen25vl7b": dict(
        text=dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            mrope_section=[16, 24, 24],
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
            tokens_per_second=2,
        ),
    ),
    "qwen25vl-tiny": dict(
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            mrope_section=[2, 3, 3],
        ),
        vision=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
    ),
}


def hf_vlm_config(model: str, token_ids: dict[str, int]):
    """A transformers Qwen2.5-VL config of the named shape; `token_ids`: the ids of the
    tokenizer's image, video, vision-start and vision-end tokens (`image_token_id`, ...)
    and of its `eos_token_id` and `pad_token_id`."""
    import transformers

    shape = VLM_SHAPES[model]
    text = dict(shape["text"])
    rope = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
            "mrope_section": text.pop("mrope_section")}  # fmt: skip
    ids = dict(token_ids)
    special = {k: ids.pop(k) for k in ("eos_token_id", "pad_token_id") if k in ids}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(text, rope_parameters=rope, use_cache=False, bos_token_id=None, **special),
        vision_config=dict(shape["vision"]),
        tie_word_embeddings=text["tie_word_embeddings"],
        **ids,
    )
    config.use_cache = False
    return config
