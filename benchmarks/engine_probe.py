"""First throughput probe of the ProTrain engine: full fine-tuning of a Llama-3.2-3B-shaped
model, batch 4 x 2048, bf16 compute over fp32 masters, HF gradient checkpointing, under a GPU
budget. Appends one JSON line per configuration to benchmarks/results/<file>.

    python benchmarks/engine_probe.py --out benchmarks/results/x.jsonl --budget-gib 24 \
        --config 0,4 --config 1,3

Each --config is n_persist,n_buffer. Timed assertions do not belong here; this only reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA_3B = dict(
    vocab_size=128256,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return os.environ.get("PROTRAIN_COMMIT", "unknown")


def run_one(args, n_persist: int, n_buffer: int, run_id: str) -> dict:
    import transformers
    from benchmarks.materialize import build_on_meta, materialize

    import protrain

    row = {
        "workload": "full-3b",
        "system": "protrain",
        "model": "llama3b",
        "mode": "full",
        "budget_gib": args.budget_gib,
        "batch": args.batch,
        "seq": args.seq,
        "plan": {"n_persist": n_persist, "n_buffer": n_buffer, "n_swap": 0, "n_checkpoint": 28},
        "gpu": torch.cuda.get_device_name(),
        "run_id": run_id,
        "commit": _commit(),
        "predicted_peak_gib": None,
        "predicted_step_s": None,
        "torch": torch.__version__,
        "probe": "engine_probe",
    }
    t_start = time.perf_counter()
    cfg = transformers.LlamaConfig(**LLAMA_3B)
    cfg._attn_implementation = "sdpa"
    model = build_on_meta(cfg, torch.bfloat16)
    materialize(model, "cpu", "cuda")
    model.gradient_checkpointing_enable()
    model.train()
    t_wrap = time.perf_counter()
    model, opt, layout = protrain.wrap(
        model, n_persist=n_persist, n_buffer=n_buffer, lr=1e-5, compute_dtype=torch.bfloat16
    )
    row["wrap_s"] = round(time.perf_counter() - t_wrap, 2)
    row["n_chunks"] = layout.n_chunks
    row["chunk_size_mib"] = round(layout.chunk_size_bytes / 2**20, 1)
    print(layout, flush=True)
    engine = model._protrain_engine
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).cuda()
    torch.cuda.reset_peak_memory_stats()
    step_times, copy_waits, cpu_waits, losses = [], [], [], []
    try:
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cpu0 = engine.manager.stats["wait_cpu_optimizer_s"]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())  # syncs
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if step == 0:
                row["time_to_first_step_s"] = round(time.perf_counter() - t_start, 2)
            step_times.append(dt)
            copy_waits.append(engine.manager.copy_wait_s())
            print({k: round(v, 3) for k, v in engine.manager.stats.items()}, flush=True)
            cpu_waits.append(engine.manager.stats["wait_cpu_optimizer_s"] - cpu0)
            print(
                f"step {step}: {dt:.3f} s, loss {losses[-1]:.4f}, copy wait "
                f"{copy_waits[-1]:.3f} s, cpu-optimizer wait {cpu_waits[-1]:.3f} s",
                flush=True,
            )
        timed = step_times[args.warmup :]
        step_s = sum(timed) / len(timed)
        row.update(
            status="ok",
            step_s=round(step_s, 4),
            tokens_per_s=round(args.batch * args.seq / step_s, 1),
            copy_wait_s=round(sum(copy_waits[args.warmup :]) / len(timed), 4),
            cpu_optimizer_wait_s=round(sum(cpu_waits[args.warmup :]) / len(timed), 4),
            loss=round(losses[-1], 4),
            steps=args.steps,
            warmup=args.warmup,
        )
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e)[:300])
    row["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    row["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    protrain.close(model)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-gib", type=float, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", action="append", default=None, help="n_persist,n_buffer")
    args = ap.parse_args()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(args.budget_gib * 2**30 / total)
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ-") + _commit()
    for cfg in args.config or ["0,4"]:
        n_persist, n_buffer = map(int, cfg.split(","))
        row = run_one(args, n_persist, n_buffer, run_id)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
