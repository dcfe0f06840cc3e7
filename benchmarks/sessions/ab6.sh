#!/usr/bin/env bash
# Session 6, last call: full-3b in auto mode with the step keeping resident chunks (HEAD)
# and without (267c741's src, copied to ab_src/), one after the other on one machine.
set -u
source benchmarks/sessions/lib.sh
row 140 --workload full-3b $A --out "$OUT/ab.jsonl"
PYTHONPATH=/tmp/site:$PWD/ab_src/src:$PWD timeout 140 python3 benchmarks/run.py --commit 267c741 \
  --run-id "$RID" --steps 5 --warmup 2 --max-grad-norm 0 --workload full-3b $A \
  --out "$OUT/ab.jsonl" 2>&1 | grep '^{\|Error' | tail -2 | cut -c1-1500
echo "elapsed $((SECONDS - T0)) s"
