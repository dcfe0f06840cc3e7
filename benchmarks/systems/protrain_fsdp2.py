"""ProTrain's FSDP2 engine (`fsdp_version: 2`), as `protrain train` runs it: the
application's `FSDP2Trainable` over a config with the row's settings.

`protrain_fsdp2` keeps the sharded parameters, gradients and AdamW on the GPU;
`protrain_fsdp2_offload` sets `fsdp_config.offload_params` (`CPUOffloadPolicy`, fused AdamW
on the host). Both: one unit per decoder layer (`TRANSFORMER_BASED_WRAP`, the discovered
blocks), every block recomputed in backward (`fsdp_config.activation_checkpointing`), bf16
compute with fp32 gradient reduction, the app's chunked loss where the row asks for it,
QLoRA's 4-bit base sharded in bf16. Unlike `fsdp2_offload` (raw FSDP2), this is the code a
user of `protrain train` runs.
"""

from __future__ import annotations

import torch

from materialize import build_for_mode
from systems import RowSpec, Trainer
from workloads import hf_config


def setup(spec: RowSpec) -> Trainer:
    import torch.distributed as dist

    from protrain.train.config import TrainConfig
    from protrain.train.fsdp2_trainable import FSDP2Trainable
    from protrain.train.loss import count_trained_tokens

    offload = spec.system == "protrain_fsdp2_offload"
    model = build_for_mode(hf_config(spec.model), spec.mode, spec.lora_rank, spec.device)
    cfg = TrainConfig.model_validate(
        {
            "fsdp_version": 2,
            "fsdp_config": {
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "activation_checkpointing": True,
                "offload_params": offload,
            },
            "mixed_precision": "bf16" if spec.device.type == "cuda" else "no",
            "learning_rate": spec.lr,
            "weight_decay": spec.weight_decay,
            "max_grad_norm": spec.max_grad_norm,
            "memory": {"chunked_loss_tokens": spec.chunked_loss_tokens}
            if spec.chunked_loss_tokens
            else {},
        }
    )
    compute = torch.bfloat16 if spec.device.type == "cuda" else None
    trainable = FSDP2Trainable(model, cfg, spec.device, compute)
    world = dist.get_world_size()

    def step(micro_batches: list[torch.Tensor]) -> torch.Tensor:
        # as the app: each rank divides by the tokens of the whole job's step (every rank's
        # micro-batches have the same shape) and the engine sums gradients over ranks
        n_tokens = sum(count_trained_tokens(ids) for ids in micro_batches)
        for i, input_ids in enumerate(micro_batches):
            batch = {"input_ids": input_ids, "labels": input_ids}
            loss_sum = trainable.forward_loss_sum(batch)
            last = i == len(micro_batches) - 1
            trainable.backward(loss_sum / (n_tokens * world), last=last)
        trainable.clip_grad_norm(spec.max_grad_norm)  # the norm is taken either way (logged)
        trainable.optimizer_step()
        return loss_sum.detach() * len(micro_batches) / n_tokens

    plan = {
        "engine": "fsdp2",
        "units": len(trainable.units) + 1,  # and the root
        "offload_params": offload,
        "activation_checkpointing": True,
    }
    return Trainer(step, plan)
