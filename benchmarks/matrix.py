"""Run a whole row of the benchmark matrix: every system of the row, each in its own
process (so that each sees the same empty GPU and the same budget), under one run_id.

    python benchmarks/matrix.py --workload full-3b
    python benchmarks/matrix.py --workload fits --systems protrain,plain --batch 1

Options not listed here (--steps, --warmup, --n-persist, --n-buffer, --budget-gib, --seq,
--tiny, --out, --commit, --lr) are passed to run.py unchanged.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import git_commit  # noqa: E402
from workloads import SYSTEMS, WORKLOADS  # noqa: E402

RUN = Path(__file__).resolve().parent / "run.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--systems", help="comma-separated; default: the workload's row")
    p.add_argument("--batch", type=int, help="default: every batch size of the workload")
    p.add_argument("--run-id")
    p.add_argument("--timeout-s", type=float, default=1800, help="per system")
    args, passthrough = p.parse_known_args(argv)

    workload = WORKLOADS[args.workload]
    names = args.systems.split(",") if args.systems else list(workload.systems)
    for name in names:
        if name not in SYSTEMS:
            p.error(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    commit = git_commit()
    if "--commit" not in passthrough:
        passthrough += ["--commit", commit]
    run_id = args.run_id or f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%MZ}-{commit[:7]}"
    batches = [args.batch] if args.batch else list(workload.batches)

    failed = 0
    for batch in batches:
        for name in names:
            cmd = [sys.executable, str(RUN), "--workload", args.workload, "--system", name,
                   "--batch", str(batch), "--run-id", run_id, *passthrough]  # fmt: skip
            print("+", " ".join(cmd), flush=True)
            try:
                failed += subprocess.run(cmd, timeout=args.timeout_s).returncode != 0
            except subprocess.TimeoutExpired:
                print(f"{name} at batch {batch} ran past {args.timeout_s} s", flush=True)
                failed += 1
    print(f"run_id {run_id}: {failed} of {len(batches) * len(names)} rows failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
