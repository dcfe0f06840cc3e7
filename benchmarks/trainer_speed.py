"""The GPU rows of the Trainer integrations, one JSON row per run, in
run.py's results format (shared/BENCHMARKS.md):

- ``trainer-full-3b``: full-3b (Llama-3.2-3B shape, random weights, 4 x 2048 tokens, 24 GiB)
  through ``transformers.Trainer`` + ``ProTrainTrainer``, the plan made from the Trainer's
  first batch. ``--with-wrap-row`` then runs ``run.py --workload full-3b --system protrain
  --auto`` (the engine alone, as ``protrain train`` runs it) in a second process on the same
  GPU, with the same steps and run id, so the two rows sit side by side (within 5%).
- ``sft-lora-8b``: TRL's ``SFTTrainer`` + ``ProTrainSFTTrainer``, LoRA (rank 16, all linear
  layers) on a Llama-3-8B shape with a bf16 base, 24 GiB, the auto plan.

    python benchmarks/trainer_speed.py --row trainer-full-3b --with-wrap-row --run-id R1
    python benchmarks/trainer_speed.py --row sft-lora-8b --run-id R1
    python benchmarks/trainer_speed.py --row trainer-full-3b --tiny --with-wrap-row   # CPU check

tokens/s is the steady state: the ``--steps`` steps after ``--warmup`` untimed ones (the
first also carries the plan's trace, which happens inside ``train()``); the peaks are the
training steps' (reset when training begins, after the plan), as run.py's auto rows.
``--tiny``: the tiny model on the CPU with a 1 GiB budget, a check of the harness.
"""

from __future__ import annotations

import time

_START = time.perf_counter()  # time to first step counts from here, imports included

import sys  # noqa: E402

from protrain.runtime.allocator import prefer_expandable_segments  # noqa: E402

prefer_expandable_segments()  # as run.py's protrain rows, before CUDA starts

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from materialize import build_for_mode  # noqa: E402
from run import git_commit  # noqa: E402
from workloads import LORA_RANK, MODEL_SHAPES, hf_config  # noqa: E402

_GIB = 2**30
REPO = Path(__file__).resolve().parent.parent
ROWS = {
    # row: (workload it stands beside, model, mode, batch, seq, budget GiB, system)
    "trainer-full-3b": ("full-3b", "llama3b", "full", 4, 2048, 24.0, "protrain_trainer"),
    "sft-lora-8b": ("lora-8b-sft", "llama8b", "lora", 4, 2048, 24.0, "protrain_sft_trainer"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--row", required=True, choices=sorted(ROWS))
    p.add_argument("--batch", type=int, help="default: the row's")
    p.add_argument("--seq", type=int, help="default: the row's")
    p.add_argument("--budget-gib", type=float, help="default: the row's (24)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (>= 1)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--with-wrap-row", action="store_true",
                   help="trainer-full-3b: also run.py's protrain --auto row, same GPU and run id")  # fmt: skip
    p.add_argument("--out", type=Path, help="default: benchmarks/results/trainer_speed.jsonl")
    p.add_argument("--run-id", help="rows measured side by side share one (default: new)")
    p.add_argument("--commit", help="default: git rev-parse --short HEAD")
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU, 1 GiB budget")
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be >= 1: the first step carries the plan's trace")
    if args.with_wrap_row and args.row != "trainer-full-3b":
        p.error("--with-wrap-row is for trainer-full-3b (run.py has no SFTTrainer row)")
    return args


class StepTimer:
    """A TrainerCallback (built lazily: transformers is imported after the allocator setting)
    recording the time at each step's end, synchronized, and the peak from training's start."""

    def __new__(cls, device: torch.device):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.ends: list[float] = []

            def on_train_begin(self, args, state, control, **kwargs):
                # after the plan's trace (get_train_dataloader) and the optimizer
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)

            def on_step_end(self, args, state, control, **kwargs):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                self.ends.append(time.perf_counter())

        return _Timer()


def random_rows(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(vocab, (seq,), generator=g)} for _ in range(n)]


def build_trainer(name: str, model_name: str, mode: str, batch: int, seq: int, budget_gib: float,
                  device: torch.device, args: argparse.Namespace, out_dir: str):  # fmt: skip
    """The row's trainer: the model built on the host as run.py builds it, the Trainer's
    arguments as run.py's protrain row trains (bf16 compute, AdamW, clipping 1.0, constant
    LR), the engine's plan for ``budget_gib`` from the first batch."""
    from protrain.integrations.transformers import ProTrainConfig

    model = build_for_mode(hf_config(model_name), mode, LORA_RANK if mode == "lora" else None,
                           device)  # fmt: skip
    model.train()
    vocab = MODEL_SHAPES[model_name]["vocab_size"]
    n_steps = args.warmup + args.steps
    rows = random_rows(batch * n_steps, seq, vocab)
    config = ProTrainConfig(
        gpu_budget=int(budget_gib * _GIB),
        compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )
    common = dict(
        output_dir=out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        max_steps=n_steps, learning_rate=args.lr, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=args.max_grad_norm, optim="adamw_torch_fused",
        logging_steps=n_steps, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=device.type == "cpu", seed=0, dataloader_num_workers=0, bf16=False, fp16=False,
    )  # fmt: skip
    if name == "trainer-full-3b":
        from transformers import TrainingArguments

        from protrain.integrations.transformers import ProTrainTrainer

        for r in rows:
            r["labels"] = r["input_ids"]
        return ProTrainTrainer(model=model, args=TrainingArguments(**common), train_dataset=rows,
                               protrain_config=config)  # fmt: skip
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig

    from protrain.integrations.transformers.sft import ProTrainSFTTrainer

    # pre-tokenized rows: SFTTrainer skips tokenization; the tokenizer only pads (every row
    # has `seq` tokens, so nothing is padded)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "src/protrain/train/quickstart/tokenizer")
    dataset = Dataset.from_list([{"input_ids": r["input_ids"].tolist()} for r in rows])
    sft_args = SFTConfig(**common, max_length=seq, gradient_checkpointing=False,
                         packing=False)  # fmt: skip
    return ProTrainSFTTrainer(model=model, args=sft_args, train_dataset=dataset,
                              processing_class=tokenizer, protrain_config=config)  # fmt: skip


def measure(name: str, spec: tuple, device: torch.device, args: argparse.Namespace) -> dict:
    _, model_name, mode, batch, seq, budget_gib, _ = spec
    out: dict = {"status": "ok"}
    timer = StepTimer(device)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = build_trainer(name, model_name, mode, batch, seq, budget_gib, device, args,
                                    tmp)  # fmt: skip
            trainer.add_callback(timer)
            trainer.train()
            plan = trainer.plan
            out.update(
                plan={**plan.knobs, "chunk_size_bytes": plan.chunk_size_bytes, "auto": True,
                      "reasons": plan.reasons, "time_terms": plan.time_terms},
                predicted_peak_gib=plan.predicted_peak_bytes / _GIB,
                predicted_step_s=plan.predicted_step_s,
            )  # fmt: skip
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            out["loss"] = round(float(losses[-1]), 4) if losses else None
            trainer.close()
        ends = timer.ends
        step_s = (ends[-1] - ends[args.warmup - 1]) / args.steps
        out.update(step_s=round(step_s, 4), tokens_per_s=round(batch * seq / step_s, 1))
        out["time_to_first_step_s"] = round(ends[0] - _START, 2)
        if out["loss"] is None or not math.isfinite(out["loss"]):
            out.update(status="error", error=f"loss is {out['loss']}")
    except torch.OutOfMemoryError as e:
        out.update(status="oom", error=str(e).strip().splitlines()[0][:500])
    except Exception as e:  # one clear row per failure; the traceback goes to stderr
        traceback.print_exc()
        out.update(status="error", error=f"{type(e).__name__}: {str(e).strip()[:500]}")
    return out


def wrap_row(args: argparse.Namespace, run_id: str, commit: str, out: Path) -> int:
    """run.py's protrain --auto row of full-3b, in its own process on the same device."""
    cmd = [sys.executable, str(REPO / "benchmarks/run.py"), "--workload", "full-3b",
           "--system", "protrain", "--auto", "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--lr", str(args.lr), "--max-grad-norm", str(args.max_grad_norm),
           "--run-id", run_id, "--commit", commit, "--out", str(out)]  # fmt: skip
    if args.tiny:
        cmd += ["--tiny", "--batch", str(args.batch or 2), "--seq", str(args.seq or 32)]
    else:
        cmd += ["--batch", str(args.batch or 4), "--seq", str(args.seq or 2048)]
        if args.budget_gib is not None:
            cmd += ["--budget-gib", str(args.budget_gib)]
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload, model, mode, batch, seq, budget, system = ROWS[args.row]
    if args.tiny:
        device, model, batch, seq, budget = torch.device("cpu"), "tiny", 2, 32, 1.0
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    batch, seq = args.batch or batch, args.seq or seq
    budget = args.budget_gib if args.budget_gib is not None else budget
    if device.type == "cuda":  # run.py's emulate_budget: the allocator capped at the budget
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget * _GIB / total), device)
    commit = args.commit or os.environ.get("PROTRAIN_COMMIT") or git_commit()
    now = datetime.now(timezone.utc)
    run_id = args.run_id or f"{now:%Y-%m-%dT%H:%MZ}-{commit[:7]}"

    spec = (workload, model, mode, batch, seq, budget, system)
    result = measure(args.row, spec, device, args)

    import transformers

    cuda = device.type == "cuda"
    row = {
        "workload": workload,
        "system": system,
        "model": model,
        "mode": mode,
        "budget_gib": budget,
        "batch": batch,
        "seq": seq,
        "status": result.pop("status"),
        "tokens_per_s": result.pop("tokens_per_s", None),
        "step_s": result.pop("step_s", None),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated(device) / _GIB, 2) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / _GIB, 2) if cuda else None,
        "predicted_peak_gib": result.pop("predicted_peak_gib", None),
        "predicted_step_s": result.pop("predicted_step_s", None),
        "plan": result.pop("plan", None),
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
        "run_id": run_id,
        "commit": commit,
        "time_to_first_step_s": result.pop("time_to_first_step_s", None),
        "world_size": 1,
        "checkpointing": "plan",
        **result,
        "max_grad_norm": args.max_grad_norm or None,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        or os.environ.get("PYTORCH_ALLOC_CONF"),
        "cpu_threads": torch.get_num_threads(),
        "date": f"{now:%Y-%m-%dT%H:%M:%SZ}",
    }  # fmt: skip
    if args.tiny:
        row["tiny"] = True
    out = args.out or REPO / "benchmarks" / "results" / "trainer_speed.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    rc = 1 if row["status"] == "error" else 0
    if args.with_wrap_row:
        rc = max(rc, wrap_row(args, run_id, commit, out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
