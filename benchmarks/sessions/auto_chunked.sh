#!/usr/bin/env bash
# Session 3, GPU call 3 (one H200): auto mode with the app's chunked loss (4096 tokens of
# logits at a time), no clipping: lora-14b (FSDP2's anchor is 2,074 tokens/s at batch 2; it
# runs out of memory at batch 4 in the fp32 logits), full-3b, and FSDP2 CPU offload on
# full-3b in the same run; then plan-accuracy configurations until the time is up.
# Needs .whl carried. Results under $OUT.
set -u
T0=$SECONDS; LIMIT=${LIMIT:-585}
left() { echo $(( LIMIT - (SECONDS - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}; RID="$(date -u +%Y-%m-%dT%H:%MZ)-$C"
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
row() {  # row <max seconds> <args...>
  local t=$1; shift; local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped (time): $*"; return; }
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" $R "$@" 2>&1 | grep '^{\|Error' | tail -2 | cut -c1-1500
}
A="--system protrain --auto --chunked-loss-tokens 4096"
row 300 --workload lora-14b $A --out $OUT/lora14b.jsonl
row 120 --workload full-3b $A --out $OUT/full3b.jsonl
row 100 --workload full-3b --system fsdp2_offload --out $OUT/full3b.jsonl
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 5)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 120 --run-id "$RID" --out $OUT/plan-accuracy.jsonl --only \
  ${CONFIGS:-extra-1b-full-24-b4-s4096,extra-3b-full-40-b2-s4096,extra-3b-lora-16-b4-s8192,full-3b} \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
