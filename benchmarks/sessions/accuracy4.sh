#!/usr/bin/env bash
# Session 4: plan accuracy after the chunk-size search and the per-piece host updates
# (clipping at 1.0, the script's default, as the earlier plan-accuracy runs). Needs .whl.
set -u
source benchmarks/sessions/lib.sh
timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py --steps 3 --warmup 1 \
  --timeout-s 120 --run-id "$RID" --out "$OUT/plan-accuracy.jsonl" --only \
  ${CONFIGS:-full-3b,extra-8b-lora-24-b2-s4096,extra-3b-full-40-b2-s4096,extra-1b-full-24-b4-s4096,extra-3b-lora-16-b4-s8192} \
  2>&1 | grep -v '^{' | tail -6
echo "elapsed $((SECONDS - T0)) s"
