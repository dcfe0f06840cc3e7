"""Plain PyTorch: fp32 master weights on the GPU (bf16 base for LoRA), autocast bf16,
fused AdamW on the GPU."""

from __future__ import annotations

import torch

from materialize import build_on_meta, materialize
from protrain.train.planning import planner_loss
from systems import RowSpec, Trainer
from workloads import hf_config


def setup(spec: RowSpec) -> Trainer:
    dtype = torch.bfloat16 if spec.mode == "lora" else torch.float32
    model = build_on_meta(hf_config(spec.model), dtype, spec.lora_rank)
    model.set_attn_implementation(spec.attn)
    materialize(model, spec.device, fill_device=spec.device)
    if spec.checkpointing:
        enable_checkpointing(model)
    model.train()
    return adamw_trainer(model, spec, autocast=True)


def adamw_trainer(model: torch.nn.Module, spec: RowSpec, *, autocast: bool) -> Trainer:
    """One step of torch's fused AdamW over the trainable parameters, clipped as the row
    says; `autocast` adds bf16 autocast (plain), off where the wrapper casts (FSDP2)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
    packed = pack_positions(spec) if spec.pack_samples else {}
    chunked = (
        planner_loss(spec.device, spec.chunked_loss_tokens) if spec.chunked_loss_tokens else None
    )

    def step(micro_batches: list[torch.Tensor]) -> torch.Tensor:
        for input_ids in micro_batches:  # the mean over micro-batches, as the app's loop
            with torch.autocast(spec.device.type, dtype=torch.bfloat16, enabled=autocast):
                if chunked is None:
                    loss = model(input_ids=input_ids, labels=input_ids, **packed).loss
                else:  # the app's chunked loss: no (tokens x vocab) logits tensor at once
                    loss = chunked(model, {"input_ids": input_ids, "labels": input_ids, **packed})
            (loss / len(micro_batches)).backward()
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return Trainer(step)


def pack_positions(spec: RowSpec) -> dict[str, torch.Tensor]:
    """The forward's arguments of a packed row: ``position_ids`` restarting at 0 for each of
    ``pack_samples`` samples (the last one takes the remainder), no attention mask, as the
    app's padding-free collator gives them; transformers derives the samples from them."""
    n, k = spec.seq, spec.pack_samples
    lengths = [n // k] * (k - 1) + [n - (n // k) * (k - 1)]
    positions = torch.cat([torch.arange(m) for m in lengths]).to(spec.device)
    return {"position_ids": positions.expand(spec.batch, n)}


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face activation checkpointing of every decoder layer, non-reentrant."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # LoRA: frozen embeddings, checkpointed layers
