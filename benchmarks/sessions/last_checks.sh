#!/usr/bin/env bash
# Session 3, GPU call 5 (one H200): fits (80 GiB) in auto mode beside plain PyTorch in one
# run, batch 1 and 8, clipping 1.0; then plan-accuracy rows not yet measured with the swap
# term and the cache fix (3B LoRA at 24 GiB, two 8B LoRA shapes, lora-14b). Needs .whl.
set -u
LIMIT=${LIMIT:-560}
source benchmarks/sessions/lib.sh
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --workload fits --out $OUT/fits.jsonl"
for b in 1 8; do
  for s in plain "protrain --auto"; do
    timeout 60 $R --batch $b --system $s 2>&1 | grep '^{' | tail -1 | cut -c1-420
  done
done
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 5)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 150 --run-id "$RID" --out $OUT/plan-accuracy.jsonl --only \
  ${CONFIGS:-extra-3b-lora-24-b1-s512,extra-8b-lora-24-b2-s4096,lora-14b,extra-8b-lora-16-b1-s8192} \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
