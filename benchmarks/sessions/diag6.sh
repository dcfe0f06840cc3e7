#!/usr/bin/env bash
# Session 6, call 1: where the GPU time of lora-14b and full-3b goes, by operator (the step
# timeline's new `ops` table); full-3b without clipping as a plan-accuracy row with the
# trace's allocator term read after emptying the cache (the trace now empties it after its
# first step). Chunked loss, no clipping. Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
T="python3 benchmarks/step_timeline.py --commit $C --steps 2 --warmup 2 --max-grad-norm 0"
for w in lora-14b full-3b; do
  timeout 200 $T --workload $w $A --bin-ms 10 --out "$OUT/timeline.jsonl" 2>&1 \
    | grep '^{\|Error' | cut -c1-300
done
timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py --steps 5 --warmup 2 \
  --max-grad-norm 0 --timeout-s 170 --run-id "$RID" --out "$OUT/plan-accuracy.jsonl" \
  --only full-3b 2>&1 | grep -v '^{' | tail -3
echo "elapsed $((SECONDS - T0)) s"
