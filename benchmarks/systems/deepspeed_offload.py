"""DeepSpeed baselines on one rank: bf16, AdamW (DeepSpeed's CPU Adam), clipping at
`max_grad_norm`.

`ds_z3_offload`: ZeRO-3 with parameters and optimizer state offloaded to pinned host
memory; the model is built under `zero.Init` (through transformers' `HfDeepSpeedConfig`)
so that it is partitioned as it is built. `ds_z2_offload`: ZeRO-2 with the optimizer
offloaded to pinned host memory (ZeRO-Offload).
"""

from __future__ import annotations

import torch

from materialize import build_on_meta, materialize
from systems import RowSpec, Trainer
from systems.fsdp2_offload import init_single_rank_group
from systems.plain import enable_checkpointing
from workloads import hf_config


def ds_config(spec: RowSpec) -> dict:
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    zero = {"stage": 3 if spec.system == "ds_z3_offload" else 2, "offload_optimizer": pinned_cpu}
    if spec.system == "ds_z3_offload":
        zero["offload_param"] = pinned_cpu
    zero.update(overlap_comm=True, contiguous_gradients=True)
    return {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "gradient_clipping": spec.max_grad_norm or 0.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": spec.lr, "weight_decay": spec.weight_decay},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def setup(spec: RowSpec) -> Trainer:
    try:
        import deepspeed
    except ImportError as e:
        raise RuntimeError(
            f"DeepSpeed is not installed ({e}); see benchmarks/README.md for the install"
        ) from e
    from transformers.integrations import HfDeepSpeedConfig

    torch.cuda.set_device(spec.device)
    init_single_rank_group(spec.device)
    config = ds_config(spec)
    dtype = torch.bfloat16 if spec.mode == "lora" else torch.float32
    hf_config_ = hf_config(spec.model)
    if spec.system == "ds_z3_offload":
        keep_alive = HfDeepSpeedConfig(config)  # makes from_config build under zero.Init
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(hf_config_, dtype=dtype)
        model.config.use_cache = False
        if spec.lora_rank is not None:
            import peft

            model = peft.get_peft_model(
                model,
                peft.LoraConfig(
                    r=spec.lora_rank,
                    lora_alpha=2 * spec.lora_rank,
                    lora_dropout=0.0,
                    target_modules="all-linear",
                ),
            )
    else:
        keep_alive = None
        model = build_on_meta(hf_config_, dtype, spec.lora_rank)
        materialize(model, "cpu", fill_device=spec.device)
    if spec.checkpointing:
        enable_checkpointing(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)

    def step(micro_batches: list[torch.Tensor]) -> torch.Tensor:
        _ = keep_alive
        for input_ids in micro_batches:  # DeepSpeed scales the loss and steps at the boundary
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(loss)
            engine.step()
        return loss

    return Trainer(step)
