#!/usr/bin/env bash
# Session 5, call 4 (last): the engine, plan and QLoRA GPU tests at the session's last
# engine commit; qlora-70b as a plan-accuracy row again (the chunk sizes now screened
# without swap; PEFT's 4-bit LoRA layers now wrap the base); full-3b without clipping as a
# plan-accuracy row, for the terms of its step prediction (call 1: 1.036 s predicted, 0.792
# measured). Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/plan \
  -k "not wrap_close_cycles" 2>&1 | tail -15 | tee "$OUT/gpu-tests.log"
timeout 300 python3 benchmarks/plan_accuracy.py --steps 3 --warmup 2 --max-grad-norm 0 \
  --chunked-loss-tokens 2048 --timeout-s 290 --run-id "$RID" --out "$OUT/plan-accuracy.jsonl" \
  --only qlora-70b 2>&1 | grep -v '^{' | tail -3
timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py --steps 5 --warmup 2 \
  --max-grad-norm 0 --timeout-s 150 --run-id "$RID" --out "$OUT/plan-accuracy.jsonl" \
  --only full-3b 2>&1 | grep -v '^{' | tail -3
echo "elapsed $((SECONDS - T0)) s"
