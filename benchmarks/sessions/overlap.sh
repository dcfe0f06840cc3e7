#!/usr/bin/env bash
# Session 3, GPU call 1 (one H200): the host worker's forward-order ranking and piecewise
# gathers of updating chunks. full-3b at 24 GiB: hand knobs with and without clipping,
# auto mode without clipping, and FSDP2 CPU offload without clipping in the same run (for
# a ratio within one run); then the engine GPU tests. Needs .whl carried. Results in $OUT.
set -u
T0=$SECONDS; LIMIT=${LIMIT:-575}
left() { echo $(( LIMIT - (SECONDS - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}; RID="$(date -u +%Y-%m-%dT%H:%MZ)-$C"
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --workload full-3b --out $OUT/full3b.jsonl"
row() {  # row <max seconds> <args...>
  local t=$1; shift; local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped (time): $*"; return; }
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" $R "$@" 2>&1 | grep '^{' | tail -1 | cut -c1-1500
}
K="--system protrain --n-persist 1 --n-buffer 3 --chunk-mib 769"
row 90 $K --max-grad-norm 0
row 90 $K
row 120 --system protrain --auto --max-grad-norm 0
row 150 --system fsdp2_offload --max-grad-norm 0
l=$(left); [ "$l" -gt 40 ] && timeout $((l - 5)) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/engine -k "not wrap_close_cycles" 2>&1 | tail -12 | tee $OUT/engine-gpu-tests.log
echo "elapsed $((SECONDS - T0)) s"
