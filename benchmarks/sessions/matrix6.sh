#!/usr/bin/env bash
# Session 6, last calls (argument D or E). D: the engine, plan and QLoRA GPU tests at the
# session's engine commit; qlora-70b as a plan-accuracy row without clipping (its allocator
# term now read after the trace empties the cache; its chunks no longer write the 4-bit base
# back every step), profiles kept; lora-14b in auto mode. E: full-3b in auto mode with FSDP2
# CPU offload beside it. No clipping, chunked loss. Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
case "$1" in
  D)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/plan \
      -k "not wrap_close_cycles" 2>&1 | tail -6 | tee "$OUT/gpu-tests.log"
    timeout 300 python3 benchmarks/plan_accuracy.py --steps 3 --warmup 2 --max-grad-norm 0 \
      --chunked-loss-tokens 2048 --timeout-s 290 --run-id "$RID" --profiles "$OUT/profiles" \
      --out "$OUT/plan-accuracy.jsonl" --only qlora-70b 2>&1 | grep -v '^{' | tail -3
    row 200 --workload lora-14b $A --out "$OUT/auto.jsonl"
    ;;
  E)
    row 170 --workload full-3b $A --out "$OUT/auto.jsonl"
    row 120 --workload full-3b --system fsdp2_offload --out "$OUT/auto.jsonl"
    row 200 --workload lora-14b $A --out "$OUT/auto.jsonl"
    ;;
esac
echo "elapsed $((SECONDS - T0)) s"
