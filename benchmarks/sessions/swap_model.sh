#!/usr/bin/env bash
# Session 3, GPU call 4 (one H200): after the swap term of the runtime model (plans now
# pay for swapped blocks' copies): lora-14b and full-3b in auto mode with the chunked loss,
# no clipping; then the plan-accuracy configurations whose plans swapped. Needs .whl.
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
  timeout "$t" $R "$@" 2>&1 | grep '^{\|Error' | tail -2 | cut -c1-1200
}
A="--system protrain --auto --chunked-loss-tokens 4096 --out $OUT/auto.jsonl"
row 240 --workload lora-14b $A
row 100 --workload full-3b $A
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 5)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 120 --run-id "$RID" --out $OUT/plan-accuracy.jsonl --only \
  ${CONFIGS:-extra-3b-lora-16-b4-s8192,full-3b,extra-1b-full-24-b4-s4096,extra-1b-lora-16-b8-s2048} \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
