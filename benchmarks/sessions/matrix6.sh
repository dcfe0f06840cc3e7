#!/usr/bin/env bash
# Session 6, last calls (argument D or E). D: the engine, plan and QLoRA GPU tests at the
# session's engine commit; qlora-70b as a plan-accuracy row without clipping (its allocator
# term now read after the trace empties the cache; its chunks no longer write the 4-bit base
# back every step), profiles kept; lora-14b in auto mode (no clipping). E: plan accuracy again
# (clipped) where the allocator term was inflated, and full-3b and lora-14b. F: after the step
# keeps resident chunks, GPU tests and the lora-14b and full-3b rows. Needs .whl and COMMIT.
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
  E)  # the configurations whose allocator term the optimizer-step interval had inflated
    timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py --timeout-s 200 \
      --run-id "$RID" --out "$OUT/plan-accuracy.jsonl" --profiles "$OUT/profiles" --only \
      extra-3b-full-16-b1-s2048,extra-1b-full-16-b2-s1024,full-3b,fits-b8,extra-3b-full-24-b8-s1024,extra-1b-full-40-b8-s2048,lora-14b \
      2>&1 | grep -v '^{' | grep -i 'configurations ran\|peak error\|Error' | tail -4
    ;;
  F)  # the step keeps resident chunks (refresh): GPU tests, then lora-14b and full-3b
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/plan \
      -k "not wrap_close_cycles" 2>&1 | tail -6 | tee "$OUT/gpu-tests.log"
    row 200 --workload lora-14b $A --out "$OUT/auto.jsonl"
    row 170 --workload full-3b $A --out "$OUT/auto.jsonl"
    ;;
esac
# the device returns at most 8 files: the profiles travel as one archive
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
echo "elapsed $((SECONDS - T0)) s"
