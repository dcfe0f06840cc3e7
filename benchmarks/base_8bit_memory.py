"""Device bytes of a LoRA model's chunks over three frozen bases: bf16, bitsandbytes' int8
(LLM.int8, ``quant/eight_bit.py``) and NF4 (``quant/four_bit.py``), for a Llama-3-8B shape.

LoRA of rank 16 on every projection (the benchmarks' ``materialize.add_lora``), every chunk
persistent, the compute dtype bf16. Per base:

- **planned**: the chunk table the planner reads (``profile.chunk_table`` over the quantized
  model), its used bytes split into the projections' frozen weights (bf16, int8, or packed
  4-bit), their quantization state (int8: fp32 scales, one per output row; NF4: uint8 block
  scales, one per 64 weights, and their fp32 scales), the other frozen parameters
  (embeddings, norms, head) and the LoRA adapters; plus the whole chunks and the device
  optimizer's bytes (``plan/memory.py``: fp32 masters, moments, step), the model states of
  a plan with every chunk persistent;
- **measured**: the model built one decoder layer at a time (filled and quantized on the
  device, kept on the host: the bf16 8B model never exists on the device outside chunks),
  then ``protrain.wrap(model, n_persist=<all chunks>)``: on CUDA the allocator's growth over
  wrap (chunks and masters), after one step at batch 1 (chunks, masters and AdamW state)
  and its peak over that step; on the CPU (``measured_by: chunk_buffers``) the bytes of the
  chunk manager's buffers, the masters and the optimizer's state tensors instead.

One JSON line per base, with its saving against bf16. ``--tiny``: the tiny Llama of the
benchmark matrix, on the CPU, for a test run (13 s on 2 cores). The planner's count for the
int8 base of the 8B shape (built on a 2-core CPU in 200 s, not wrapped): 9.17 GB in 9
chunks of 1.05 GB (projections 6.98 GB, their scales 5.5 MB, embeddings, norms and head
2.10 GB, adapters 84 MB), 9.96 GB of model states with the adapters' AdamW.

Usage: ``python benchmarks/base_8bit_memory.py [--tiny] [--device cuda] [--out r.jsonl]``
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protrain  # noqa: E402
from materialize import _fill, _rebuild_rotary_buffers, add_lora  # noqa: E402
from protrain.plan.memory import device_optimizer_bytes  # noqa: E402
from protrain.profile.chunk_table import chunk_table_and_index  # noqa: E402
from protrain.profile.param_index import param_index  # noqa: E402
from protrain.quant import quantize_linear_4bit, quantize_linear_8bit  # noqa: E402
from workloads import LORA_RANK, hf_config  # noqa: E402

BASES = ("bf16", "int8", "nf4")
COMPUTE_DTYPE = torch.bfloat16
# the quantization state lifted into parameters (quant/eight_bit.py, quant/four_bit.py)
STATE_NAMES = ("quant_scb", "quant_absmax", "quant_absmax2")


@torch.no_grad()
def build(shape: str, base: str, fill_device: torch.device) -> nn.Module:
    """The LoRA model of ``base`` on the host, one decoder layer at a time: each layer is
    allocated on the host, filled on ``fill_device`` and quantized there (as
    ``materialize.build_qlora``, for every base)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(shape),
                                                              dtype=torch.bfloat16)  # fmt: skip
    model.config.use_cache = False
    for layer in model.get_decoder().layers:
        layer.to_empty(device="cpu")
        for name, param in layer.named_parameters():
            _fill(name, param, fill_device)
        if base == "int8":
            quantize_linear_8bit(layer, quant_device=fill_device)
        elif base == "nf4":
            quantize_linear_4bit(layer, compute_dtype=COMPUTE_DTYPE, quant_device=fill_device)
    for name, module in model.named_modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            for pname, param in module.named_parameters(recurse=False):
                _fill(f"{name}.{pname}", param, fill_device)
    model.tie_weights()
    _rebuild_rotary_buffers(model, torch.device("cpu"))
    # what transformers sets on a model it loads quantized: PEFT's 8-/4-bit LoRA layers
    model.is_loaded_in_8bit = base == "int8"
    model.is_loaded_in_4bit = base == "nf4"
    return add_lora(model, LORA_RANK)


def projections(model: nn.Module) -> dict:
    """Elements and output rows of the projections LoRA wraps (the layers quantized)."""
    layers = [m.base_layer for m in model.modules() if hasattr(m, "lora_A")]
    return {
        "projection_params": sum(m.in_features * m.out_features for m in layers),
        "projection_rows": sum(m.out_features for m in layers),
        "projection_layers": len(layers),
    }


def planned(model: nn.Module) -> tuple[dict, int]:
    """The planner's bytes for ``model`` with every chunk persistent, and its chunk count."""
    index = param_index(model)
    table, _ = chunk_table_and_index(model, compute_dtype=COMPUTE_DTYPE, index=index)
    _, nbytes, trainable = index.arrays(COMPUTE_DTYPE)
    first = [names[0] for names, _ in index.params]
    state = np.asarray([n.rsplit(".", 1)[-1] in STATE_NAMES for n in first])
    weight = np.asarray([n.endswith(".base_layer.weight") for n in first])
    optimizer = int(device_optimizer_bytes(table.trainable_numel, table.trainable_tensors).sum())
    chunks = table.n_chunks * table.chunk_size_bytes
    if sum(table.used_bytes) != int(nbytes.sum()):  # the split below must cover the table
        raise RuntimeError("the chunk table and the parameter index disagree")
    row = {
        "chunk_size_bytes": table.chunk_size_bytes,
        "n_chunks": table.n_chunks,
        "planned_used_bytes": sum(table.used_bytes),
        "planned_frozen_bytes": sum(table.frozen_bytes),
        "planned_projection_weight_bytes": int(nbytes[weight & ~trainable].sum()),
        "planned_quant_state_bytes": int(nbytes[state & ~trainable].sum()),
        "planned_other_frozen_bytes": int(nbytes[~weight & ~state & ~trainable].sum()),
        "planned_trainable_bytes": sum(table.trainable_bytes),
        "planned_chunk_bytes": chunks,
        "planned_optimizer_bytes": optimizer,
        "planned_states_bytes": chunks + optimizer,
    }
    return row, table.n_chunks


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def measured(model: nn.Module, n_chunks: int, device: torch.device, seq: int) -> dict:
    """Wrap with every chunk persistent, step once; the device bytes (see the docstring)."""
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
    before = allocated(device)
    model, opt, layout = protrain.wrap(model, n_persist=n_chunks, device=device,
                                       compute_dtype=COMPUTE_DTYPE)  # fmt: skip
    if layout.n_chunks != n_chunks or layout.n_persist != n_chunks:
        raise RuntimeError(f"wrap laid out {layout.n_chunks} chunks ({layout.n_persist} "
                           f"persistent), the planner's table {n_chunks}")  # fmt: skip
    row = {}
    if cuda:
        torch.cuda.synchronize(device)
        row["wrap_allocated_bytes"] = allocated(device) - before
        torch.cuda.reset_peak_memory_stats(device)
    vocab = model.get_base_model().config.vocab_size
    ids = torch.randint(vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    if cuda:
        torch.cuda.synchronize(device)
        row["states_allocated_bytes"] = allocated(device) - before
        row["step_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) - before
    # the engine's own tensors, as engine_probe.py reads them: the chunks' buffers, the
    # persistent chunks' fp32 masters, and their device AdamW's state after the step
    engine = model._protrain_engine
    slots = engine.manager.slots()
    row["chunk_buffer_bytes"] = sum(c.device_buffer.untyped_storage().nbytes()
                                    for c in engine.manager.chunks)  # fmt: skip
    row["master_bytes"] = sum(s.master.untyped_storage().nbytes() for s in slots
                              if s.master is not None)  # fmt: skip
    inner = opt._device_opt[0]
    row["optimizer_state_bytes"] = sum(v.untyped_storage().nbytes()
                                       for st in inner.state.values() for v in st.values()
                                       if torch.is_tensor(v))  # fmt: skip
    row["states_buffer_bytes"] = (row["chunk_buffer_bytes"] + row["master_bytes"]
                                  + row["optimizer_state_bytes"])  # fmt: skip
    row["measured_by"] = "allocator" if cuda else "chunk_buffers"
    row["measured_states_bytes"] = row["states_allocated_bytes" if cuda else "states_buffer_bytes"]
    protrain.close(model, keep_weights=False)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny Llama on the CPU")
    ap.add_argument("--device", default=None, help="default: cuda when present (cpu: --tiny)")
    ap.add_argument("--bases", default=",".join(BASES), help="comma-separated, bf16 first")
    ap.add_argument("--seq", type=int, default=None, help="tokens of the step (512; tiny 32)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    args = ap.parse_args()
    shape = "tiny" if args.tiny else "llama8b"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny
                                          else "cpu"))  # fmt: skip
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    seq = args.seq or (32 if args.tiny else 512)
    bases = args.bases.split(",")
    if not set(bases) <= set(BASES):
        raise SystemExit(f"--bases: choose among {BASES}")
    if device.type == "cuda":  # the default stream's cuBLAS workspace, before any base
        x = torch.ones(64, 64, device=device, dtype=COMPUTE_DTYPE, requires_grad=True)
        (x @ x).sum().backward()
    bf16 = None
    for base in bases:
        torch.manual_seed(0)
        model = build(shape, base, device)
        row = {
            "bench": "base_8bit_memory", "shape": shape, "base": base, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "lora_rank": LORA_RANK, "seq": seq, **projections(model),
        }  # fmt: skip
        plan, n_chunks = planned(model)
        row.update(plan)
        row.update(measured(model, n_chunks, device, seq))
        del model
        gc.collect()
        if base == "bf16":
            bf16 = row
        if bf16 is not None:
            row["saved_vs_bf16_planned_bytes"] = (
                bf16["planned_states_bytes"] - row["planned_states_bytes"]
            )
            row["saved_vs_bf16_measured_bytes"] = (bf16["measured_states_bytes"]
                                                   - row["measured_states_bytes"])  # fmt: skip
        row.update({k.removesuffix("_bytes") + "_gb": round(v / 1e9, 3) for k, v in list(row.items())
                    if k.endswith("_bytes") and k != "chunk_size_bytes"})  # fmt: skip
        print(json.dumps(row), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
