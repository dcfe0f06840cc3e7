"""FSDP2 on one rank: `fully_shard` per decoder layer and at the root with
`CPUOffloadPolicy(pin_memory=True)`, bf16 parameters in compute, fp32 gradient reduction,
fused AdamW on the CPU over the sharded fp32 parameters."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from materialize import build_on_meta, materialize
from protrain.model import discover_blocks
from systems import RowSpec, Trainer
from systems.plain import adamw_trainer, enable_checkpointing
from workloads import hf_config


def init_single_rank_group(device: torch.device) -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=0, world_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(spec: RowSpec) -> Trainer:
    init_single_rank_group(spec.device)
    dtype = torch.bfloat16 if spec.mode == "lora" else torch.float32
    model = build_on_meta(hf_config(spec.model), dtype, spec.lora_rank)
    # With CPU offload FSDP2 wants its sharded parameters on the host before sharding.
    materialize(model, "cpu", fill_device=spec.device)
    if spec.checkpointing:
        enable_checkpointing(model)
    model.train()
    policy = dict(
        # pinning needs an accelerator: the CPU-only check of the harness runs unpinned
        offload_policy=CPUOffloadPolicy(pin_memory=spec.device.type == "cuda"),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    for block in discover_blocks(model).blocks:
        fully_shard(block.module, **policy)
    fully_shard(model, **policy)
    return adamw_trainer(model, spec, autocast=False)
