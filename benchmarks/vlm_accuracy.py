"""A vision-language row of plan accuracy: a Qwen2.5-VL-7B-shaped model with
random weights trained by ``protrain train`` itself, LoRA, ``memory.auto`` at a budget, for
one whole epoch of rows with 0-4 images of varying size; the plan's predicted peak against
the peak measured over the whole epoch. One JSON row per budget.

Why through the app and not ``plan_accuracy.py``: the claim is about what a user gets, and
for a vision-language model that is the app's choice of the planning micro-batch (the
heaviest one the data can produce, ``protrain/train/heaviest_batch.py``) and its closed
loop, over micro-batches that all differ; the row runs every micro-batch of the epoch.
``app_speed.py`` runs text workloads for a few steps; this script builds a processor and
an image dataset and reads the whole run's peak, so it stands apart.

What it builds, once per shape under ``--work`` (no downloads):

- the model: ``workloads.VLM_SHAPES[--shape]`` on the meta device, filled cheaply
  (``materialize.py``, on ``--device``), saved in bf16;
- the tokenizer: byte-level, one token a byte, plus Qwen's special tokens, with the
  project's Qwen2-VL chat template;
- the processor: transformers' ``Qwen2_5_VLProcessor`` with its image processor at
  Qwen2.5-VL-7B-Instruct's published settings (14-pixel patches merged 2x2, min_pixels
  3136, max_pixels 12845056) and its video processor (which needs torchvision, as
  ``AutoProcessor`` does to load the processor back), saved beside the model;
- the data: ``--rows`` chat rows (seeded): 0-4 images each, every image one of
  ``IMAGE_SIZES`` (64 to 768 image tokens), answers of 40 to 1,500 bytes.

Then per budget: the app in a child process whose CUDA allocator is capped at the budget
first (as ``app_speed.py``), ``num_epochs: 1``, logging every step. The measured peak is
the allocator's ``max_memory_reserved`` (and allocated) read in that process after the run:
the engine resets the peak counters when it applies a plan, so this is the peak of every
step of the epoch under the plan (under the corrected plan where the closed loop replaced
it: the row says so). On the CPU (``--smoke``) there is no allocator; the row reports the
app's own closed-loop measurement (the engine's device-side bytes over its first steps).

    python benchmarks/vlm_accuracy.py --budgets 16,24 --out $OUT/vlm.jsonl       # GPU
    python benchmarks/vlm_accuracy.py --smoke --out /tmp/vlm-smoke.jsonl          # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from workloads import LORA_RANK, VLM_SHAPES  # noqa: E402

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>",
                 "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
# (width, height) in pixels: multiples of 28, so the processor keeps them; image tokens
# after the 2x2 merge: 64, 192, 256, 384, 768.
IMAGE_SIZES = [(224, 224), (448, 336), (448, 448), (672, 448), (896, 672)]
# Qwen2.5-VL-7B-Instruct's preprocessor_config.json
MIN_PIXELS, MAX_PIXELS = 3136, 12845056

# The app in a child process whose allocator is capped first; after the run, the peaks
# of the process (reset by the engine when it applied the plan) go to a JSON file.
# argv: budget GiB, peaks file, then `protrain`'s own arguments.
_CAPPED_APP = """
import json, sys, torch
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, float(sys.argv[1]) * 2**30 / total), 0)
from protrain.cli import main
try:
    rc = main(sys.argv[3:])
finally:
    with open(sys.argv[2], "w") as f:
        json.dump({"reserved": torch.cuda.max_memory_reserved(0),
                   "allocated": torch.cuda.max_memory_allocated(0),
                   "gpu": torch.cuda.get_device_name(0)}, f)
sys.exit(rc)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(VLM_SHAPES), default="qwen25vl7b")
    p.add_argument("--budgets", default="16,24", help="GiB, comma-separated: one row each")
    p.add_argument("--rows", type=int, default=200, help="rows of the dataset: one epoch")
    p.add_argument("--batch", type=int, default=2, help="micro_batch_size")
    p.add_argument("--seq", type=int, default=8192,
                   help="sequence_len (above the longest row: no row is cut)")  # fmt: skip
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--smoke", action="store_true",
                   help="the CPU check: --shape qwen25vl-tiny --device cpu --rows 24 "
                        "--budgets 0.25 (below the tiny model's whole-logits peak, so the "
                        "plan must trade memory; no allocator to cap on the CPU)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="of the dataset")
    p.add_argument("--work", type=Path, default=Path("/tmp/vlm_accuracy"))
    p.add_argument("--out", type=Path, required=True, help="the rows file (appended)")
    p.add_argument("--timeout-s", type=int, default=540, help="per budget")
    p.add_argument("--time-limit", type=float,
                   help="seconds for this whole invocation (model build included): each "
                        "budget's run is stopped by then, its row written")  # fmt: skip
    p.add_argument("--run-id")
    p.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.device = "qwen25vl-tiny", "cpu"
        args.rows = args.rows if "--rows" in (argv or sys.argv) else 24
        args.budgets = args.budgets if "--budgets" in (argv or sys.argv) else "0.25"
    try:
        args.budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets {args.budgets!r}: want GiB numbers separated by commas, e.g. 16,24")
    if args.rows < 1 or args.batch < 1:
        p.error("--rows and --batch must be at least 1")
    return args


def byte_tokenizer():
    """One token a byte plus Qwen's special tokens, with the Qwen2-VL chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from protrain.train.data.templates import BUILTIN_TEMPLATES

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    fast.eos_token, fast.pad_token = "<|im_end|>", "<|endoftext|>"
    fast.chat_template = BUILTIN_TEMPLATES["qwen2_vl"]
    return fast


def build_processor(tokenizer):
    """transformers' Qwen2.5-VL processor at the 7B-Instruct checkpoint's image settings
    (its video processor needs torchvision: so does loading it back in the app)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    images = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                      patch_size=14, merge_size=2, temporal_patch_size=2)  # fmt: skip
    return Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer,
                               video_processor=Qwen2VLVideoProcessor(),
                               chat_template=tokenizer.chat_template)  # fmt: skip


def build_model_dir(work: Path, shape: str, device: str) -> tuple[Path, int]:
    """The model (random weights, bf16), tokenizer and processor in one directory, built
    once per shape; its parameter count."""
    import torch
    import transformers

    from materialize import materialize, saved_param_count
    from workloads import hf_vlm_config

    path = work / shape
    if not (path / "config.json").exists():
        tokenizer = byte_tokenizer()
        processor = build_processor(tokenizer)  # first: without torchvision, fail before the build
        ids = {key: tokenizer.convert_tokens_to_ids(tok) for key, tok in (
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"), ("eos_token_id", "<|im_end|>"),
            ("pad_token_id", "<|endoftext|>"))}  # fmt: skip
        config = hf_vlm_config(shape, ids)
        if max(ids.values()) >= config.text_config.vocab_size:
            raise SystemExit(f"{shape}: vocab_size {config.text_config.vocab_size} is below "
                             f"the tokenizer's ids ({max(ids.values())})")  # fmt: skip
        torch.manual_seed(0)
        with torch.device("meta"):
            model = transformers.AutoModelForImageTextToText.from_config(config,
                                                                         dtype=torch.bfloat16)  # fmt: skip
        model = materialize(model, "cpu", device)
        partial = path.with_name(path.name + ".partial")  # a save cut short is not reused
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        processor.save_pretrained(partial)
        partial.rename(path)
        del model
    return path, saved_param_count(path)


def write_dataset(work: Path, n_rows: int, seed: int) -> tuple[Path, dict]:
    """`n_rows` chat rows with 0-4 images of IMAGE_SIZES each (one PNG file per size, of
    random pixels); the counts of images by number per row."""
    import numpy as np
    from PIL import Image

    images = work / "images"
    images.mkdir(parents=True, exist_ok=True)
    noise = np.random.default_rng(seed)
    for w, h in IMAGE_SIZES:
        f = images / f"{w}x{h}.png"
        if not f.exists():
            pixels = noise.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(f)
    rng = random.Random(seed)
    rows, per_count = [], {}
    for i in range(n_rows):
        n_images = rng.randint(0, 4)
        per_count[n_images] = per_count.get(n_images, 0) + 1
        picked = [rng.choice(IMAGE_SIZES) for _ in range(n_images)]
        content = [{"type": "image"} for _ in picked]
        content.append({"type": "text", "text": f"Row {i}: what do these show?"})
        answer = " ".join(f"w{rng.randint(0, 999)}" for _ in range(rng.randint(10, 300)))
        rows.append({
            "messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": answer}],
            "images": [f"images/{w}x{h}.png" for w, h in picked],
        })  # fmt: skip
    path = work / f"rows-{n_rows}-seed{seed}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, dict(sorted(per_count.items()))


def write_config(run: Path, model_dir: Path, data: Path, args, budget: float) -> Path:
    import yaml

    cfg = {
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
        "mixed_precision": "bf16" if args.device == "cuda" else "no",
        "datasets": [{"path": str(data), "type": "chat"}],
        "sequence_len": args.seq,
        "sample_packing": False,
        "micro_batch_size": args.batch,
        "gradient_accumulation_steps": 1,
        "num_epochs": 1,
        "learning_rate": 1e-5,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "max_grad_norm": None,
        "logging_steps": 1,
        "save_minutes": None,  # the adapter is saved once, at the end
        "output_dir": str(run),
        "seed": 7,
        "device": args.device,
        "memory": {"auto": True, "gpu_budget": f"{budget}GiB"},
        "adapter": {"type": "lora", "r": LORA_RANK, "alpha": 2 * LORA_RANK, "dropout": 0.0,
                    "target_modules": "all-linear"},
    }  # fmt: skip
    path = run.with_name(f"{run.name}.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_budget(args, model_dir: Path, n_params: int, data: Path, per_count: dict,
               budget: float, run_id: str, timeout_s: int) -> dict:  # fmt: skip
    """One `protrain train` run for the whole epoch at `budget`; its row."""
    run = args.work / f"{args.shape}-{budget:g}gib-run"
    shutil.rmtree(run, ignore_errors=True)
    config = write_config(run, model_dir, data, args, budget)
    peaks_file = run.with_name(f"{run.name}-peaks.json")
    peaks_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "protrain", "train", str(config)]
    if args.device == "cuda":
        cmd = [
            sys.executable,
            "-c",
            _CAPPED_APP,
            str(budget),
            str(peaks_file),
            "train",
            str(config),
        ]
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}")
    now = datetime.now(timezone.utc)
    row: dict = {
        "bench": "vlm_accuracy", "workload": "vlm", "system": "protrain_app",
        "model": args.shape, "mode": "lora", "params": n_params, "budget_gib": budget,
        "batch": args.batch, "seq": args.seq, "rows": args.rows,
        "rows_by_image_count": per_count, "image_sizes": IMAGE_SIZES, "seed": args.seed,
        "commit": args.commit, "run_id": run_id, "date": f"{now:%Y-%m-%dT%H:%M:%SZ}",
    }  # fmt: skip
    log = run.with_name(f"{run.name}.log")
    t0 = time.perf_counter()
    try:
        with log.open("w") as f:
            done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)  # fmt: skip
        returncode = done.returncode
    except subprocess.TimeoutExpired:
        returncode = None
    row["app_s"] = round(time.perf_counter() - t0, 1)
    text = log.read_text(errors="replace")
    metrics = run / "metrics.jsonl"
    records = (
        [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    steps = [r for r in records if "tokens_per_s" in r]
    check = next((r for r in records if "plan_predicted_peak_gib" in r), {})
    row["steps"] = len(steps)
    row["epoch_reached"] = steps[-1]["epoch"] if steps else 0.0
    row["planning_batch"] = next((ln.split("planning micro-batch: ", 1)[1][:400]
                                  for ln in text.splitlines() if "planning micro-batch:" in ln), None)  # fmt: skip
    if steps:
        seen = [r["tokens_seen"] for r in steps]
        real = [b - a for a, b in zip([0] + seen, seen)]
        step_s = [n / r["tokens_per_s"] for n, r in zip(real, steps) if r["tokens_per_s"] > 0]
        row.update(tokens=seen[-1], tokens_per_s=round(seen[-1] / sum(step_s), 1),
                   step_s_median=round(statistics.median(step_s), 4),
                   step_s_max=round(max(step_s), 4))  # fmt: skip
        if any("gpu_peak_gib" in r for r in steps):  # the app's per-step allocated peak
            row["peak_alloc_steps_gib"] = round(max(r.get("gpu_peak_gib", 0.0) for r in steps), 3)
    predicted = check.get("plan_predicted_peak_gib")
    row.update(
        predicted_peak_gib=predicted and round(predicted, 3),
        check_measured_peak_gib=check.get("plan_measured_peak_gib") and round(check["plan_measured_peak_gib"], 3),
        predicted_step_s=check.get("plan_predicted_step_s"),
        check_measured_step_s=check.get("plan_measured_step_s"),
        plan_corrected=check.get("plan_corrected", False),
        plan_correction=check.get("plan_correction"),
    )  # fmt: skip
    if peaks_file.exists():  # CUDA: the whole epoch's peaks in the app's process
        peaks = json.loads(peaks_file.read_text())
        row.update(gpu=peaks["gpu"], peak_reserved_gib=round(peaks["reserved"] / 2**30, 3),
                   peak_alloc_gib=round(peaks["allocated"] / 2**30, 3))  # fmt: skip
        measured = row["peak_reserved_gib"]
    else:  # CPU: the closed loop's measurement over the first steps
        measured = row["check_measured_peak_gib"]
        row["peak_source"] = "closed loop (CPU: engine device-side bytes, first steps)"
    if predicted and measured:
        row["peak_error"] = round((predicted - measured) / measured, 4)
    if check.get("plan_measured_step_s"):
        row["step_error"] = round((check["plan_predicted_step_s"] - check["plan_measured_step_s"])
                                  / check["plan_measured_step_s"], 4)  # fmt: skip
    whole_epoch = row["steps"] > 0 and row["epoch_reached"] >= 1.0 - 1e-6
    if returncode == 0 and whole_epoch:
        row["status"] = "ok"
    else:
        oom = "OutOfMemoryError" in text or "out of memory" in text.lower()
        row["status"] = "oom" if oom else "error"
        reason = f"timeout after {timeout_s} s" if returncode is None else f"exit {returncode}"
        if returncode == 0:
            reason = f"exit 0 but the epoch stopped at {row['epoch_reached']}"
        row["error"] = f"{reason}: {text[-1500:]}"
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir, n_params = build_model_dir(args.work, args.shape, args.device)
    build_s = round(time.perf_counter() - t0, 1)
    data, per_count = write_dataset(args.work, args.rows, args.seed)
    print(f"{model_dir}: {n_params / 1e6:,.1f} M parameters ({build_s} s); {args.rows} rows, "
          f"by image count {per_count}", file=sys.stderr, flush=True)  # fmt: skip
    run_id = args.run_id or f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%MZ}-{args.commit[:7]}"
    failed = 0
    for budget in args.budgets:
        timeout_s = args.timeout_s
        if args.time_limit:
            timeout_s = int(min(timeout_s, args.time_limit - (time.perf_counter() - t0)))
            if timeout_s < 60:
                print(f"{budget:g} GiB: not started, {timeout_s} s left", file=sys.stderr)
                failed += 1
                continue
        row = run_budget(args, model_dir, n_params, data, per_count, budget, run_id, timeout_s)
        row["model_build_s"] = build_s
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        print(f"{budget:g} GiB: {row['status']}, predicted {row.get('predicted_peak_gib')} GiB, "
              f"measured {row.get('peak_reserved_gib', row.get('check_measured_peak_gib'))} GiB, "
              f"error {row.get('peak_error')}, {row['steps']} steps, "
              f"{row.get('tokens_per_s')} tokens/s", file=sys.stderr, flush=True)  # fmt: skip
        failed += row["status"] != "ok"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
