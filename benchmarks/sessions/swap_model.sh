#!/usr/bin/env bash
# Session 3, GPU call 4 (one H200): after the swap term of the runtime model (plans now
# pay for swapped blocks' copies): lora-14b and full-3b in auto mode with the chunked loss,
# no clipping; then the plan-accuracy configurations whose plans swapped. Needs .whl.
set -u
source benchmarks/sessions/lib.sh
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
A="--system protrain --auto --chunked-loss-tokens 4096 --out $OUT/auto.jsonl"
row 240 --workload lora-14b $A
row 100 --workload full-3b $A
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 5)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 120 --run-id "$RID" --out $OUT/plan-accuracy.jsonl --only \
  ${CONFIGS:-extra-3b-lora-16-b4-s8192,full-3b,extra-1b-full-24-b4-s4096,extra-1b-lora-16-b8-s2048} \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
