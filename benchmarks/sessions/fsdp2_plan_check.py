"""Session 14 record (issue 19 item 6 on a GPU): `protrain plan` for an `fsdp_version: 2`
config prints the FSDP2 engine's measured peak; the same config then trains a few steps
through `protrain train` and its logged peak is set beside it. A Llama-3.2-1B-shaped model
with random weights (resume_ranks.build_shape_dir), text rows of the full sequence.

Usage: python benchmarks/sessions/fsdp2_plan_check.py WORK_DIR OUT_JSONL
"""

import json
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from resume_ranks import build_shape_dir  # noqa: E402

work, out = Path(sys.argv[1]), Path(sys.argv[2])
work.mkdir(parents=True, exist_ok=True)
model_dir, n_params = build_shape_dir(work, "llama1b", None, "cuda")
data = work / "long.jsonl"
words = " ".join(f"w{i % 97} x{i % 13}" for i in range(2048))
data.write_text("".join(json.dumps({"text": words}) + "\n" for _ in range(32)))
rows = []
for offload in (False, True):
    cfg = {
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
        "mixed_precision": "bf16",
        "datasets": [{"path": str(data), "type": "text"}],
        "sequence_len": 2048,
        "micro_batch_size": 4,
        "max_steps": 4,
        "learning_rate": 1e-5,
        "logging_steps": 1,
        "output_dir": str(work / f"run-{offload}"),
        "fsdp_version": 2,
        "fsdp_config": {
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "offload_params": offload,
            "activation_checkpointing": True,
        },
    }
    path = work / f"fsdp2-{offload}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
              "-m", "protrain"]  # fmt: skip
    plan = subprocess.run(launch + ["plan", str(path)], capture_output=True, text=True)
    train = subprocess.run(launch + ["train", str(path)], capture_output=True, text=True)

    def errors(proc) -> list[str]:  # the rank's own lines, not torchrun's summary
        keep = ("error", "Error", "Traceback", 'File "')
        lines = [ln for ln in proc.stderr.splitlines() if any(k in ln for k in keep)]
        return [ln for ln in lines if "elastic" not in ln][-12:] if proc.returncode else []

    metrics = work / f"run-{offload}" / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    row = {
        "bench": "fsdp2_plan_check", "model": "llama1b", "params": n_params, "batch": 4,
        "seq": 2048, "offload_params": offload, "activation_checkpointing": True,
        "world_size": 1, "plan_rc": plan.returncode,
        "plan_out": (plan.stdout.strip().splitlines() or [""])[-6:],
        "plan_err": errors(plan),
        "train_rc": train.returncode, "train_err": errors(train),
        "train_gpu_peak_alloc_gib": max((r.get("gpu_peak_gib", 0) for r in recs), default=None),
        "train_tokens_per_s": [round(r["tokens_per_s"]) for r in recs if "tokens_per_s" in r],
    }  # fmt: skip
    rows.append(row)
    print(json.dumps(row))
with out.open("a") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
