#!/usr/bin/env bash
# Session 5, call 3: the QLoRA GPU test again (fixed: a deep copy dropped the mark that
# keeps the 4-bit scales fp32), qlora-70b as a plan-accuracy row (memory and time terms;
# call 2's auto row: peak 20.07 GiB reserved against 23.52 predicted, step 2.457 s against
# 2.097), and lora-14b in auto mode with the loss chunked by 1,024 tokens (call 2's
# timeline: the 209 ms host stall at the output layer was gone). Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_qlora.py 2>&1 \
  | tail -25 | tee "$OUT/qlora-gpu-tests.log"
timeout 300 python3 benchmarks/plan_accuracy.py --steps 3 --warmup 2 --max-grad-norm 0 \
  --chunked-loss-tokens 2048 --timeout-s 290 --run-id "$RID" --out "$OUT/plan-accuracy.jsonl" \
  --only qlora-70b 2>&1 | grep -v '^{' | tail -6
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
row 200 --workload lora-14b --system protrain --auto --chunked-loss-tokens 1024 \
  --out "$OUT/auto.jsonl"
echo "elapsed $((SECONDS - T0)) s"
