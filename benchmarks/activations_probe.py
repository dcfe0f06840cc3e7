"""Activation policies on a GPU: peak memory and tokens/s per policy, saved bytes per block
(formula next to measurement), swap overlap, and the longest sequence that trains.

Ready to run on the GPU machine (one GPU)::

    # policies against keep, Llama-3-8B shape, LoRA r=16, batch 1 x 8192, bf16, sdpa
    python benchmarks/activations_probe.py policies --model llama8b --mode lora --seq 8192 \
        --out "${OUT:-benchmarks/results}/activations-8b.jsonl"

    # long context: LoRA, batch 1, growing sequence under an 80 GiB budget
    python benchmarks/activations_probe.py long --model llama8b --mode lora --budget-gib 80 \
        --seqs 65536,131072,262144,393216,524288 \
        --out "${OUT:-benchmarks/results}/activations-long.jsonl"

    # CPU smoke test of the script itself (numbers meaningless)
    python benchmarks/activations_probe.py policies --model tiny --device cpu --seq 64 \
        --steps 1 --out /tmp/probe.jsonl

Configurations (``--configs``, comma-separated) are a policy spec with optional suffixes:
``keep``, ``checkpoint``, ``swap``, ``offload_checkpoint`` (every block), ``rule:S:C``
(``place_policies(n_blocks, S, C)``), ``rule:S:C:offload`` (checkpointed blocks hold their
input on the host), ``split:H`` (the first ``H`` blocks offload-checkpoint, the others
checkpoint: at long context the held inputs outgrow host memory, and the last blocks' inputs
stay on the device, where backward needs them first); ``+tiled`` (tiled MLP, ``--tile-tokens``), ``+chunked`` (chunked loss,
``--loss-chunk-tokens``; otherwise the model's own loss over full fp32 logits).

Rows (one JSON object per line, appended to ``--out``):

- ``kind: "bandwidth"``: pinned host<->device copy rates of this machine (GB/s);
- ``kind: "saved_bytes"``: per block of a ``--saved-bytes-layers``-layer model of the same
  shape, ``predicted_bytes`` (``protrain.activations.estimate``) and ``measured_bytes``
  (``SavedBytesProbe``) under ``keep``. Under LoRA the first block's input needs no gradient
  (frozen embeddings), so it saves less than the formula's layer: compare the others;
- ``kind: "policy"``: per configuration, tokens/s, step seconds, peak allocated and reserved
  GiB, the activation bytes the formula predicts on the device and on the host for the whole
  stack, the swap traffic, and for configurations that swap or offload: ``baseline`` (the
  same configuration with swap -> keep and offload_checkpoint -> checkpoint), its step time,
  and ``swap_hidden_share = 1 - max(0, step_s - baseline_step_s) / copy_s``, where
  ``copy_s`` is the swap traffic at the measured bandwidth: the share of the traffic's time
  hidden under compute;
- ``kind: "long"``: per sequence length, ok or oom, tokens/s and peak memory; it stops at the
  first sequence that does not fit. What the formula says about it (Llama-3-8B shape, LoRA on
  all projections, bf16): with tiled MLP and offload-checkpoint, a layer's recomputation keeps
  about 74 GiB at 512K tokens with float32 adapters (their inputs are cast to fp32, one copy
  per projection) and about 34 GiB with bfloat16 adapters; the offloaded layer inputs take
  ``32 * seq * 4096 * 2`` bytes of host memory, 128 GiB at 512K tokens.

A step is forward and backward and an AdamW step over the trainable parameters. Nothing here
asserts a time; it reports.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_GIB = 1024**3
LORA_RANK = 16


def _commit() -> str:
    if os.environ.get("COMMIT"):  # the suites name it: the device copy's .git is stale
        return os.environ["COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return os.environ.get("PROTRAIN_COMMIT", "unknown")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


# -- the model -------------------------------------------------------------------------------


def build_model(args, n_layers: int, seq: int):
    from benchmarks.materialize import build_on_meta, materialize
    from benchmarks.workloads import hf_config

    config = hf_config(args.model)
    config.num_hidden_layers = n_layers
    config.max_position_embeddings = max(config.max_position_embeddings, seq)
    config._attn_implementation = args.attn
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    model = build_on_meta(config, dtype, lora_rank=LORA_RANK if args.mode == "lora" else None)
    materialize(model, args.device, args.device)
    if args.mode == "lora" and args.lora_dtype != "float32":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.to(getattr(torch, args.lora_dtype))
    return model.train(), config, dtype


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _layer_shape(config, batch: int, seq: int):
    from protrain.activations.estimate import LlamaLayerShape

    return LlamaLayerShape(
        batch,
        seq,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        getattr(config, "head_dim", None),
    )


def _formula_kwargs(args, model, dtype) -> dict:
    kw = dict(dtype=dtype, attn_implementation=args.attn)
    if args.mode == "lora":
        from protrain.activations.estimate import LORA_TARGETS

        lora_dtype = next(p.dtype for n, p in model.named_parameters() if "lora_A" in n)
        kw.update(lora_targets=LORA_TARGETS, lora_rank=LORA_RANK, lora_dtype=lora_dtype)
    return kw


# -- configurations --------------------------------------------------------------------------


def parse_config(spec: str, n_blocks: int):
    """Policies, tiled MLP on/off, chunked loss on/off. ``nohost:<spec>`` is ``<spec>`` with
    swap -> keep and offload_checkpoint -> checkpoint, block for block (the baseline)."""
    from protrain.activations import ActivationPolicy, place_policies

    no_host = spec.startswith("nohost:")
    head, *suffixes = spec.removeprefix("nohost:").split("+")
    unknown = set(suffixes) - {"tiled", "chunked"}
    if unknown:
        raise SystemExit(f"config {spec!r}: unknown suffixes {sorted(unknown)}")
    if head.startswith("split:"):
        n_host = int(head.split(":")[1])
        if not 0 <= n_host <= n_blocks:
            raise SystemExit(f"config {spec!r}: H must be 0..{n_blocks}")
        policies = [ActivationPolicy.OFFLOAD_CHECKPOINT] * n_host + [
            ActivationPolicy.CHECKPOINT
        ] * (n_blocks - n_host)
    elif head.startswith("rule:"):
        parts = head.split(":")
        policies = place_policies(
            n_blocks, int(parts[1]), int(parts[2]), offload_checkpoint_inputs="offload" in parts[3:]
        )
    else:
        policies = [ActivationPolicy(head)] * n_blocks
    if no_host:
        instead = {
            ActivationPolicy.SWAP: ActivationPolicy.KEEP,
            ActivationPolicy.OFFLOAD_CHECKPOINT: ActivationPolicy.CHECKPOINT,
        }
        policies = [instead.get(p, p) for p in policies]
    return policies, "tiled" in suffixes, "chunked" in suffixes


def baseline_of(spec: str, n_blocks: int) -> str | None:
    """The same configuration without host traffic, or None if it has none."""
    from protrain.activations import ActivationPolicy

    if spec.startswith("nohost:"):
        return None
    policies, _, _ = parse_config(spec, n_blocks)
    host = {ActivationPolicy.SWAP, ActivationPolicy.OFFLOAD_CHECKPOINT}
    return f"nohost:{spec}" if host & set(policies) else None


# -- measurements ----------------------------------------------------------------------------


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> dict:
    if device.type != "cuda":
        return {"d2h_gbps": None, "h2d_gbps": None}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h_gbps", host, dev), ("h2d_gbps", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        out[name] = round(3 * nbytes / (time.perf_counter() - t0) / 1e9, 2)
    del dev, host
    return out


def saved_bytes_rows(args, common: dict) -> list[dict]:
    from protrain.activations.estimate import measure_saved_bytes, saved_bytes

    model, config, dtype = build_model(args, args.saved_bytes_layers, args.seq)
    shape = _layer_shape(config, args.batch, args.seq)
    predicted = saved_bytes(shape, **_formula_kwargs(args, model, dtype))
    ids = torch.randint(config.vocab_size, (args.batch, args.seq), device=args.device)
    backbone = _base(model).model
    measured = measure_saved_bytes(backbone.layers, lambda: backbone(input_ids=ids))
    rows = [
        {
            **common,
            "kind": "saved_bytes",
            "block": i,
            "predicted_bytes": predicted,
            "measured_bytes": got,
            "measured_over_predicted": round(got / predicted, 4),
        }
        for i, got in enumerate(measured)
    ]
    model = backbone = None  # free the probe model before the next one is built
    _free(args.device)
    return rows


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _loss_fn(model, chunked: bool, chunk_tokens: int):
    from protrain.activations import chunked_causal_lm_loss_sum

    base = _base(model)

    def loss(ids):
        if not chunked:
            return model(input_ids=ids, labels=ids).loss
        hidden = base.model(input_ids=ids).last_hidden_state
        total = chunked_causal_lm_loss_sum(
            hidden, base.get_output_embeddings(), ids, chunk_tokens=chunk_tokens
        )
        return total / (ids.shape[0] * (ids.shape[1] - 1))

    return loss


def run_config(args, model, config, dtype, spec: str, seq: int, steps: int) -> dict:
    """Apply ``spec``, run warmup + ``steps`` training steps, take the policies off again."""
    from protrain.activations import ActivationPolicy, apply_activation_policies
    from protrain.activations.estimate import block_activation_bytes

    n_blocks = len(_base(model).model.layers)
    policies, tiled, chunked = parse_config(spec, n_blocks)
    out: dict = {
        "config": spec,
        "seq": seq,
        "policies": {p.value: policies.count(p) for p in ActivationPolicy},
        "tiled_mlp_tokens": args.tile_tokens if tiled else None,
        "swap_in_flight_gib": args.swap_in_flight_gib,
        "swap_prefetch_groups": args.swap_prefetch_groups,
        "loss_chunk_tokens": args.loss_chunk_tokens if chunked else None,
        "status": "ok",
    }
    shape = _layer_shape(config, args.batch, seq)
    kw = _formula_kwargs(args, model, dtype)
    per_block = [block_activation_bytes(shape, p, **kw) for p in policies]
    out["predicted_activation_device_gib"] = round(sum(b.device_bytes for b in per_block) / _GIB, 3)
    out["predicted_activation_host_gib"] = round(sum(b.host_bytes for b in per_block) / _GIB, 3)
    handle = None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=args.device.type == "cuda")
    try:
        handle = apply_activation_policies(
            model,
            policies,
            device=args.device,
            tiled_mlp_tokens=args.tile_tokens if tiled else None,
            swap_max_in_flight_bytes=int(args.swap_in_flight_gib * _GIB),
            swap_prefetch_groups=args.swap_prefetch_groups,
        )
        loss_fn = _loss_fn(model, chunked, args.loss_chunk_tokens)
        ids = torch.randint(config.vocab_size, (args.batch, seq), device=args.device)
        if args.prepin and handle.swapper is not None:
            n_held = policies.count(ActivationPolicy.OFFLOAD_CHECKPOINT)
            held_bytes = args.batch * seq * config.hidden_size * torch.finfo(dtype).bits // 8
            out.update(_prepin(handle.swapper.transfer, n_held, held_bytes))
        _free(args.device)
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        forward_s = 0.0
        with _attention_backend(args.sdpa_backend, args.device):
            for i in range(args.warmup + steps):
                if i == args.warmup:
                    _sync(args.device)
                    t0 = time.perf_counter()
                    if handle.swapper is not None:
                        t = handle.swapper.transfer
                        to_host0, to_device0 = t.bytes_to_host, t.bytes_to_device
                t_fwd = time.perf_counter()
                loss = loss_fn(ids)
                _sync(args.device)  # one sync a step: the forward's share of the step
                if i >= args.warmup:
                    forward_s += time.perf_counter() - t_fwd
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del loss
            _sync(args.device)
        step_s = (time.perf_counter() - t0) / steps
        out.update(
            step_s=round(step_s, 4),
            forward_s=round(forward_s / steps, 4),
            tokens_per_s=round(args.batch * seq / step_s, 1),
            host_peak_rss_gib=round(_peak_rss_bytes() / _GIB, 2),
        )
        if args.device.type == "cuda":
            out["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated(args.device) / _GIB, 3)
            out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(args.device) / _GIB, 3)
        if handle.swapper is not None:
            t = handle.swapper.transfer
            out["swap_to_host_gib_per_step"] = round((t.bytes_to_host - to_host0) / steps / _GIB, 3)
            out["swap_to_device_gib_per_step"] = round(
                (t.bytes_to_device - to_device0) / steps / _GIB, 3
            )
            out["swap_peak_device_gib"] = round(t.peak_device_bytes / _GIB, 3)
    except torch.OutOfMemoryError as e:
        out.update(status="oom", error=str(e).strip().splitlines()[0][:300])
    except Exception as e:
        traceback.print_exc()
        oom = "out of memory" in str(e).lower()
        out.update(status="oom" if oom else "error", error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        if handle is not None:
            handle.remove()
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        _free(args.device)
    return out


def _prepin(transfer, copies: int, nbytes: int) -> dict:
    """Page-lock the host memory of ``copies`` held inputs of ``nbytes`` before the timed
    steps, as a run's first step does once: the pieces go back to torch's caching host
    allocator, which hands them to the step's copies of the same sizes."""
    from protrain.activations.transfer import host_piece_sizes

    if transfer.device.type != "cuda" or copies == 0:
        return {}
    t0 = time.perf_counter()
    sizes = host_piece_sizes(nbytes, transfer.min_piece_bytes) * copies
    pinned = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    del pinned
    return {
        "prepin_gib": round(sum(sizes) / _GIB, 2),
        "prepin_s": round(time.perf_counter() - t0, 2),
    }


def _attention_backend(name: str, device: torch.device):
    """The app's ``model.sdpa_backend`` context (``default``: torch's own choice). It holds
    through backward too, where checkpointed blocks recompute their attention."""
    from protrain.train.attention import sdpa_backend

    return sdpa_backend(name, device)


def _peak_rss_bytes() -> int:
    """This process's peak resident host memory (pinned copies count once touched)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def hidden_share(row: dict, base: dict, bandwidth: dict) -> float | None:
    if row.get("status") != "ok" or base.get("status") != "ok" or not bandwidth.get("d2h_gbps"):
        return None
    copy_s = row.get("swap_to_host_gib_per_step", 0) * _GIB / (bandwidth["d2h_gbps"] * 1e9)
    copy_s += row.get("swap_to_device_gib_per_step", 0) * _GIB / (bandwidth["h2d_gbps"] * 1e9)
    if copy_s <= 0:
        return None
    exposed = max(0.0, row["step_s"] - base["step_s"])
    return round(max(0.0, 1.0 - exposed / copy_s), 3)


# -- commands --------------------------------------------------------------------------------


def common_fields(args) -> dict:
    return {
        "workload": args.workload,
        "system": "protrain",
        "model": args.model,
        "mode": args.mode,
        "batch": args.batch,
        "attn": args.attn,
        "sdpa_backend": args.sdpa_backend,
        "budget_gib": args.budget_gib,
        "gpu": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
        "run_id": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        + "-"
        + _commit(),
        "commit": _commit(),
    }


def cmd_policies(args) -> None:
    common = common_fields(args)
    bandwidth = measure_bandwidth(args.device)
    _write(args.out, {**common, "kind": "bandwidth", **bandwidth})
    if args.saved_bytes_layers > 0:
        for row in saved_bytes_rows(args, common):
            _write(args.out, row)
    model, config, dtype = build_model(args, args.layers, args.seq)
    specs = [s for s in args.configs.split(",") if s]
    n_blocks = args.layers
    results: dict[str, dict] = {}
    for spec in specs + [b for s in specs if (b := baseline_of(s, n_blocks)) and b not in specs]:
        results[spec] = run_config(args, model, config, dtype, spec, args.seq, args.steps)
    keep = results.get("keep", {})
    for spec, row in results.items():
        base = baseline_of(spec, n_blocks)
        if base is not None:
            row["baseline"] = base
            row["baseline_step_s"] = results[base].get("step_s")
            row["swap_hidden_share"] = hidden_share(row, results[base], bandwidth)
        if keep.get("status") == "ok" and row.get("status") == "ok":
            row["tokens_per_s_vs_keep"] = round(row["tokens_per_s"] / keep["tokens_per_s"], 3)
            if "peak_alloc_gib" in keep:
                row["peak_alloc_vs_keep"] = round(row["peak_alloc_gib"] / keep["peak_alloc_gib"], 3)
        _write(args.out, {**common, "kind": "policy", **row})


def cmd_long(args) -> None:
    common = common_fields(args)
    seqs = [int(s) for s in args.seqs.split(",")]
    model, config, dtype = build_model(args, args.layers, max(seqs))
    for seq in seqs:
        row = run_config(args, model, config, dtype, args.long_config, seq, args.steps)
        _write(args.out, {**common, "kind": "long", **row})
        if row["status"] != "ok":
            break


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("command", choices=["policies", "long"])
    p.add_argument("--model", default="llama8b")
    p.add_argument("--mode", choices=["lora", "full"], default="lora")
    p.add_argument("--layers", type=int, default=None, help="default: the model's own")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--attn", default="sdpa")
    p.add_argument(
        "--sdpa-backend",
        choices=["default", "flash", "cudnn", "efficient"],
        default="default",
        help="the fused SDPA kernel forced for the steps (benchmarks/attention_backends.py "
        "times them)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-gib", type=float, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--configs",
        default="keep,checkpoint,swap,offload_checkpoint,rule:8:16,rule:8:16:offload,"
        "keep+chunked,checkpoint+tiled+chunked,offload_checkpoint+tiled+chunked",
    )
    p.add_argument("--tile-tokens", type=int, default=4096)
    p.add_argument("--loss-chunk-tokens", type=int, default=4096)
    p.add_argument(
        "--lora-dtype",
        default="float32",
        help="dtype of the adapters (peft keeps them in float32 by default; bfloat16 is what "
        "they compute in under protrain.wrap's bf16 compute, and saves the fp32 input casts)",
    )
    p.add_argument(
        "--prepin",
        action="store_true",
        help="page-lock the offload-checkpointed inputs' host memory before the timed steps "
        "(a run pays it once, in its first step); the row reports its seconds",
    )
    p.add_argument("--swap-in-flight-gib", type=float, default=1.0)
    p.add_argument("--swap-prefetch-groups", type=int, default=1)
    p.add_argument("--saved-bytes-layers", type=int, default=2)
    p.add_argument("--seqs", default="65536,131072,262144,393216,524288")
    p.add_argument("--long-config", default="offload_checkpoint+tiled+chunked")
    p.add_argument("--workload", default=None)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                 "activations-probe.jsonl"))  # fmt: skip
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.layers is None:
        from benchmarks.workloads import MODEL_SHAPES

        args.layers = MODEL_SHAPES[args.model]["num_hidden_layers"]
    if args.workload is None:
        args.workload = f"act-{args.model}-{args.mode}" + (
            f"-{args.seq}" if args.command == "policies" else "-long"
        )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.type == "cuda" and args.budget_gib is not None:
        total = torch.cuda.get_device_properties(args.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * _GIB / total))
    with contextlib.suppress(KeyboardInterrupt):
        (cmd_policies if args.command == "policies" else cmd_long)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
