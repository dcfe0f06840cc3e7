"""Search time at scale (the target: well under a second for models with hundreds of chunks
and a hundred blocks), on the machine this runs on: a 100-layer tiny Llama traced on the CPU with
small chunks (about 250 of them), then one search at the traced chunk size and the search
over candidate chunk sizes that auto mode runs (``plan.chunk_size.search_chunk_sizes``).
One JSON row to ``--out``; nothing here asserts a time::

    python benchmarks/search_time.py --out benchmarks/results/search-time.jsonl

With ``--profile`` (a profile that ``plan_accuracy.py --profiles`` kept) it times the search of
auto mode on that real profile instead, the model built on the meta device from a benchmark
shape (``--shape``, LoRA of ``--lora-rank`` on every linear layer: the parameter names and
shapes the chunk-size search re-reads; with ``--four-bit`` the decoder's linear layers are
4-bit layers of the real shapes, so the search does the same work as in the GPU run)::

    python benchmarks/search_time.py --profile qlora-70b.profile.json.gz \
        --hardware qlora-70b.hardware.json --shape llama70b --lora-rank 16 --budget-gib 24 \
        --four-bit
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "profile"))
sys.path.insert(0, str(ROOT / "tests" / "plan"))


def main(argv: list[str] | None = None) -> int:
    import plan_synthetic as syn
    import tiny_llama

    from protrain.knobs import Knobs
    from protrain.plan import PlanProblem, PlanRequest, search
    from protrain.plan.chunk_size import chunk_size_candidates, search_chunk_sizes
    from protrain.profile.trace import trace_model

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--chunk-bytes", type=int, default=70_000)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "search-time.jsonl"))
    p.add_argument("--profile", help="a kept model profile (.json.gz) to search on")
    p.add_argument("--hardware", help="its hardware profile (.json)")
    p.add_argument("--shape", help="benchmarks/workloads.py model shape of that profile")
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument(
        "--clipping", action="store_true",
        help="plan for clipping (plan_accuracy.py's default, max_grad_norm 1.0); without it, "
             "for training without clipping (as the qlora-70b row runs)",
    )  # fmt: skip
    p.add_argument(
        "--four-bit", action="store_true",
        help="with --profile: the decoder layers' linear layers as 4-bit NF4 layers (one "
             "layer quantized on the CPU, its shapes copied to the others on the meta device)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.profile:
        if not (args.hardware and args.shape):
            p.error("--profile needs --hardware (its hardware profile) and --shape (its model)")
        return _on_profile(args)
    model = tiny_llama.build(layers=args.layers)
    profile = trace_model(
        model,
        tiny_llama.batch(),
        device="cpu",
        knobs=Knobs(n_persist=0, chunk_size_bytes=args.chunk_bytes),
    )
    hw = syn.hardware("cuda")  # a GPU's rates: the search over overlapping terms
    budget = 2 * sum(profile.chunks.used_bytes)
    t0 = time.perf_counter()
    single = search(PlanProblem(profile, hw, gpu_budget_bytes=budget))
    t1 = time.perf_counter()
    over_sizes, _ = search_chunk_sizes(model, profile, hw, PlanRequest(gpu_budget_bytes=budget))
    t2 = time.perf_counter()
    row = {
        "kind": "search_time",
        "blocks": args.layers,
        "chunks_traced": profile.chunks.n_chunks,
        "candidate_sizes": len(chunk_size_candidates(model, profile)),
        "single_search_s": round(t1 - t0, 3),
        "single_work": single.work,
        "chunk_size_search_s": round(t2 - t1, 3),
        "chunk_size_search_work": over_sizes.work,
        "chosen_chunk_bytes": over_sizes.plan.chunk_size_bytes,
    }
    return _write(row, args.out)


def _write(row: dict, out: str) -> int:
    """Stamp ``row`` with the machine and the time, print it and append it to ``out``."""
    row["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    row["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    print(json.dumps(row))
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    return 0


def _on_profile(args) -> int:
    import gzip

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from materialize import add_lora, build_on_meta
    from protrain.plan import PlanRequest
    from protrain.plan.chunk_size import search_chunk_sizes
    from protrain.profile.hardware import HardwareProfile
    from protrain.profile.trace import ModelProfile
    from workloads import hf_config

    model = build_on_meta(hf_config(args.shape), torch.bfloat16)
    if args.four_bit:
        _quantize_on_meta(model)
    if args.lora_rank:
        model = add_lora(model, args.lora_rank)
    with gzip.open(args.profile, "rt") as f:
        profile = ModelProfile.from_json(f.read())
    with open(args.hardware) as f:
        hw = HardwareProfile(**json.load(f))
    times, result = [], None
    for _ in range(3):
        t0 = time.perf_counter()
        request = PlanRequest(gpu_budget_bytes=int(args.budget_gib * (1 << 30)),
                              clipping=args.clipping)  # fmt: skip
        result, _ = search_chunk_sizes(model, profile, hw, request)
        times.append(round(time.perf_counter() - t0, 3))
    row = {
        "kind": "search_time_profile",
        "profile": os.path.basename(args.profile),
        "shape": args.shape,
        "lora_rank": args.lora_rank,
        "budget_gib": args.budget_gib,
        "blocks": len(profile.blocks),
        "chunks_traced": profile.chunks.n_chunks,
        "intervals": len(profile.intervals),
        "chunk_size_search_s": times,
        "clipping": args.clipping,
        "four_bit": args.four_bit,
        "work": result.work,
        "plan": result.plan.knobs,
        "chunk_size_bytes": result.plan.chunk_size_bytes,
    }
    return _write(row, args.out)


def _quantize_on_meta(model) -> None:
    """The model's decoder layers as QLoRA's 4-bit layers, on the meta device: the first
    layer is materialized on the CPU and quantized (bitsandbytes, NF4, double quantization,
    as ``materialize.build_qlora``), and every layer gets 4-bit layers of its shapes with
    meta tensors, which is all the search reads (parameter shapes and dtypes)."""
    import bitsandbytes as bnb
    import torch
    from bitsandbytes.functional import QuantState

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from materialize import _fill
    from protrain.quant import quantize_linear_4bit

    def meta(t):
        return None if t is None else torch.empty_like(t, device="meta")

    def meta_state(q):
        inner = q.state2 and QuantState(meta(q.state2.absmax), code=meta(q.state2.code),
                                        blocksize=q.state2.blocksize, dtype=q.state2.dtype)  # fmt: skip
        return QuantState(meta(q.absmax), shape=q.shape, code=meta(q.code),
                          blocksize=q.blocksize, quant_type=q.quant_type, dtype=q.dtype,
                          offset=meta(q.offset), state2=inner)  # fmt: skip

    layers = model.get_decoder().layers
    first = layers[0]
    first.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in first.named_parameters():
            _fill(name, param, torch.device("cpu"))
    quantize_linear_4bit(first, compute_dtype=torch.bfloat16)
    template = dict(first.named_modules())
    for layer in layers:
        for name, module in list(layer.named_modules()):
            t = template[name]
            if isinstance(t, bnb.nn.Linear4bit):
                new = bnb.nn.Linear4bit(t.in_features, t.out_features, bias=t.bias is not None,
                                        compute_dtype=torch.bfloat16, quant_type="nf4",
                                        device="meta")  # fmt: skip
                w = t.weight
                new.weight = bnb.nn.Params4bit(
                    meta(w.data), requires_grad=False, quant_state=meta_state(w.quant_state),
                    blocksize=w.blocksize, compress_statistics=w.compress_statistics,
                    quant_type=w.quant_type, bnb_quantized=True, module=new,
                )  # fmt: skip
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, child, new)
            elif module is not layer and not isinstance(module, bnb.nn.Linear4bit):
                for pname, param in list(module.named_parameters(recurse=False)):
                    module._parameters[pname] = torch.nn.Parameter(
                        meta(param), requires_grad=param.requires_grad
                    )
    model.is_loaded_in_4bit = True  # PEFT's 4-bit LoRA layers, as build_qlora sets it


if __name__ == "__main__":
    sys.exit(main())
