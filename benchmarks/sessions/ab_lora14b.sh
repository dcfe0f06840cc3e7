#!/usr/bin/env bash
# Session 3, GPU call 2 (one H200): full-3b hand knobs without clipping, the engine before
# (9490515, carried in .old/src) and after a800a01, side by side; lora-14b in auto mode;
# then plan-accuracy configurations until the time is up. Needs .whl and .old carried.
set -u
source benchmarks/sessions/lib.sh
NEW=/tmp/site:$PWD/src:$PWD OLD=/tmp/site:$PWD/.old/src:$PWD
R="python3 benchmarks/run.py --run-id $RID --steps 5 --warmup 2"
K="--workload full-3b --system protrain --n-persist 1 --n-buffer 3 --chunk-mib 769 --max-grad-norm 0"
PYTHONPATH=$OLD timeout 90 $R --commit 9490515 $K --out $OUT/ab.jsonl 2>&1 | grep '^{' | cut -c1-700
PYTHONPATH=$NEW timeout 90 $R --commit $C $K --out $OUT/ab.jsonl 2>&1 | grep '^{' | cut -c1-700
export PYTHONPATH=$NEW
timeout 260 $R --commit $C --workload lora-14b --system protrain --auto --max-grad-norm 0 \
  --out $OUT/lora14b.jsonl 2>&1 | grep -v Warning | tail -3 | cut -c1-1500
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 5)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 120 --run-id "$RID" --out $OUT/plan-accuracy.jsonl --only \
  fits-b1,extra-3b-lora-24-b1-s512,extra-1b-full-16-b2-s1024,extra-1b-lora-16-b8-s2048,fits-b8,extra-3b-full-16-b1-s2048 \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
