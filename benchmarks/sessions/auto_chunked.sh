#!/usr/bin/env bash
# Session 3, GPU call 3 (one H200): auto mode with the app's chunked loss (4096 tokens of
# logits at a time), no clipping: lora-14b (FSDP2's anchor is 2,074 tokens/s at batch 2; it
# runs out of memory at batch 4 in the fp32 logits), full-3b, and FSDP2 CPU offload on
# full-3b in the same run; then plan-accuracy configurations until the time is up.
# Needs .whl carried. Results under $OUT.
set -u
source benchmarks/sessions/lib.sh
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
A="--system protrain --auto --chunked-loss-tokens 4096"
row 300 --workload lora-14b $A --out $OUT/lora14b.jsonl
row 120 --workload full-3b $A --out $OUT/full3b.jsonl
row 100 --workload full-3b --system fsdp2_offload --out $OUT/full3b.jsonl
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 5)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 120 --run-id "$RID" --out $OUT/plan-accuracy.jsonl --only \
  ${CONFIGS:-extra-1b-full-24-b4-s4096,extra-3b-full-40-b2-s4096,extra-3b-lora-16-b4-s8192,full-3b} \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
