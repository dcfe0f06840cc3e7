"""A workload of ``workloads.py`` trained through ``protrain train`` itself, as a user runs it:
a checkpoint saved on disk and loaded by the application, its YAML config, ``memory.auto``
at the workload's budget. One JSON row in ``run.py``'s format (system ``protrain_app``), to
sit beside ``run.py``'s rows of the same run id (FSDP2 CPU offload, ...).

The model is the workload's shape with cheap random weights (``materialize.py``), saved once
in bf16 under ``--work`` with the quickstart tokenizer (``resume_ranks.build_shape_dir``); LoRA
rank 16 on every linear layer as ``run.py``'s LoRA. The data (``--data long``, the default) is text rows
longer than the sequence (truncated to it), not packed: every micro-batch is batch x sequence
real tokens, the shapes run.py's rows compute; ``--data packed`` trains the quickstart's chat
set packed (a micro-batch is then one row of batch x sequence). No clipping, the
chunked loss at 4096 tokens (what ``run.py --auto --chunked-loss-tokens 4096`` plans with).
The app's CUDA allocator is capped at the budget before it starts, as ``run.py`` caps its
systems, so a plan that overflows fails here as it would on a card of that size.

Throughput: the app logs each step's real (non-padding) tokens and tokens/s; a step's time
is their ratio. ``tokens_per_s`` is batch x sequence over the median step after
``--warmup`` (what ``run.py`` counts: every position computed), ``app_tokens_per_s`` the app's
own figure over the same steps (real tokens only, lower by the packing's padding).

Usage: ``python benchmarks/app_speed.py --workload lora-moe30b --out rows.jsonl``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from resume_ranks import append_row, build_shape_dir  # noqa: E402
from workloads import LORA_RANK, WORKLOADS  # noqa: E402

# Runs the app in a child process whose allocator is capped first: argv[1] the budget in GiB,
# the rest `protrain`'s own arguments.
_CAPPED_APP = """
import sys, torch
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, float(sys.argv[1]) * 2**30 / total), 0)
from protrain.cli import main
sys.exit(main(sys.argv[2:]))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before them (plan check included)")
    p.add_argument("--layers-override", type=int, help="fewer decoder layers than the shape")
    p.add_argument("--shape", help="another MODEL_SHAPES key (tiny: a check on the CPU)")
    p.add_argument("--budget-gib", type=float, help="default: the workload's")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--seq", type=int, help="default: the workload's")
    p.add_argument("--batch", type=int, help="default: the workload's first")
    p.add_argument("--data", choices=["long", "packed"], default="long")
    p.add_argument("--build-only", action="store_true", help="save the model and stop")
    p.add_argument("--work", type=Path, default=Path("/tmp/app_speed"))
    p.add_argument("--out", type=Path, help="the rows file (required unless --build-only)")
    p.add_argument("--run-id")
    p.add_argument("--commit", default=os.environ.get("PROTRAIN_COMMIT", "unknown"))
    return p.parse_args(argv)


def write_config(run: Path, model_dir: Path, args, batch: int, seq: int, budget: float) -> Path:
    import yaml

    from protrain.train.config import QUICKSTART_DIR

    workload = WORKLOADS[args.workload]
    if args.data == "long":  # rows of words enough for seq tokens each, one word a token or more
        data = run.with_name(f"{run.name}-long.jsonl")
        words = " ".join(f"w{i % 97} x{i % 13}" for i in range(seq))
        data.write_text("".join(json.dumps({"text": words}) + "\n" for _ in range(64)))
        dataset = {"path": str(data), "type": "text"}
    else:
        dataset = {"path": str(QUICKSTART_DIR / "data" / "chat.jsonl"), "type": "chat"}
    cfg: dict = {
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
        "mixed_precision": "bf16" if args.device == "cuda" else "no",
        "datasets": [dataset],
        "sequence_len": seq,
        "sample_packing": args.data == "packed",
        "micro_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "num_epochs": 1000,  # the quickstart set is short: max_steps ends the run
        "max_steps": args.warmup + args.steps,
        "learning_rate": 1e-5,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "max_grad_norm": None,  # no clipping, as the run.py rows
        "logging_steps": 1,
        "output_dir": str(run),
        "seed": 7,
        "device": args.device,
        "memory": {"auto": True, "gpu_budget": f"{budget}GiB", "chunked_loss_tokens": 4096},
    }
    if workload.mode == "lora":
        cfg["adapter"] = {"type": "lora", "r": LORA_RANK, "alpha": 2 * LORA_RANK,
                          "dropout": 0.0, "target_modules": "all-linear"}  # fmt: skip
    elif workload.mode != "full":
        raise SystemExit(f"{args.workload}: mode {workload.mode!r} is not run here (full, lora)")
    path = run.with_name(f"{run.name}.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is None and not args.build_only:
        raise SystemExit("--out is required unless --build-only")
    workload = WORKLOADS[args.workload]
    batch, seq = args.batch or workload.batches[0], args.seq or workload.seq
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    shape, budget = args.shape or workload.model, args.budget_gib or workload.budget_gib
    model_dir, n_params = build_shape_dir(args.work, shape, args.layers_override, args.device)
    build_s = round(time.perf_counter() - t0, 1)
    if args.build_only:
        print(f"{model_dir}: {n_params / 1e9:.2f} B parameters, {build_s} s")
        return 0
    run = args.work / f"{args.workload}-run"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    config = write_config(run, model_dir, args, batch, seq, budget)
    cmd = [sys.executable, "-c", _CAPPED_APP, str(budget), "train", str(config)]
    if args.device == "cpu":
        cmd = [sys.executable, "-m", "protrain", "train", str(config)]
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}")
    now = datetime.now(timezone.utc)
    row: dict = {
        "bench": "app_speed", "workload": args.workload, "system": "protrain_app",
        "model": shape, "mode": workload.mode, "params": n_params,
        "layers": args.layers_override, "budget_gib": budget, "batch": batch,
        "seq": seq, "world_size": 1, "checkpointing": "plan", "max_grad_norm": 0.0,
        "chunked_loss_tokens": 4096, "data": args.data, "steps": args.steps, "warmup": args.warmup,
        "model_build_s": build_s, "commit": args.commit,
        "run_id": args.run_id or f"{now:%Y-%m-%dT%H:%MZ}-{args.commit[:7]}",
        "date": f"{now:%Y-%m-%dT%H:%M:%SZ}",
    }  # fmt: skip
    t0 = time.perf_counter()
    log = run.with_name(f"{run.name}.log")
    with log.open("w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    row["app_s"] = round(time.perf_counter() - t0, 1)
    metrics_path = run / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics_path.read_text().splitlines()]
        if metrics_path.exists()
        else []
    )
    steps = [r for r in records if "tokens_per_s" in r]
    plan = next((r for r in records if "plan_predicted_peak_gib" in r), {})
    if done.returncode != 0 or len(steps) < args.warmup + args.steps:
        tail = log.read_text()[-1500:]
        row.update(status="oom" if "OutOfMemoryError" in tail else "error", error=tail)
    else:
        timed = steps[args.warmup :]
        seen = [r["tokens_seen"] for r in steps]
        real = [b - a for a, b in zip([0] + seen, seen)][args.warmup :]
        step_s = [n / r["tokens_per_s"] for n, r in zip(real, timed)]
        median_s = statistics.median(step_s)
        row.update(
            status="ok",
            tokens_per_s=round(batch * seq / median_s, 1),
            app_tokens_per_s=round(sum(real) / sum(step_s), 1),
            step_s=round(median_s, 4),
            loss=timed[-1]["loss"],
            peak_alloc_gib=round(max(r.get("gpu_peak_gib", 0.0) for r in steps), 2),
            predicted_peak_gib=plan.get("plan_predicted_peak_gib"),
            measured_peak_reserved_gib=plan.get("plan_measured_peak_gib"),
            predicted_step_s=plan.get("plan_predicted_step_s"),
            plan_measured_step_s=plan.get("plan_measured_step_s"),
            plan_corrected=plan.get("plan_corrected", False),
        )
    plan_lines = [ln for ln in log.read_text().splitlines() if "n_persist" in ln or "plan" in ln]
    row["plan_log"] = plan_lines[:12]
    if args.device == "cuda":
        import torch

        row["gpu"] = torch.cuda.get_device_name(0)
    append_row(args.out, row)
    print(json.dumps(row))
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
