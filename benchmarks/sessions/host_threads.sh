#!/usr/bin/env bash
# Session 2, GPU call 3 (one H200): full-3b hand knobs without clipping (step_in_backward)
# at host AdamW thread counts 14/12/8 (16 ran in call 2), then the plan-accuracy
# configurations whose plain-loss trace ran out of memory, now with the chunked loss.
# Needs .whl carried (pydantic, pytest). Results under $OUT.
set -u
T0=$SECONDS; LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - (SECONDS - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}; RID="$(date -u +%Y-%m-%dT%H:%MZ)-$C"
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2"
row() {  # row <max seconds> <args...>
  local t=$1; shift; local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped (time): $*"; return; }
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" $R "$@" 2>&1 | grep '^{' | tail -1 | cut -c1-1200
}
K="--workload full-3b --system protrain --n-persist 1 --n-buffer 3 --chunk-mib 769 --out $OUT/full3b.jsonl"
for t in ${THREADS:-14 12 8}; do row 90 $K --max-grad-norm 0 --host-threads $t; done
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 10)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 110 --out $OUT/plan-accuracy.jsonl --only \
  ${CONFIGS:-extra-1b-lora-16-b8-s2048,extra-3b-lora-16-b4-s8192,extra-1b-full-24-b4-s4096} \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
