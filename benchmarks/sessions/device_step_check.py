"""Session 15 check (issue 22 item 1): device-stepped offloaded chunks on full-3b at 24 GiB.

One `benchmarks/run.py` row per `--n-device-step` value (0, then the given ones), each
planned with that value fixed (`--auto`: the planner picks the other knobs for it, so a
value whose staging and gradients do not fit beside the fastest plan gets a plan with fewer
buffers, or no plan), clipping on, random weights built on meta as run.py does. Prints one JSON line per row: tokens/s, step seconds, host
AdamW seconds a step, the device step's seconds and link bytes each way, the gathers' and
gradients' link bytes, peak GiB and the plan's predictions; the full rows go to OUT_JSONL.

Usage: python benchmarks/sessions/device_step_check.py OUT_JSONL [N ...]   (default N: 1 2 3)
"""

import json
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
out = Path(sys.argv[1])
values = [0] + ([int(v) for v in sys.argv[2:]] or [1, 2, 3])
run_id = f"device-step-check-{int(time.time())}"
for n in values:
    cmd = [
        sys.executable, str(BENCH / "run.py"), "--workload", "full-3b", "--system", "protrain",
        "--budget-gib", "24", "--auto", "--n-device-step", str(n), "--steps", "5",
        "--warmup", "2", "--out", str(out), "--run-id", run_id,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        print(json.dumps({"n_device_step": n, "status": "no row", "rc": done.returncode,
                          "stderr_tail": done.stderr[-2000:]}))  # fmt: skip
        continue
    row = json.loads(lines[-1])
    plan = row.get("plan") or {}
    print(
        json.dumps(
            {
                "n_device_step": n,
                "planned_n_device_step": plan.get("planned_n_device_step"),
                "status": row.get("status"),
                "error": row.get("error"),
                "tokens_per_s": row.get("tokens_per_s"),
                "step_s": row.get("step_s"),
                "host_adam_s": row.get("host_adam_s"),
                "host_clip_s": row.get("host_clip_s"),
                "wait_cpu_optimizer_s": row.get("wait_cpu_optimizer_s"),
                "device_step_s": row.get("device_step_s"),
                "device_step_h2d_bytes": row.get("device_step_h2d_bytes"),
                "device_step_d2h_bytes": row.get("device_step_d2h_bytes"),
                "h2d_bytes": row.get("h2d_bytes"),
                "d2h_bytes": row.get("d2h_bytes"),
                "copy_busy_s": row.get("copy_busy_s"),
                "peak_alloc_gib": row.get("peak_alloc_gib"),
                "peak_reserved_gib": row.get("peak_reserved_gib"),
                "predicted_peak_gib": row.get("predicted_peak_gib"),
                "predicted_step_s": row.get("predicted_step_s"),
                "knobs": {
                    k: plan.get(k) for k in ("n_persist", "n_buffer", "n_swap", "n_checkpoint")
                },  # fmt: skip
            }
        ),
        flush=True,
    )
