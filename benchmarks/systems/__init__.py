"""The systems compared: each module's `setup(spec)` builds the model and returns a `Trainer`.

A system owns everything between the random batch and the finished optimizer step: where
weights live, mixed precision, sharding and offload, and the optimizer. All of them use bf16
compute, AdamW, global-norm clipping (`max_grad_norm`, 1.0 unless turned off) and
activation checkpointing of every decoder layer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class RowSpec:
    workload: str
    system: str
    model: str
    mode: str  # "full" or "lora"
    batch: int
    seq: int
    budget_gib: float | None  # None: no budget emulation
    device: torch.device
    lora_rank: int | None
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # None: no clipping
    n_persist: int | None = None
    n_buffer: int | None = None
    chunk_size_bytes: int | None = None  # protrain only
    host_threads: int | None = None  # protrain only: the host AdamW's intra-op threads
    n_device_step: int | None = None  # protrain only: offloaded chunks stepped on the GPU
    auto: bool = False  # protrain only: the planner picks the knobs for budget_gib
    device_step_search: bool = False  # protrain --auto: the planner picks n_device_step too
    chunked_loss_tokens: int | None = None  # protrain and plain: the app's chunked loss
    distributed_mode: str | None = None  # protrain only, several ranks: sharded | replicated
    world_size: int = 1  # ranks under torchrun; batch is per rank
    checkpointing: bool = True  # plain, protrain with fixed knobs: HF recompute of every layer
    profiles: Path | None = None  # protrain --auto: write the planner's profiles here
    grad_accum: int = 1  # micro-batches of `batch` rows per optimizer step
    optimizer_state: str = "fp32"  # protrain only: the host's Adam moments (fp32, bf16, 8bit)
    kernels: str = "none"  # protrain only: model.kernels (auto | none), Liger's fused kernels
    attn: str = "sdpa"  # plain, plain_liger: the model's attn_implementation
    # plain, plain_liger: > 0 makes each row one pack of this many samples of seq / k tokens
    # (position_ids restart at each), as sample_packing lays out a micro-batch
    pack_samples: int = 0


@dataclass
class Trainer:
    """One training step of a system, and what the system says about itself."""

    # one optimizer step over micro-batches: input_ids (also labels) of each -> last loss
    step: Callable[[list[torch.Tensor]], torch.Tensor]
    plan: dict | None = None
    predicted_peak_gib: float | None = None
    predicted_step_s: float | None = None
    extras: Callable[[], dict] = field(default=lambda: {})  # per-step figures, e.g. copy_wait_s


_MODULES = {
    "plain": "systems.plain",
    "plain_liger": "systems.plain_liger",
    "fsdp2_offload": "systems.fsdp2_offload",
    "ds_z3_offload": "systems.deepspeed_offload",
    "ds_z2_offload": "systems.deepspeed_offload",
    "protrain": "systems.protrain_engine",
    "protrain_fsdp2": "systems.protrain_fsdp2",
    "protrain_fsdp2_offload": "systems.protrain_fsdp2",
}


def setup(spec: RowSpec) -> Trainer:
    return importlib.import_module(_MODULES[spec.system]).setup(spec)
