"""Device bytes of the optimizer of the persistent chunks: torch's AdamW against
bitsandbytes' 8-bit AdamW (``optimizer="adamw_8bit"``), for a Llama-3-8B shape.

Two numbers per optimizer, for full fine-tuning with every chunk persistent:

- **planned**: what the memory model counts (``plan/memory.py``:
  ``device_optimizer_bytes`` over the chunk table of the model built on the meta device,
  plus the 8-bit quantization maps), fp32 masters included;
- **measured**: the engine's device optimizer (``optim/adamw_8bit.device_adamw``) stepped
  once over an fp32 parameter of each distinct trainable shape, times the shape's count:
  the bytes of the state it made (``state_bytes``) and, on CUDA, the allocator's growth
  over the step (``allocated_bytes``: rounding included), each plus the fp32 masters.

One JSON line per optimizer, and one with the saving. ``--tiny``: the tiny Llama of the
benchmark matrix, on the CPU, for a test run. On a 2-core CPU (``--device cpu``, 1m08s,
23 GB of host memory): fp32 AdamW 96.36 GB (masters 32.12 GB included), 8-bit 48.43 GB
measured and 48.44 GB planned (the count's bound: 7.2 MB over).

Usage: ``python benchmarks/optim_8bit_memory.py [--tiny] [--device cuda] [--out r.jsonl]``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protrain.optim.adamw_8bit import (  # noqa: E402
    MIN_8BIT_SIZE,
    OPTIMIZERS,
    QMAP_BYTES,
    device_adamw,
)
from protrain.plan.memory import device_optimizer_bytes  # noqa: E402
from protrain.profile.chunk_table import chunk_table  # noqa: E402
from workloads import MODEL_SHAPES  # noqa: E402


def build_meta(shape_name: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {k: v for k, v in MODEL_SHAPES[shape_name].items() if k != "family"}
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**shape))


def planned_bytes(model: torch.nn.Module, optimizer: str) -> int:
    table = chunk_table(model, compute_dtype=torch.bfloat16)
    total = int(device_optimizer_bytes(table.trainable_numel, table.trainable_tensors,
                                       optimizer).sum())  # fmt: skip
    big = max(table.max_trainable_numel) >= MIN_8BIT_SIZE
    return total + (QMAP_BYTES if optimizer == "adamw_8bit" and big else 0)


def measured_bytes(model: torch.nn.Module, optimizer: str, device: torch.device) -> dict:
    """The optimizer's state over one fp32 parameter of each distinct shape, times its count
    (one tensor at a time: an 8B model's fp32 masters would not fit beside their state)."""
    shapes = Counter(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    state = allocated = masters = 0
    maps: set[int] = set()
    for shape, count in shapes.items():
        p = torch.nn.Parameter(torch.zeros(shape, device=device))
        p.grad = torch.full(shape, 1e-3, device=device)
        opt = device_adamw([dict(params=[p], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.0)], optimizer)  # fmt: skip
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        opt.step()
        has_maps = "qmap1" in opt.state[p]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            grown = torch.cuda.memory_allocated(device) - before
            # each optimizer here moves its own maps to the device: counted once, below
            allocated += count * (grown - (QMAP_BYTES if has_maps else 0))
        own = 0
        for key, value in opt.state[p].items():
            if not torch.is_tensor(value):
                continue
            if key in ("qmap1", "qmap2"):  # one map for every tensor
                maps.add(value.untyped_storage().data_ptr())
                continue
            own += value.untyped_storage().nbytes()
        state += count * own
        masters += count * 4 * p.numel()
        del opt, p
    map_bytes = QMAP_BYTES if maps else 0
    row = {"state_bytes": state + map_bytes + masters}
    if device.type == "cuda":
        row["allocated_bytes"] = allocated + map_bytes + masters
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny Llama on the CPU")
    ap.add_argument("--device", default=None, help="default: cuda when present (cpu: --tiny)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    args = ap.parse_args()
    shape = "tiny" if args.tiny else "llama8b"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny
                                          else "cpu"))  # fmt: skip
    model = build_meta(shape)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = []
    for optimizer in OPTIMIZERS:
        rows.append({
            "bench": "optim_8bit_memory", "shape": shape, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "optimizer": optimizer, "trainable_params": n_params,
            "planned_bytes": planned_bytes(model, optimizer),
            **measured_bytes(model, optimizer, device),
        })  # fmt: skip
    fp32, q = rows
    rows.append({
        "bench": "optim_8bit_memory", "shape": shape, "device": str(device),
        "fp32_masters_bytes": 4 * n_params,
        "saved_planned_bytes": fp32["planned_bytes"] - q["planned_bytes"],
        "saved_state_bytes": fp32["state_bytes"] - q["state_bytes"],
        "planned_minus_state_bytes_8bit": q["planned_bytes"] - q["state_bytes"],
        "planned_minus_state_bytes_fp32": fp32["planned_bytes"] - fp32["state_bytes"],
    })  # fmt: skip
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out is not None:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
