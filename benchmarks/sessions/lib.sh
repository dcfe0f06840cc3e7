# Sourced by the session scripts (since session 3): the device machine's set-up and the
# helpers every call used. Needs .whl carried (pydantic, pytest, bitsandbytes; see
# benchmarks/README.md).
# Sets T0, LIMIT (default 585 s), C (COMMIT), RID (the run id rows share), PYTHONPATH, and
# A / R (auto mode flags, the run.py command) that scripts may redefine.
T0=$SECONDS; LIMIT=${LIMIT:-585}
left() { echo $(( LIMIT - (SECONDS - T0) )); }  # seconds left of this call's budget
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site ${WHL:-.whl}/*.whl >/dev/null 2>&1  # WHL=.whl-lite: no bitsandbytes
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}; RID=${RID:-"$(date -u +%Y-%m-%dT%H:%MZ)-$C"}  # a given RID: rows beside an earlier call's on the same warm machine
row() {  # row <max seconds> <args...>: one benchmarks/run.py row ($R: its command), JSON out
  local t=$1; shift; local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped (time): $*"; return; }
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" $R "$@" 2>&1 | grep '^{\|Error' | tail -2 | cut -c1-1500
}
A="--system protrain --auto --chunked-loss-tokens 4096"  # auto mode as the app runs it
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
full3b_beside_fsdp2() {  # engine + plan GPU tests, then full-3b auto and FSDP2 beside it
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/plan \
    -k "not wrap_close_cycles" 2>&1 | tail -4 | tee "$OUT/gpu-tests.log"
  row 170 --workload full-3b $A --out "$OUT/auto.jsonl"
  row 120 --workload full-3b --system fsdp2_offload --out "$OUT/auto.jsonl"
}
