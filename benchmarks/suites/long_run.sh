#!/usr/bin/env bash
# The long run (benchmarks/long_run.py): `protrain train` with LoRA under memory.auto for
# 500 steps, checkpoints every 100, killed with SIGKILL after checkpoints 200 and 400 and
# resumed, against the same run uninterrupted twice (the device's run-to-run floor): losses
# and the final adapter compared. One GPU, a 2 GiB budget, a small Llama shape.
#   BUDGET (default 2GiB), STEPS (default 500)
source "$(dirname "$0")/lib.sh"
machine
timeout $(( $(left) - 10 )) python3 benchmarks/long_run.py --commit "$C" \
  --gpu-budget "${BUDGET:-2GiB}" --steps "${STEPS:-500}" --hidden 512 --layers 8 --seq 256 \
  --work /tmp/long_run --out "$OUT/long-run.jsonl" 2>&1 | tail -3
grep -i "plan\|persist\|chunk" /tmp/long_run/straight.log 2>/dev/null | head -20 > "$OUT/long-run-plan.log"
tail -c 3000 /tmp/long_run/killed.log > "$OUT/long-run-killed-tail.log" 2>/dev/null
echo "elapsed $((SECONDS - T0)) s"
