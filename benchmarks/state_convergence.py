"""The quickstart's final loss with each host optimizer state format (``optimizer_state``).

Trains the embedded quickstart (``protrain train`` with no config: 384 steps) once per
format, with every chunk offloaded (``memory.n_persist=0``) so that the host's one pass
steps every parameter, one run at a time, and writes one JSON row per format: the final
train loss (step 384's logged window), the mean train loss of the last 40 steps, the final
eval loss, and each against the fp32 run's in percent. The runs are seeded alike, so their
differences are the state format's.

    PYTHONPATH=src python benchmarks/state_convergence.py --out rows.jsonl
    PYTHONPATH=src python benchmarks/state_convergence.py --formats bf16 --set max_steps=50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rows import emit  # benchmarks/: this script's folder is on sys.path

FORMATS = ("fp32", "bf16", "8bit")
TAIL_STEPS = 40  # the train loss averaged over the last this many steps


def train(fmt: str, out_dir: Path, extra: list[str]) -> float:
    """One quickstart run with ``optimizer_state=fmt`` into ``out_dir``; its seconds."""
    sets = [
        "memory.n_persist=0",
        "memory.n_buffer=2",
        f"optimizer_state={fmt}",
        f"output_dir={out_dir}",
        "save_steps=100000",  # no checkpoint but the last
        *extra,
    ]
    cmd = [sys.executable, "-m", "protrain", "train"]
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
    ap.add_argument("--set", action="append", default=[], help="another config override")
    ap.add_argument("--work", default=None, help="where the runs go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="state_convergence_"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for fmt in args.formats:
        out_dir = work / fmt
        seconds = train(fmt, out_dir, args.set)
        results[fmt] = {"seconds": round(seconds, 1), **losses(out_dir)}
    base = results.get("fp32")
    for fmt, r in results.items():
        row = {
            "bench": "state_convergence",
            "optimizer_state": fmt,
            **r,
            "host": platform.node(),
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
