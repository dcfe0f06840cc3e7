"""Final losses with each host optimizer state format (``optimizer_state``).

Trains one workload once per format, with every chunk offloaded (``memory.n_persist=0``) so
that the host's one pass steps every parameter, one run at a time, and writes one JSON row
per format: the final train loss (the last logged window), the mean train loss of the last
40 steps, the final eval loss, and each against the fp32 run's in percent. The runs are
seeded alike, so their differences are the state format's.

Workloads:
- ``quickstart``: the embedded quickstart (384 steps). Its tiny model memorizes its small
  chat set (train loss near 0.05 at the end), so a few percent there is noise: compare
  seeds before reading a difference.
- ``text-tiny`` (CPU) and ``text-0.5b`` (GPU): a random-init Llama (about 10M and 0.57B
  parameters) learns the running Python's standard-library source as plain text with the
  quickstart's tokenizer. The loss levels off well above zero, so the formats' gap is
  readable in percent. Built in ``--work``; nothing is downloaded.

    PYTHONPATH=src python benchmarks/state_convergence.py --out rows.jsonl
    PYTHONPATH=src python benchmarks/state_convergence.py --workload text-tiny
    PYTHONPATH=src python benchmarks/state_convergence.py --formats bf16 --set max_steps=50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from rows import emit  # benchmarks/: this script's folder is on sys.path

FORMATS = ("fp32", "bf16", "8bit")
TAIL_STEPS = 40  # the train loss averaged over the last this many steps
QUICKSTART_TOKENIZER = Path(__file__).resolve().parents[1] / "src/protrain/train/quickstart"
# hidden, intermediate, layers, heads, sequence, micro-batch, steps; the corpus holds about
# 2.5 characters a token (the quickstart's 512-token BPE on Python source), enough for one
# epoch of the steps
TEXT_WORKLOADS = {
    "text-tiny": (128, 352, 4, 4, 128, 16, 384),
    "text-0.5b": (1536, 4096, 20, 12, 1024, 8, 300),
}
CHARS_PER_TOKEN = 2.5


def write_text_workload(name: str, work: Path) -> Path:
    """The model directory, corpus and config of a ``text-*`` workload under ``work``."""
    hidden, inter, layers, heads, seq, batch, steps = TEXT_WORKLOADS[name]
    model_dir = work / "model"
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=512,
        max_position_embeddings=seq,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)  # the same initial weights for every format
    LlamaForCausalLM(config).save_pretrained(model_dir)
    piece = int(seq * CHARS_PER_TOKEN * 0.8)  # a row a little under sequence_len; packed
    chars = int(steps * batch * seq * CHARS_PER_TOKEN * 1.1)
    texts, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        src = f.read_text(errors="replace")
        for i in range(0, len(src), piece):
            texts.append(src[i : i + piece])
            total += len(texts[-1])
        if total >= chars:
            break
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = {
        "model": {
            "name_or_path": str(model_dir),
            "tokenizer": str(QUICKSTART_TOKENIZER / "tokenizer"),
        },
        "datasets": [{"path": str(corpus), "type": "text"}],
        "sequence_len": seq,
        "sample_packing": True,
        "micro_batch_size": batch,
        "max_steps": steps,
        "learning_rate": 1.0e-3,
        "lr_scheduler": "cosine",
        "warmup_steps": steps // 20,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "seed": 42,
        "logging_steps": 10,
        "val_set_size": 0.02,
        "eval": {"steps": steps},
    }
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def train(fmt: str, out_dir: Path, extra: list[str], config: Path | None) -> float:
    """One run of ``config`` (the quickstart's if None) with ``optimizer_state=fmt`` into
    ``out_dir``; its seconds."""
    sets = [
        "memory.n_persist=0",
        "memory.n_buffer=2",
        f"optimizer_state={fmt}",
        f"output_dir={out_dir}",
        "save_steps=100000",  # no checkpoint but the last
        *extra,
    ]
    cmd = [sys.executable, "-m", "protrain", "train", *([str(config)] if config else [])]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with open(out_dir.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return time.perf_counter() - t0


def losses(out_dir: Path) -> dict:
    """The final train loss, the mean of the last ``TAIL_STEPS`` steps', the final eval loss."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    last = train_rows[-1]["step"]
    tail = [r["loss"] for r in train_rows if r["step"] > last - TAIL_STEPS]
    return {
        "steps": last,
        "final_loss": train_rows[-1]["loss"],
        "tail_loss": sum(tail) / len(tail),
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--workload", default="quickstart", choices=["quickstart", *TEXT_WORKLOADS])
    ap.add_argument("--set", action="append", default=[], help="another config override")
    ap.add_argument("--work", default=None, help="where the runs go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="state_convergence_"))
    work.mkdir(parents=True, exist_ok=True)
    config = None if args.workload == "quickstart" else write_text_workload(args.workload, work)
    results = {}
    for fmt in args.formats:
        out_dir = work / fmt
        seconds = train(fmt, out_dir, args.set, config)
        results[fmt] = {"seconds": round(seconds, 1), **losses(out_dir)}
    base = results.get("fp32")
    for fmt, r in results.items():
        row = {
            "bench": "state_convergence",
            "workload": args.workload,
            "optimizer_state": fmt,
            **r,
            "host": platform.node(),
            "python": platform.python_version(),
            "threads": os.environ.get("OMP_NUM_THREADS"),
            "overrides": args.set,
        }
        if base is not None:
            for key in ("final_loss", "tail_loss", "final_eval_loss"):
                if r[key] is not None and base[key]:
                    row[f"{key}_vs_fp32_pct"] = round(100 * (r[key] / base[key] - 1), 3)
        emit(row, args.out)


if __name__ == "__main__":
    main()
