"""Plain PyTorch with Liger Kernel, as axolotl's `liger_kernel` plugin applies it: before
the model is built, Liger's per-family function patches the family's classes (RMSNorm,
SwiGLU MLP, RoPE, and the causal LM's forward with the fused linear cross-entropy, which
never materializes the logits); then the row runs as `plain` (PEFT LoRA, autocast bf16,
fused AdamW, checkpointing as the row says). Needs a CUDA GPU (Triton)."""

from __future__ import annotations

import torch

from materialize import build_on_meta, materialize
from systems import RowSpec, Trainer
from systems.plain import adamw_trainer, enable_checkpointing
from workloads import hf_config


def setup(spec: RowSpec) -> Trainer:
    import liger_kernel.transformers as liger

    config = hf_config(spec.model)
    # axolotl's plugin: rope, rms_norm, glu activation and fused linear cross-entropy on,
    # the plain cross-entropy off (they exclude each other)
    getattr(liger, f"apply_liger_kernel_to_{config.model_type}")(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
    )
    dtype = torch.bfloat16 if spec.mode == "lora" else torch.float32
    model = build_on_meta(config, dtype, spec.lora_rank)
    model.set_attn_implementation(spec.attn)
    materialize(model, spec.device, fill_device=spec.device)
    if spec.checkpointing:
        enable_checkpointing(model)
    model.train()
    return adamw_trainer(model, spec, autocast=True)
